"""One split of a token file (petra_mpi/prep/text.py) as context windows, with the surface of the
image sources (source.py) so that BatchLoader samples, shards and resumes it as it does images.

Item i of a split is the window starting at token i·context: its input is context tokens and its
target the next token of each, so the windows tile the split without overlap and an epoch sees
every token once as a target (the last < context + 1 tokens excepted). A training epoch is a
permutation of the windows seeded by (run seed, epoch), each replica reading its own share
(loader.py). `take(indices)` gives (inputs (B, context) int64, targets flattened to
(B·context,) int64): the head's logits are (B·context, vocabulary), so the per-token
cross-entropy is the ordinary classification loss.
"""
import os

import numpy as np

from .hdf5 import open_readonly


class TokenSource:
    kind = "tokens"
    hflip = False

    def __init__(self, path, split):
        self.path, self.split = str(path), split
        with open_readonly(self.path) as f:
            if f.attrs.get("kind") != "tokens" or f"{split}/tokens" not in f:
                raise ValueError(f"{self.path}: not a token file (pack one with "
                                 f"python -m petra_mpi.prep.text, docs/data.md)")
            # a token split is small next to images (1 byte per character): held in memory
            self.tokens = f[f"{split}/tokens"][()]
            self.num_classes = int(f.attrs["num_classes"])
            self.bytes_per_token = float(f.attrs.get("bytes_per_token", 1.0))
            self.vocab = f["vocab"][()].decode("utf-8") if "vocab" in f else None
        self.context = None
        # BatchLoader's normalisation constants, unused: token ids are not normalised
        self.mean, self.std, self.image_size = (0.0, 0.0, 0.0), (1.0, 1.0, 1.0), 0

    def set_context(self, context: int):
        """Cut the split into windows of `context` tokens; refuses a split too short for one."""
        if len(self.tokens) < context + 1:
            raise ValueError(f"{self.path}: the {self.split} split has {len(self.tokens)} tokens, "
                             f"fewer than model.context {context} + 1: shorten the context or "
                             f"pack more text")
        self.context = int(context)
        return self

    def __len__(self):
        return (len(self.tokens) - 1) // self.context

    def take(self, indices):
        starts = np.asarray(indices, dtype=np.int64)[:, None] * self.context
        windows = self.tokens[starts + np.arange(self.context + 1)].astype(np.int64)
        return windows[:, :-1], windows[:, 1:].reshape(-1)

    def take_labels(self, indices):
        return self.take(indices)[1]

    def read(self, start, stop):
        return self.take(np.arange(start, stop))

    def __repr__(self):
        return (f"TokenSource({os.path.basename(self.path)!r}, {self.split}, "
                f"{len(self.tokens)} tokens, context {self.context})")


def is_token_file(path) -> bool:
    if str(path) == "synthetic" or not os.path.isfile(path):
        return False
    try:
        with open_readonly(str(path)) as f:
            return f.attrs.get("kind") == "tokens"
    except OSError:  # not HDF5: the image reader says so, naming the file
        return False


def bytes_per_token(path) -> float:
    """UTF-8 bytes per token of the file's validation text: bits per byte = nats per token /
    ln 2 / this."""
    with open_readonly(str(path)) as f:
        return float(f.attrs.get("bytes_per_token", 1.0))
