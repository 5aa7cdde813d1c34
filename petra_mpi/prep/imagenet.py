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
Every image is decoded, converted to RGB, resized so its shorter side is --size (bilinear,
antialiased) and re-encoded as JPEG quality 90. mean/std are exact over all resized training
images (taken before re-encoding; JPEG rounding moves them by well under 1e-3).
--shard i/n packs the i-th (0-based) of n contiguous slices of each split's sorted file list;
`merge` checks that the shards are all there and from the same file list, then joins them:
the result reads exactly as a single-pass pack. By default the join writes only labels, offsets
and an HDF5 virtual dataset over the shards' JPEG bytes (the shard files must stay beside it);
`merge --copy` copies the bytes into a file that stands alone.
"""
import argparse
import collections
import contextlib
import functools
import hashlib
import io
import itertools
import multiprocessing
import os
import re
import sys
import time

import h5py
import numpy as np
from PIL import Image

from ..data.source import open_readonly

from .common import (SPLITS, ChannelStats, JpegWriter, PrepError, Progress, atomic_h5,
                              print_summary, run_cli, interrupts_held_back, worker_init,
                              write_root_attrs)

IMAGE_EXTENSIONS = (".jpeg", ".jpg", ".png")
QUALITY = 90
MERGE_BLOCK_BYTES = 64 << 20


def list_images(folder):
    return sorted(os.path.join(folder, n) for n in os.listdir(folder)
                  if n.lower().endswith(IMAGE_EXTENSIONS))


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


def file_list_digest(source, items):
    """Fingerprint of the file list and labels: shards from different lists cannot merge."""
    h = hashlib.sha1()
    for split in SPLITS:
        for path, label in items[split]:
            h.update(f"{split}\t{os.path.relpath(path, source)}\t{label}\n".encode())
    return h.hexdigest()


def encode(path, size):
    """Worker: (jpeg bytes, ChannelStats of the resized pixels, error or None) for one file."""
    try:
        with Image.open(path) as im:
            # For JPEGs, let libjpeg decode at 1/2, 1/4 or 1/8 scale when that still leaves at
            # least `size` pixels on each side: much faster for large photos.
            im.draft("RGB", (size, size))
            im = im.convert("RGB")
    except Exception as e:  # any decoding failure is an input error, reported with the path
        return None, None, f"{type(e).__name__}: {e}"
    w, h = im.size
    new = (size, max(1, round(h * size / w))) if w <= h else (max(1, round(w * size / h)), size)
    im = im.resize(new, Image.BILINEAR)  # Pillow's resize antialiases when it shrinks
    stats = ChannelStats().update(np.asarray(im))
    out = io.BytesIO()
    im.save(out, "JPEG", quality=QUALITY)
    return out.getvalue(), stats, None


@contextlib.contextmanager
def ordered_map(workers, chunk=8):
    """Yield a map(fn, items) that preserves order, over `workers` processes (or in-process).

    At most 2 * workers chunks of `chunk` items are handed to the pool and not yet consumed: a
    consumer that stalls (a slow file system under the writer) stops the workers instead of
    letting finished images pile up in memory. Leaving the `with` (end, error, Ctrl-C)
    terminates the pool. Open it before any output file: forked workers would otherwise inherit
    the file's descriptor and HDF5 lock."""
    if workers <= 1:
        yield map
        return
    with interrupts_held_back():  # no worker may see a Ctrl-C before worker_init ignores it
        pool = multiprocessing.Pool(workers, initializer=worker_init)
    with pool:
        yield functools.partial(bounded_imap, pool, chunk=chunk, max_chunks=2 * workers)


def bounded_imap(pool, fn, items, *, chunk, max_chunks):
    """pool.imap(fn, items) in order, with at most max_chunks chunks submitted and unconsumed.

    Items are drawn from `items` only as room frees up, in the caller's thread."""
    items = iter(items)
    pending = collections.deque()
    while True:
        while len(pending) < max_chunks:
            batch = list(itertools.islice(items, chunk))
            if not batch:
                break
            pending.append(pool.apply_async(map_list, (fn, batch)))
        if not pending:
            return
        yield from pending.popleft().get()


