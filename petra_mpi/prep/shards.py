"""Packing a set of pictures in shards and joining them (the JPEG variant): `--shard i/n` of
the imagenet and folder packers writes the i-th (0-based) of n contiguous slices of each
split's sorted file list, with what `merge` needs to check the set and recombine it
(write_shard_attrs); `merge` joins the shards, in any order, into a file that reads exactly as
a single-pass pack. By default the join writes only labels, offsets and an HDF5 virtual
dataset over the shards' JPEG bytes (the shard files must stay beside it); `--copy` copies the
bytes into a file that stands alone.
"""
import argparse
import hashlib
import os
import re
import time

import h5py
import numpy as np

from ..data.hdf5 import open_readonly

from .common import (SPLITS, ChannelStats, JpegWriter, PrepError, Progress, add_output_options,
                     atomic_h5, claim_output, print_summary, write_root_attrs)
from .pictures import pack_pictures

MERGE_BLOCK_BYTES = 64 << 20


def file_list_digest(source, items):
    """Fingerprint of the file list and labels: shards from different lists cannot merge."""
    h = hashlib.sha1()
    for split in SPLITS:
        for path, label in items[split]:
            h.update(os.fsencode(f"{split}\t{os.path.relpath(path, source)}\t{label}\n"))
    return h.hexdigest()


def shard_range(n, index, count):
    return n * index // count, n * (index + 1) // count


def shard_items(items, shard):
    """{split: [(path, label)]} cut to shard (i, n)'s slice of each split."""
    i, n = shard
    return {s: items[s][slice(*shard_range(len(items[s]), i, n))] for s in SPLITS}


def pack_items(args, classes, items, *, start, source, bad=None):
    """Pack items {split: [(path, label)]} into args.out (pictures.pack_pictures), or with
    args.shard (i, n) that shard's slice of them, with what merge needs."""
    mine = shard_items(items, args.shard) if args.shard else items
    todo = [(split, path, path, label) for split in SPLITS for path, label in mine[split]]

    def shard_attrs(f, stats, counts):
        totals = {split: len(items[split]) for split in SPLITS}
        skipped = {split: len(mine[split]) - counts[split] for split in SPLITS}
        write_shard_attrs(f, stats, args.shard, file_list_digest(args.source, items), totals,
                          skipped)
    pack_pictures(args, todo, len(todo), start=start, source=source, classes=classes, bad=bad,
                  finish=shard_attrs if args.shard else None)


def write_shard_attrs(f, stats, shard, digest, totals, skipped):
    """What merge needs of a shard: its place, the file list's fingerprint, each split's total
    and the pictures this shard skipped (--skip-bad), and the exact pixel sums."""
    stats.to_attrs(f.attrs)
    f.attrs["shard_index"], f.attrs["shard_count"] = shard
    f.attrs["file_list_sha1"] = digest
    for split in SPLITS:
        f.attrs[f"{split}_total"] = np.int64(totals[split])
        f.attrs[f"{split}_skipped"] = np.int64(skipped[split])


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
                expected = hi - lo - int(f.attrs.get(f"{split}_skipped", 0))
                if len(f[split]["labels"]) != expected:
                    raise PrepError(f"{path}: {len(f[split]['labels'])} {split} images, "
                                    f"expected {expected}")

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


def merge_main(prog, argv):
    """The `merge` command line of a packer that shards (prog: its name)."""
    p = argparse.ArgumentParser(
        prog=f"{prog} merge",
        description="Join shard files (any order) into one file. By default the joined file "
                    "holds only labels, offsets and a virtual view of the shards' image bytes "
                    "(seconds, no extra space; the shards must stay where they are); --copy "
                    "writes a file that stands alone.")
    add_output_options(p, "the joined HDF5 file to write")
    p.add_argument("--copy", action="store_true",
                   help="copy the image bytes instead of referring to the shard files")
    p.add_argument("shards", nargs="+", help="the shard files, all n of them")
    args = p.parse_args(argv)
    claim_output(args, args.shards)
    merge(args)
