"""Pack downsampled ImageNet (Chrabaszcz et al. 2017: Imagenet32x32, Imagenet64x64, ...).

  python -m petra_mpi.prep.imagenet32 --source DIR --out imagenet32.h5

DIR holds the released batches `train_data_batch_1` ... `train_data_batch_10` and `val_data`,
as .npz (the npz release) or pickles (the older release), with or without the suffix. Each
holds `data`, N x 3*S*S uint8 (R, G and B planes), and `labels` in 1..1000. Labels are stored
0-based; the image side S (32, 64, ...) is read from the data.
"""
import argparse
import math
import os
import re
import time
import zipfile

import numpy as np

from .common import (ArrayWriter, ChannelStats, PrepError, Progress, add_output_options,
                     atomic_h5, claim_output, load_pickle, planes_to_nhwc, print_summary,
                     run_cli, write_root_attrs)

NUM_CLASSES = 1000
ROWS_PER_WRITE = 16384  # bounds the transposed copy of a batch (64x64: 200 MB)


def find_files(source):
    """Return (train batch paths in batch order, val path)."""
    if not os.path.isdir(source):
        raise PrepError(f"--source {source} is not a directory")
    numbered, val = {}, None
    for name in os.listdir(source):
        m = re.fullmatch(r"train_data_batch_(\d+)(\.npz)?", name)
        if m:
            numbered[int(m.group(1))] = os.path.join(source, name)
        elif re.fullmatch(r"val_data(\.npz)?", name):
            val = os.path.join(source, name)
    if not numbered:
        raise PrepError(f"{source}: no train_data_batch_<k>[.npz] files")
    missing = sorted(set(range(1, max(numbered) + 1)) - numbered.keys())
    if missing:
        raise PrepError(f"{source}: train_data_batch_{missing[0]} is missing")
    if val is None:
        raise PrepError(f"{source}: no val_data[.npz] file")
    return [numbered[k] for k in sorted(numbered)], val


def load_batch(path):
    """(rows uint8 (N, 3*S*S), 0-based labels int64 (N,), S) from one released batch."""
    if zipfile.is_zipfile(path):  # the .npz release
        try:
            with np.load(path, allow_pickle=False) as z:
                d = {k: z[k] for k in ("data", "labels") if k in z.files}
        except Exception as e:
            raise PrepError(f"{path}: cannot read npz ({e})") from None
    else:  # the pickled release
        with open(path, "rb") as f:
            d = load_pickle(f, path)
    for key in ("data", "labels"):
        if key not in d:
            raise PrepError(f"{path}: no '{key}' array")
    rows, labels = np.asarray(d["data"]), np.asarray(d["labels"]).astype(np.int64)
    size = int(round(math.sqrt(rows.shape[-1] / 3))) if rows.ndim == 2 else 0
    if rows.dtype != np.uint8 or rows.ndim != 2 or 3 * size * size != rows.shape[1]:
        raise PrepError(f"{path}: data is {rows.dtype}{rows.shape}, expected uint8 (N, 3*S*S)")
    if labels.shape != (len(rows),):
        raise PrepError(f"{path}: {labels.size} labels for {len(rows)} images")
    bad = np.flatnonzero((labels < 1) | (labels > NUM_CLASSES))
    if len(bad):  # reported in the file's own 1-based numbering
        raise PrepError(f"{path}: label {labels[bad[0]]} at index {bad[0]} is outside "
                        f"1..{NUM_CLASSES} ({len(bad)} bad labels)")
    return rows, labels - 1, size


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m petra_mpi.prep.imagenet32", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--source", required=True, help="directory with train_data_batch_* and val_data")
    add_output_options(p)
    args = p.parse_args(argv)

    start = time.monotonic()
    train_files, val_file = find_files(args.source)
    claim_output(args, train_files + [val_file])
    stats, size = ChannelStats(), None
    bar = Progress(len(train_files) + 1, "batches")
    with atomic_h5(args.out) as f:
        writers = {}
        for split, path in [("train", t) for t in train_files] + [("val", val_file)]:
            rows, labels, s = load_batch(path)
            if size is None:
                size = s
            elif s != size:
                raise PrepError(f"{path}: {s}x{s} images, but earlier batches are {size}x{size}")
            if split not in writers:
                writers[split] = ArrayWriter(f, split, size, size)
            for lo in range(0, len(rows), ROWS_PER_WRITE):
                images = planes_to_nhwc(rows[lo:lo + ROWS_PER_WRITE], size)
                writers[split].append(images, labels[lo:lo + ROWS_PER_WRITE])
                if split == "train":
                    stats.update(images)
            bar.advance()
        bar.close()
        for writer in writers.values():
            writer.close()
        write_root_attrs(f, num_classes=NUM_CLASSES, stats=stats, source=f"imagenet{size}")
    print_summary(args.out, start)


if __name__ == "__main__":
    run_cli(main)