def map_list(fn, batch):
    """Worker side of bounded_imap: one chunk."""
    return [fn(x) for x in batch]


def shard_range(n, index, count):
    return n * index // count, n * (index + 1) // count


def pack(args):
    start = time.monotonic()
    classes, items = scan(args)
    totals = {split: len(items[split]) for split in SPLITS}
    if args.shard:
        digest = file_list_digest(args.source, items)
        i, n = args.shard
        items = {s: items[s][slice(*shard_range(len(items[s]), i, n))] for s in SPLITS}
    todo = [(split, path, label) for split in SPLITS for path, label in items[split]]
    stats = ChannelStats()
    bar = Progress(len(todo), "images")
    with ordered_map(args.workers) as pmap, atomic_h5(args.out) as f:
        writers = {split: JpegWriter(f, split) for split in SPLITS}
        results = pmap(functools.partial(encode, size=args.size), [path for _, path, _ in todo])
        for (split, path, label), (data, st, err) in zip(todo, results):
            if err is not None:
                raise PrepError(f"cannot decode image {path}: {err}")
            writers[split].append(data, label)
            if split == "train":
                stats.add(st)
            bar.advance()
        bar.close()
        for writer in writers.values():
            writer.close()
        write_root_attrs(f, num_classes=len(classes), stats=stats, source="imagenet",
                         classes=classes, image_size=np.int64(args.size))
        if args.shard:  # what merge needs to check completeness and recombine mean/std exactly
            stats.to_attrs(f.attrs)
            f.attrs["shard_index"], f.attrs["shard_count"] = args.shard
            f.attrs["file_list_sha1"] = digest
            for split in SPLITS:
                f.attrs[f"{split}_total"] = np.int64(totals[split])
    print_summary(args.out, start)


def merge(args):
    start = time.monotonic()
    shards = []
    for path in args.shards:
        try:
            f = open_readonly(path)
        except OSError as e:
            raise PrepError(f"cannot open shard {path}: {e}") from None
        if "shard_index" not in f.attrs:
            raise PrepError(f"{path} is not a shard file (no shard_index attribute)")
        shards.append((path, f))
    try:
        first_path, first = shards[0]
        n = int(first.attrs["shard_count"])
        for key in ("shard_count", "file_list_sha1", "image_size", "source", "num_classes"):
            for path, f in shards[1:]:
                if f.attrs[key] != first.attrs[key]:
                    raise PrepError(f"{path}: {key}={f.attrs[key]} but {first_path} has {first.attrs[key]}")
        by_index = {}
        for path, f in shards:
            i = int(f.attrs["shard_index"])
            if i in by_index:
                raise PrepError(f"{path} and {by_index[i][0]} are both shard {i}/{n}")
            by_index[i] = (path, f)
        missing = sorted(set(range(n)) - by_index.keys())
        if missing:
            raise PrepError(f"shard {missing[0]}/{n} is missing ({len(missing)} missing)")
        ordered = [by_index[i] for i in range(n)]
        for i, (path, f) in enumerate(ordered):
            for split in SPLITS:
                lo, hi = shard_range(int(f.attrs[f"{split}_total"]), i, n)
                if len(f[split]["labels"]) != hi - lo:
                    raise PrepError(f"{path}: {len(f[split]['labels'])} {split} images, expected {hi - lo}")

        stats = ChannelStats()
        with atomic_h5(args.out) as out:
            for split in SPLITS:
                if args.copy:
                    copy_split(out, split, ordered)
                else:
                    link_split(out, split, ordered, os.path.dirname(os.path.realpath(args.out)))
            for _, f in ordered:
                stats.add(ChannelStats.from_attrs(f.attrs))
            classes = [c.decode() for c in first["classes"][:]]
            write_root_attrs(out, num_classes=int(first.attrs["num_classes"]), stats=stats,
                             source=first.attrs["source"], classes=classes,
                             image_size=np.int64(first.attrs["image_size"]))
    finally:
        for _, f in shards:
            f.close()
    print_summary(args.out, start)


