"""Pack a folder of pictures, one subfolder per class (torchvision's ImageFolder layout).

  python -m petra_mpi.prep.folder --source DIR --out FILE.h5 [--force] [--size 256 | --raw S]
         [--val-fraction 0.1 --seed 0] [--skip-bad] [--max-pixels N] [--workers N] [--shard i/n]
  python -m petra_mpi.prep.folder merge --out FILE.h5 [--force] part0.h5 part1.h5 ... [--copy]

Layout of DIR, either
  DIR/train/<class>/... and DIR/val/<class>/...   the two splits as they are, or
  DIR/<class>/...                                 (or DIR/train/ alone) the val split drawn from
                                                  each class: --val-fraction of its pictures
                                                  (default 0.1), chosen by --seed
The classes are the sorted names of the training class folders, stored in /classes. A class
folder may hold subfolders: every file below it is a picture of its class. Names that start with
a dot (files and folders) are ignored. Symbolic links are followed, to files and folders alike,
but not to a folder above or one read already (a loop). --out may not lie inside DIR, nor
exist unless --force.

Every picture is decoded with Pillow (any format it reads: JPEG, PNG, WebP, GIF, BMP, TIFF...;
grayscale, palette and transparent pictures too), turned upright by its EXIF orientation, made
RGB (transparency laid on white) and resized to shorter side --size, then stored as JPEG quality
90: the encoded-JPEG variant of the imagenet packer, with its --workers, --shard and merge. With
--raw S each picture is stored as S x S pixels instead (the centre square of the picture resized
to shorter side S), an array file like CIFAR's: for small pictures.

Bad input, each reported on one line: a picture that does not decode (unreadable, truncated)
or would decode to more than --max-pixels pixels, a file that is not a picture (no format
Pillow reads has its extension) or not a regular file (a FIFO, a device, a broken link), a file
beside the class folders, an empty class folder, a class folder whose name is not printable
UTF-8 text, a link that makes a loop, a class folder in val/ with no training
pictures. Without --skip-bad the first one stops the packer (exit status 2, naming it; no
output file); with it the rest is packed and each one left out is listed.
"""
import argparse
import os
import sys
import time

from .common import PrepError, add_output_options, claim_output, run_cli, shown
from .pictures import (NOT_REGULAR, VAL_FRACTION, BadInput, add_picture_options,
                       check_picture_options, draw_val, image_extensions, unfit_name)
from .shards import merge_main, pack_items, parse_shard


def visible(folder):
    """The names in `folder`, sorted, without the hidden ones."""
    try:
        return sorted(n for n in os.listdir(folder) if not n.startswith("."))
    except OSError as e:
        raise PrepError(f"{shown(folder)}: cannot be read ({e.strerror})") from None


def class_pictures(folder, problems):
    """The picture files below a class folder, sorted. Symbolic links are followed, to files and
    folders alike, but not to a folder above the class folder or one read already (a loop).
    What is not packed goes to `problems` as (where, why): files that are not pictures or not
    regular files, loops, unreadable folders, an empty class folder."""
    pictures, extensions, pending = [], image_extensions(), [folder]
    seen = set()  # (device, inode) of the folders read, and of those above the class folder
    above = os.path.realpath(folder)
    while above != os.path.dirname(above):  # up to the root, which is also above
        above = os.path.dirname(above)
        seen.add((os.stat(above).st_dev, os.stat(above).st_ino))
    while pending:
        current = pending.pop()
        try:
            st = os.stat(current)
            with os.scandir(current) as found:
                entries = [e for e in found if not e.name.startswith(".")]
        except OSError as e:
            problems.append((current, f"cannot be read ({e.strerror})"))
            continue
        if (st.st_dev, st.st_ino) in seen:
            problems.append((current, "a link to a folder above it or read already (a loop)"))
            continue
        seen.add((st.st_dev, st.st_ino))
        for entry in entries:
            if entry.is_dir():
                pending.append(entry.path)
            elif os.path.splitext(entry.name)[1].lower() not in extensions:
                problems.append((entry.path, "not a picture (no format Pillow reads has this "
                                             "extension)"))
            elif not entry.is_file():  # links followed; no system call for plain files
                problems.append((entry.path, NOT_REGULAR))
            else:
                pictures.append(entry.path)
    if not pictures:
        problems.append((folder, "empty class folder (no pictures)"))
    return sorted(pictures)


