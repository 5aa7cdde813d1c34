"""Pack ILSVRC2012 (full-size ImageNet) into the encoded-JPEG variant of the schema.

  python -m petra_mpi.prep.imagenet --source DIR --out imagenet.h5 [--size 256] [--workers N]
  python -m petra_mpi.prep.imagenet --source DIR --out part0.h5 --shard 0/4     (then 1/4, 2/4, 3/4)
  python -m petra_mpi.prep.imagenet merge --out imagenet.h5 part0.h5 part1.h5 part2.h5 part3.h5 [--copy]

Layout of DIR: train/<wnid>/*.JPEG; the classes are the sorted train folder names. The
validation images are either in val/<wnid>/*.JPEG folders, or flat in val/*.JPEG with
--val-labels FILE in one of these forms (auto-detected):
  - "FILENAME WNID" per line (spaces or a comma; more fields and a header line are ignored;
    Kaggle's LOC_val_solution.csv works as is);
  - one WNID per line, for the files in sorted name order;
  - one ILSVRC2012 id (1..1000) per line, for the files in sorted name order (the devkit's
    ILSVRC2012_validation_ground_truth.txt), plus --synsets FILE whose line k is the wnid of
    id k (the devkit order, which is NOT the sorted order).
Every image is decoded, turned upright by its EXIF orientation, converted to RGB, resized so
its shorter side is --size (bilinear, antialiased) and re-encoded as JPEG quality 90
(petra_mpi.prep.pictures.encode). mean/std are exact over all resized training
images (taken before re-encoding; JPEG rounding moves them by well under 1e-3).
--shard i/n packs the i-th (0-based) of n contiguous slices of each split's sorted file list;
`merge` checks that the shards are all there and from the same file list, then joins them:
the result reads exactly as a single-pass pack. By default the join writes only labels, offsets
and an HDF5 virtual dataset over the shards' JPEG bytes (the shard files must stay beside it);
`merge --copy` copies the bytes into a file that stands alone.
"""
import argparse
import os
import re
import sys
import time

from .common import SPLITS, PrepError, add_output_options, claim_output, run_cli, shown
from .pictures import NOT_REGULAR
from .shards import merge_main, pack_items, parse_shard

IMAGE_EXTENSIONS = (".jpeg", ".jpg", ".png")


def list_images(folder):
    with os.scandir(folder) as entries:
        images = [e for e in entries if e.name.lower().endswith(IMAGE_EXTENSIONS)]
    for entry in images:
        if not entry.is_file():  # links followed; no system call for plain files
            raise PrepError(f"{shown(entry.path)}: {NOT_REGULAR}")
    return sorted(e.path for e in images)


def subfolders(folder):
    return sorted(n for n in os.listdir(folder) if os.path.isdir(os.path.join(folder, n)))


def read_val_labels(path, files, classes, synsets_path):
    """Labels of the flat val files from --val-labels (formats in the module docstring)."""
    index = {wnid: i for i, wnid in enumerate(classes)}
    try:
        with open(path) as fh:
            rows = [re.split(r"[,\s]+", line.strip()) for line in fh if line.strip()]
    except OSError as e:
        raise PrepError(f"--val-labels: {e}") from None
    if rows and rows[0][0] == "ImageId":  # the header of Kaggle's csv
        rows = rows[1:]

    def label_of(wnid, where):
        if wnid not in index:
            raise PrepError(f"{where}: '{wnid}' is not one of the train classes")
        return index[wnid]

    if rows and len(rows[0]) >= 2:  # "FILENAME WNID"
        by_stem = {os.path.splitext(os.path.basename(r[0]))[0]: (r[1], n + 1)
                   for n, r in enumerate(rows) if len(r) >= 2}
        labels = []
        for f in files:
            stem = os.path.splitext(os.path.basename(f))[0]
            if stem not in by_stem:
                raise PrepError(f"{path}: no label for {f}")
            wnid, line = by_stem[stem]
            labels.append(label_of(wnid, f"{path}:{line}"))
        return labels
    if len(rows) != len(files):
        raise PrepError(f"{path}: {len(rows)} labels for {len(files)} files in val/")
    if all(r[0].isdigit() for r in rows):  # devkit ids
        if synsets_path is None:
            raise PrepError(f"{path} holds ILSVRC2012 ids: --synsets FILE (wnid of id k on line k) is needed")
        with open(synsets_path) as fh:
            wnids = [line.split()[0] for line in fh if line.strip()]
        labels = []
        for n, r in enumerate(rows):
            k = int(r[0])
            if not 1 <= k <= len(wnids):
                raise PrepError(f"{path}:{n + 1}: id {k} is outside 1..{len(wnids)} of {synsets_path}")
            labels.append(label_of(wnids[k - 1], f"{path}:{n + 1}"))
        return labels
    return [label_of(r[0], f"{path}:{n + 1}") for n, r in enumerate(rows)]  # one wnid per line


def scan(args):
    """The classes and, per split, the sorted list of (path, label)."""
    train_dir, val_dir = os.path.join(args.source, "train"), os.path.join(args.source, "val")
    for d in (train_dir, val_dir):
        if not os.path.isdir(d):
            raise PrepError(f"{d} is not a directory")
    classes = subfolders(train_dir)
    if not classes:
        raise PrepError(f"{train_dir} has no class folders")
    items = {"train": [(p, i) for i, c in enumerate(classes)
                       for p in list_images(os.path.join(train_dir, c))]}
    val_classes = subfolders(val_dir)
    if val_classes:
        unknown = sorted(set(val_classes) - set(classes))
        if unknown:
            raise PrepError(f"{val_dir}/{unknown[0]} is not one of the train classes")
        items["val"] = [(p, classes.index(c)) for c in val_classes
                        for p in list_images(os.path.join(val_dir, c))]
    else:
        files = list_images(val_dir)
        if not args.val_labels:
            raise PrepError(f"{val_dir} holds no class folders: --val-labels FILE is needed")
        items["val"] = list(zip(files, read_val_labels(args.val_labels, files, classes, args.synsets)))
    for split in SPLITS:
        if not items[split]:
            raise PrepError(f"no images found for the {split} split under {args.source}")
    return classes, items


def pack(args):
    start = time.monotonic()
    classes, items = scan(args)
    pack_items(args, classes, items, start=start, source="imagenet")


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["merge"]:
        merge_main("python -m petra_mpi.prep.imagenet", argv[1:])
        return
    p = argparse.ArgumentParser(prog="python -m petra_mpi.prep.imagenet", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--source", required=True, help="directory holding train/ and val/")
    add_output_options(p, "the HDF5 file (or shard file) to write")
    p.add_argument("--size", type=int, default=256, help="shorter side after resizing (default 256)")
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    p.add_argument("--workers", type=int, default=usable,
                   help="decoding processes (default: the usable cores)")
    p.add_argument("--shard", type=parse_shard, help="i/n: pack only the i-th of n slices")
    p.add_argument("--val-labels", help="labels of a flat val/ folder (formats above)")
    p.add_argument("--synsets", help="wnid of ILSVRC2012 id k on line k (with a devkit id list)")
    args = p.parse_args(argv)
    if args.size < 1:
        p.error("--size must be positive")
    claim_output(args, [os.path.join(args.source, "train"), os.path.join(args.source, "val")]
                 + [path for path in (args.val_labels, args.synsets) if path])
    pack(args)


if __name__ == "__main__":
    run_cli(main)