def copy_split(out, split, ordered):
    """Join one split by copying every shard's bytes into `out` (the file stands alone)."""
    writer = JpegWriter(out, split)
    bar = Progress(sum(len(f[split]["labels"]) for _, f in ordered), f"{split} images")
    for _, f in ordered:
        offsets, labels, jpeg = f[split]["offsets"][:], f[split]["labels"][:], f[split]["jpeg"]
        a = 0
        while a < len(labels):  # copy blocks of whole images, ~64 MB at a time
            b = int(np.searchsorted(offsets, offsets[a] + MERGE_BLOCK_BYTES, "right")) - 1
            b = min(max(b, a + 1), len(labels))
            writer.append_many(jpeg[offsets[a]:offsets[b]], offsets[a:b + 1] - offsets[a],
                               labels[a:b])
            bar.advance(b - a)
            a = b
    bar.close()
    writer.close()


def link_split(out, split, ordered, out_dir):
    """Join one split without copying image bytes: /<split>/jpeg becomes an HDF5 virtual
    dataset that maps each shard's /<split>/jpeg end to end, and the small offsets (rebased by
    the bytes of the shards before) and labels are written for real. The shard files are named
    relative to the joined file, which HDF5 resolves from the joined file's folder: the folder
    of the joined file and of the shards can move together, but the shards must stay (or be
    found through HDF5_VDS_PREFIX). The relative names are taken between real paths: the
    system resolves a `..` after a symbolic link from the link's target."""
    sizes = [f[split]["jpeg"].shape[0] for _, f in ordered]
    layout = h5py.VirtualLayout(shape=(sum(sizes),), dtype=np.uint8)
    offsets, labels, base = [np.zeros(1, np.int64)], [], 0
    for (path, f), size in zip(ordered, sizes):
        name = os.path.relpath(os.path.realpath(path), out_dir)
        layout[base:base + size] = h5py.VirtualSource(name, f"{split}/jpeg", shape=(size,))
        offsets.append(f[split]["offsets"][1:] + base)
        labels.append(f[split]["labels"][:])
        base += size
    out.create_virtual_dataset(f"{split}/jpeg", layout)
    out.create_dataset(f"{split}/offsets", data=np.concatenate(offsets))
    out.create_dataset(f"{split}/labels", data=np.concatenate(labels).astype(np.int64))


def parse_shard(text):
    m = re.fullmatch(r"(\d+)/(\d+)", text)
    if not m or not int(m.group(1)) < int(m.group(2)):
        raise argparse.ArgumentTypeError(f"expected i/n with 0 <= i < n, got '{text}'")
    return int(m.group(1)), int(m.group(2))


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["merge"]:
        p = argparse.ArgumentParser(
            prog="python -m petra_mpi.prep.imagenet merge",
            description="Join shard files (any order) into one file. By default the joined file "
                        "holds only labels, offsets and a virtual view of the shards' image bytes "
                        "(seconds, no extra space; the shards must stay where they are); --copy "
                        "writes a file that stands alone.")
        p.add_argument("--out", required=True, help="the joined HDF5 file to write")
        p.add_argument("--copy", action="store_true",
                       help="copy the image bytes instead of referring to the shard files")
        p.add_argument("shards", nargs="+", help="the shard files, all n of them")
        merge(p.parse_args(argv[1:]))
        return
    p = argparse.ArgumentParser(prog="python -m petra_mpi.prep.imagenet", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--source", required=True, help="directory holding train/ and val/")
    p.add_argument("--out", required=True, help="the HDF5 file (or shard file) to write")
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
    pack(args)


if __name__ == "__main__":
    run_cli(main)
