"""Pack plain text into token ids for the causal language models (model.arch revlm / lm).

    python -m petra_mpi.prep.text --source FILES_OR_DIR [...] --out data/text.h5
        [--vocab bytes|char] [--val-fraction 0.1]

The files (a folder: every file under it, in name order) are concatenated, turned into token ids
and cut into a training split (the head) and a validation split (the tail `--val-fraction`).
Hidden files and folders under a folder (.DS_Store, .git) and empty files (.gitkeep) are skipped,
each named in a note; only when nothing is left is it an error.
`--vocab bytes` (default): one token per byte, vocabulary 256, any file accepted. `--vocab char`:
one token per Unicode character of the UTF-8 text, the vocabulary being the characters that occur
(sorted), stored in the file.

The token schema: petra_mpi/data/schema.py and docs/data.md.
"""
import argparse
import os
import time

import h5py
import numpy as np

from .common import (SCHEMA_VERSION, SPLITS, PrepError, add_output_options, atomic_h5,
                     claim_output, open_unlocked, run_cli)

CHUNK = 1 << 20  # tokens per HDF5 chunk


def find_text_files(sources):
    """(files to pack, skipped): every file named, and every file under every folder named, in
    name order, less the files nobody means as text: under a folder the hidden ones (.DS_Store,
    anything under .git), and empty files anywhere (.gitkeep). skipped: (path, why) for each."""
    files, skipped = [], []
    for source in sources:
        if os.path.isdir(source):
            found = []
            for d, dirs, names in os.walk(source):
                hidden = sorted(n for n in dirs if n.startswith("."))
                skipped += [(os.path.join(d, n), "a hidden folder") for n in hidden]
                dirs[:] = [n for n in dirs if not n.startswith(".")]
                found += [os.path.join(d, n) for n in names]
            if not found:
                raise PrepError(f"{source}: the folder holds no files")
            for path in sorted(found):
                if os.path.basename(path).startswith("."):
                    skipped.append((path, "a hidden file"))
                else:
                    files.append(path)
        elif os.path.isfile(source):
            files.append(source)
        else:
            raise PrepError(f"{source}: no such file or folder")
    skipped += [(path, "the file is empty") for path in files if os.path.getsize(path) == 0]
    files = [path for path in files if os.path.getsize(path) > 0]
    if not files:
        raise PrepError("no text to pack: " + "; ".join(f"{p}: {why}" for p, why in skipped))
    return files, skipped


def read_texts(files, vocab):
    """The files' contents: bytes, or str for a character vocabulary (strict UTF-8)."""
    texts = []
    for path in files:
        with open(path, "rb") as fh:
            data = fh.read()
        if vocab == "char":
            try:
                data = data.decode("utf-8")
            except UnicodeDecodeError as e:
                raise PrepError(f"{path}: byte {e.start} is not UTF-8 ({e.reason}); a character "
                                f"vocabulary needs UTF-8 text (--vocab bytes takes any file)") \
                    from None
        texts.append(data)
    return texts


def encode(texts, vocab):
    """(token ids, vocabulary size, the characters of a char vocabulary or None, UTF-8 bytes per
    token as a function of a token range)."""
    if vocab == "bytes":
        return np.frombuffer(b"".join(texts), dtype=np.uint8), 256, None
    text = "".join(texts)
    chars = sorted(set(text))
    if len(chars) < 2:
        raise PrepError("the text has fewer than 2 distinct characters: nothing to predict")
    index = {c: i for i, c in enumerate(chars)}
    dtype = np.uint8 if len(chars) <= 256 else np.int32
    return np.fromiter((index[c] for c in text), dtype=dtype, count=len(text)), len(chars), chars


def describe_tokens(f):
    """Human-readable lines about an open token file (the packer's summary and verify's)."""
    a = f.attrs
    lines = [f"  {split}: {len(f[split]['tokens']):,} tokens" for split in SPLITS
             if f"{split}/tokens" in f]
    lines.append(f"  vocabulary: {a.get('num_classes')} ({a.get('vocab')}), bytes per token "
                 f"{a.get('bytes_per_token')}")
    lines.append(f"  source: {a.get('source')}, schema_version {a.get('schema_version')}")
    return lines


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m petra_mpi.prep.text", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--source", required=True, nargs="+",
                   help="text files, or folders whose files are all text")
    add_output_options(p)
    p.add_argument("--vocab", choices=("bytes", "char"), default="bytes",
                   help="bytes (256 ids, default) or char (the characters of the UTF-8 text)")
    p.add_argument("--val-fraction", type=float, default=0.1,
                   help="the tail fraction of the tokens that forms the validation split")
    args = p.parse_args(argv)
    if not 0 < args.val_fraction < 1:
        p.error("--val-fraction must be between 0 and 1")

    start = time.monotonic()
    claim_output(args, args.source)
    files, skipped = find_text_files(args.source)
    if skipped:  # said, not silent: a file the user meant as text may be among them
        print("note: skipped " + ", ".join(f"{p} ({why})" for p, why in skipped), flush=True)
    tokens, vocab_size, chars = encode(read_texts(files, args.vocab), args.vocab)
    n_val = int(round(len(tokens) * args.val_fraction))
    if n_val < 2 or len(tokens) - n_val < 2:
        raise PrepError(f"{len(tokens)} tokens are too few to split with --val-fraction "
                        f"{args.val_fraction}: each split needs at least 2")
    splits = {"train": tokens[:-n_val], "val": tokens[-n_val:]}
    if chars is None:
        bytes_per_token = 1.0
    else:  # the val split's UTF-8 size over its characters
        val_text = "".join(chars[i] for i in splits["val"])
        bytes_per_token = len(val_text.encode("utf-8")) / len(val_text)
    print(f"{len(files)} files, vocabulary {vocab_size} ({args.vocab}), "
          f"train {len(splits['train']):,} tokens, val {len(splits['val']):,} tokens", flush=True)
    with atomic_h5(args.out) as f:
        for split, ids in splits.items():
            f.create_dataset(f"{split}/tokens", data=ids, chunks=(min(CHUNK, len(ids)),))
        f.attrs["schema_version"] = np.int64(SCHEMA_VERSION)
        f.attrs["num_classes"] = np.int64(vocab_size)
        f.attrs["kind"] = "tokens"
        f.attrs["vocab"] = args.vocab
        f.attrs["bytes_per_token"] = float(bytes_per_token)
        f.attrs["source"] = ", ".join(os.path.basename(s.rstrip("/")) for s in args.source)
        if chars is not None:
            f.create_dataset("vocab", data="".join(chars), dtype=h5py.string_dtype("utf-8"))
    with open_unlocked(args.out, "r") as f:
        lines = describe_tokens(f)
    print(f"wrote {args.out} ({os.path.getsize(args.out) / 2**20:.1f} MiB) in "
          f"{time.monotonic() - start:.1f} s")
    print("\n".join(lines))


if __name__ == "__main__":
    run_cli(main)
