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

import h5py
import numpy as np

from .checks import (DataError, describe_dataset, load_whole, positive_int, shown,
                     stored_problems, virtual_problems)
from .hdf5 import open_readonly


class TokenSource:
    kind = "tokens"
    hflip = False

    def __init__(self, path, split):
        self.path, self.split = str(path), split
        with open_readonly(self.path) as f:
            if f.attrs.get("kind") != "tokens" or f"{split}/tokens" not in f:
                raise DataError(f"{self.path}: not a token file (pack one with "
                                f"python -m petra_mpi.prep.text, docs/data.md)")
            self.num_classes = positive_int(f.attrs.get("num_classes"))
            d = f[f"{split}/tokens"]
            problems = virtual_problems(f, self.path) + stored_problems(f, [f"{split}/tokens"])
            if self.num_classes is None:
                problems.append(f"attr num_classes is {shown(f.attrs.get('num_classes'))}, "
                                f"expected the vocabulary size, a positive integer")
            if not isinstance(d, h5py.Dataset) or d.ndim != 1 \
                    or not np.issubdtype(d.dtype, np.integer):
                problems.append(f"/{split}/tokens is {describe_dataset(d)}, expected integers (N,)")
            per_token = np.asarray(f.attrs.get("bytes_per_token", 1.0))
            if per_token.ndim or not np.issubdtype(per_token.dtype, np.number):
                problems.append(f"attr bytes_per_token is {shown(f.attrs['bytes_per_token'])}, "
                                f"expected a number")
            v = f.get("vocab")  # a char vocabulary: one string
            vocab = v[()] if isinstance(v, h5py.Dataset) and v.shape == () else None
            if v is not None and not isinstance(vocab, bytes):
                problems.append("/vocab is not one string")
            if problems:
                raise DataError(f"{self.path}: {problems[0]}")
            # a token split is small next to images (1 byte per character): held in memory
            self.tokens = load_whole(d, self.path)
            ids = self.tokens
            if len(ids) and (ids.min() < 0 or ids.max() >= self.num_classes):
                raise DataError(f"{self.path}: /{split}/tokens holds ids outside [0, "
                                f"{self.num_classes}) (num_classes)")
            self.bytes_per_token = float(per_token)
            self.vocab = vocab.decode("utf-8", "replace") if vocab is not None else None
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
