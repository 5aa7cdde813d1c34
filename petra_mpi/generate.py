"""`python -m petra_mpi.generate model.pt --prompt "ROMEO:" --tokens 200 [--temperature T]
[--top-k K] [--seed S] [--data FILE.h5]`

Sample text from an exported language model (model.arch revlm or lm; `python -m petra_mpi.export
RUN_DIR --out model.pt`): the prompt is encoded with the vocabulary of the token file the run
trained on (bytes, or the character vocabulary stored in that file; `--data` names the file when
it has moved), then one token at a time is drawn from the softmax of the last position's logits
over the last model.context tokens, divided by the temperature and cut to the k most likely.
Prints the prompt and its continuation.

The model file is read as weights only and checked first (export.checked_model): one it
refuses ends the command with one line, status 2.
"""
import argparse
import sys

import torch



class GenerateError(RuntimeError):
    pass


class Vocabulary:
    """Token ids <-> text: bytes (256 ids, UTF-8) or the characters of a char token file."""

    def __init__(self, chars=None):
        self.chars = chars
        self.index = {c: i for i, c in enumerate(chars)} if chars else None

    @classmethod
    def of(cls, path, size):
        try:
            if path is None:  # a model exported away from its token file
                raise ValueError("the model does not record where its token file is")
            from .data.text import TokenSource
            vocab = TokenSource(path, "val").vocab
        except (OSError, ValueError) as e:
            if size == 256:  # a byte vocabulary needs nothing from the file
                return cls()
            raise GenerateError(f"cannot read the vocabulary: {e}; name the token file the "
                                f"model trained on with --data") from None
        if (vocab is None and size != 256) or (vocab is not None and len(vocab) != size):
            raise GenerateError(f"{path} does not hold the model's vocabulary of {size} tokens")
        return cls(vocab)

    def encode(self, text):
        if self.chars is None:
            return list(text.encode("utf-8"))
        missing = sorted(set(text) - set(self.index))
        if missing:
            raise GenerateError(f"the prompt has characters outside the vocabulary: {missing}")
        return [self.index[c] for c in text]

    def decode(self, ids):
        if self.chars is None:
            return bytes(ids).decode("utf-8", errors="replace")
        return "".join(self.chars[i] for i in ids)


@torch.no_grad()
def sample(model, ids, tokens, context, temperature=1.0, top_k=0, generator=None):
    """`ids` followed by `tokens` drawn ones (a list of ints)."""
    ids = list(ids)
    for _ in range(tokens):
        window = torch.tensor([ids[-context:]], dtype=torch.long)
        logits = model(window)[-1].float()
        if temperature <= 0:  # greedy
            ids.append(int(logits.argmax()))
            continue
        logits = logits / temperature
        if top_k:
            kth = logits.topk(min(top_k, logits.numel())).values[-1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        ids.append(int(torch.multinomial(logits.softmax(-1), 1, generator=generator)))
    return ids


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m petra_mpi.generate",
                                description=__doc__.split("\n\n")[1])
    p.add_argument("model", help="an exported model (python -m petra_mpi.export)")
    p.add_argument("--prompt", default="\n", help="the text to continue")
    p.add_argument("--tokens", type=int, default=200, help="tokens to generate")
    p.add_argument("--temperature", type=float, default=1.0,
                   help="divides the logits (below 1: safer, above 1: wilder; 0: greedy)")
    p.add_argument("--top-k", type=int, default=0, help="draw among the k most likely (0: all)")
    p.add_argument("--seed", type=int, default=0, help="seed of the draws")
    p.add_argument("--data", help="the token file of the vocabulary (default: the run's)")
    from .export import add_arch_argument
    add_arch_argument(p)
    args = p.parse_args(argv)
    try:
        if args.tokens < 0 or args.top_k < 0:
            raise GenerateError("--tokens and --top-k must be >= 0")
        from .evaluate import load_saved
        from .export import ExportError, load_model, takes_tokens
        try:
            saved = load_saved(args.model, trusted=args.arch)  # weights only, and checked
        except (ExportError, ValueError) as e:
            raise GenerateError(str(e)) from None
        network = saved["network"]
        if not takes_tokens(network):
            raise GenerateError(f"{args.model} is a {network['arch']}, not a language model")
        model = load_model(saved)
        vocab = Vocabulary.of(args.data or saved["data"]["path"], network["num_classes"])
        prompt = vocab.encode(args.prompt)
        if not prompt:
            raise GenerateError("--prompt is empty")
        ids = sample(model, prompt, args.tokens, network["context"], args.temperature,
                     args.top_k, torch.Generator().manual_seed(args.seed))
    except GenerateError as e:
        print(f"petra_mpi.generate: error: {e}", file=sys.stderr)
        return 2
    print(vocab.decode(ids))
    return 0


if __name__ == "__main__":
    sys.exit(main())
