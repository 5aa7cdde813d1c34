"""Small MNIST-format (IDX) releases written by the tests, and the IDX packer run in-process."""
import gzip
import os

import numpy as np

from tests.support.launch import run_packer


def idx_bytes(array):
    """The IDX encoding of a uint8 array: magic 0x0800 | ndim, big-endian dims, C-order bytes."""
    array = np.ascontiguousarray(array, dtype=np.uint8)
    header = bytes([0, 0, 0x08, array.ndim]) + b"".join(d.to_bytes(4, "big") for d in array.shape)
    return header + array.tobytes()


def write_idx(path, array, gz):
    data = idx_bytes(array)
    with (gzip.open if gz else open)(path, "wb") as fh:
        fh.write(data)


def make_set(folder, n_train=120, n_val=40, side=28, gz=True, prefix="", test="t10k",
             classes=10, first_label=0, seed=0):
    """The four files of an IDX release with random pixels (every byte value occurs); returns
    {split: (images (N, side, side), labels (N,))}."""
    rng = np.random.default_rng(seed)
    os.makedirs(folder, exist_ok=True)
    data = {}
    for split, name, n in (("train", "train", n_train), ("val", test, n_val)):
        images = rng.integers(0, 256, (n, side, side), dtype=np.uint8)
        labels = rng.integers(first_label, first_label + classes, n).astype(np.uint8)
        suffix = ".gz" if gz else ""
        write_idx(os.path.join(folder, f"{prefix}{name}-images-idx3-ubyte{suffix}"), images, gz)
        write_idx(os.path.join(folder, f"{prefix}{name}-labels-idx1-ubyte{suffix}"), labels, gz)
        data[split] = (images, labels)
    return data


def pack(*args):
    """`python -m petra_mpi.prep.idx ARGS` in this process: (exit status, stdout, stderr)."""
    return run_packer("idx", *args)