def class_folders(folder, problems):
    """{class name: its pictures} of a folder whose subfolders are the classes."""
    classes = {}
    for name in visible(folder):
        path = os.path.join(folder, name)
        if not os.path.isdir(path):
            problems.append((path, "a file beside the class folders (not in a class)"))
        elif why := unfit_name(name):
            problems.append((path, f"a class folder whose name is {why} (rename it)"))
        else:
            classes[name] = class_pictures(path, problems)
    return classes


def scan(source, val_fraction, seed, bad):
    """The classes and {split: [(path, label)]} of the folder `source` (layouts in the module
    docstring); its bad input goes to `bad` (BadInput) at once."""
    if not os.path.isdir(source):
        raise PrepError(f"{source}: not a folder")
    problems, names = [], visible(source)
    train_dir, val_dir = os.path.join(source, "train"), os.path.join(source, "val")
    has_train, has_val = os.path.isdir(train_dir), os.path.isdir(val_dir)
    if has_val and not has_train:
        raise PrepError(f"{val_dir} has no {train_dir} beside it")
    if has_val and val_fraction is not None:
        raise PrepError(f"--val-fraction draws the val split from a folder without val/, but "
                        f"{source} has {val_dir}")
    if has_train:
        for name in sorted(set(names) - {"train", "val"}):
            print(f"left out: {shown(os.path.join(source, name))} (the splits are train/ and "
                  f"val/)", file=sys.stderr)
    train = class_folders(train_dir if has_train else source, problems)
    val = class_folders(val_dir, problems) if has_val else None
    classes = [name for name, files in train.items() if files]
    for name in sorted(set(val or ()) - set(classes)):
        problems.append((os.path.join(val_dir, name), f"class only in val (no pictures in "
                                                      f"{os.path.join(train_dir, name)})"))
    bad.report(problems)
    if not classes:
        raise PrepError(f"{source}: no class folder holds a picture")
    index = {name: i for i, name in enumerate(classes)}
    pictures = [(p, i) for i, c in enumerate(classes) for p in train[c]]
    if val is None:
        fraction = VAL_FRACTION if val_fraction is None else val_fraction
        drawn = draw_val([label for _, label in pictures], classes, fraction, seed)
        return classes, {"train": [item for item, v in zip(pictures, drawn) if not v],
                         "val": [item for item, v in zip(pictures, drawn) if v]}
    items = {"train": pictures,
             "val": [(p, index[c]) for c in sorted(val) if c in index for p in val[c]]}
    if not items["val"]:
        raise PrepError(f"{val_dir}: no picture of a training class")
    return classes, items


def pack(args):
    start = time.monotonic()
    bad = BadInput(args.skip_bad, hint="--skip-bad")
    classes, items = scan(args.source, args.val_fraction, args.seed, bad)
    pack_items(args, classes, items, start=start, source="folder", bad=bad)


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["merge"]:
        merge_main("python -m petra_mpi.prep.folder", argv[1:])
        return
    p = argparse.ArgumentParser(prog="python -m petra_mpi.prep.folder", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--source", required=True, help="the folder of class folders (or of train/ "
                                                    "and val/)")
    add_output_options(p, "the HDF5 file (or shard file) to write")
    add_picture_options(p, "without val/: the share of each class drawn for the val split")
    p.add_argument("--shard", type=parse_shard, help="i/n: pack only the i-th of n slices "
                                                     "(JPEG variant)")
    args = p.parse_args(argv)
    check_picture_options(p, args)
    if args.shard and args.raw:
        p.error("--shard packs the JPEG variant; a --raw file is packed in one pass")
    claim_output(args, [args.source])
    pack(args)


if __name__ == "__main__":
    run_cli(main)
