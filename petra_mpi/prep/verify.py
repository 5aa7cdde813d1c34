"""Check that an HDF5 file follows the petra_mpi dataset schema (version 1).

  python -m petra_mpi.prep.verify FILE.h5

Checks datasets, dtypes, shapes and attributes, that every dataset is stored in full and every
virtual dataset readable (data/checks.py), that labels lie in [0, num_classes), that the class
names of /classes (the folder and parquet packers write them) are distinct, that mean/std are
those of the training images (array files: all of them, exactly), and for the JPEG variant
that offsets are consistent and sample images decode at the stated size. A token file
(petra_mpi.prep.text, attr kind "tokens") is checked against the token schema instead: the
attributes, each split's ids (dtype, chunking, every id inside the vocabulary), a character
vocabulary and bytes_per_token recomputed from the validation ids. Prints a summary; exit status
0 if the file is valid, 1 with one line per violation if not, 2 if the file cannot be opened.
"""
import argparse
import collections
import io
import sys

import h5py
import numpy as np
from PIL import Image

from ..data.checks import (DataError, describe_dataset, flag, load_whole, positive_int, shown,
                           stored_problems, three_floats, virtual_problems)
from ..data.hdf5 import open_readonly
from ..data.stats import ChannelStats

from .common import SCHEMA_VERSION, SPLITS, PrepError, describe, run_cli
from .text import describe_tokens

# mean/std against their recomputation from every training image (array variant; check_stats)
ROUNDING = 1e-6  # what storing a figure in float32 (6e-8) or summing in floats can move it


def attr(a, key):
    """Attribute `key` of attrs `a` for a message."""
    return shown(a[key]) if key in a else "missing"


def check_version(a, bad):
    if positive_int(a.get("schema_version")) != SCHEMA_VERSION:
        bad.append(f"attr schema_version is {attr(a, 'schema_version')}, expected integer "
                   f"{SCHEMA_VERSION}")


def check_root(f, bad):
    a = f.attrs
    check_version(a, bad)
    n = positive_int(a.get("num_classes"))
    if n is None:
        bad.append(f"attr num_classes is {attr(a, 'num_classes')}, expected a positive integer")
    for key, lo, hi in (("mean", 0.0, 1.0), ("std", 1e-6, 0.5)):
        if key not in a:
            bad.append(f"attr {key} is missing, expected 3 finite floats")
            continue
        v = np.asarray(a[key])
        if v.shape != (3,) or not np.issubdtype(v.dtype, np.floating) or not np.all(np.isfinite(v)):
            bad.append(f"attr {key} is {v.tolist()!r} ({v.dtype}, shape {v.shape}), expected 3 "
                       f"finite floats")
        elif not np.all((v >= lo) & (v <= hi)):
            bad.append(f"attr {key} = {v.tolist()} is outside [{lo}, {hi}] (not on a 0-1 scale?)")
    if "hflip" in a and flag(a["hflip"]) is None:
        bad.append(f"attr hflip is {attr(a, 'hflip')}, expected 0 or 1")
    if not isinstance(a.get("source"), str):
        source = a.get("source")
        bad.append(f"attr source is {'missing' if source is None else repr(source)}, expected "
                   f"a string")
    if "classes" in f:
        c = f["classes"]
        if not isinstance(c, h5py.Dataset) or c.ndim != 1 or (n is not None and len(c) != n) \
                or h5py.check_string_dtype(c.dtype) is None:
            bad.append(f"/classes is {describe_dataset(c)}, expected {n} strings")
        else:  # predict answers with these names: each must say one class
            names = collections.Counter(v.decode("utf-8", "replace") if isinstance(v, bytes)
                                        else str(v) for v in c[:])
            twice = sorted(v for v, times in names.items() if times > 1)
            if twice or "" in names:
                bad.append(f"/classes names a class twice or not at all: "
                           f"{twice[0] if twice else repr('')}")


def check_split(f, split, num_classes, bad):
    """Check one split; return its kind ('images' or 'jpeg') or None if unusable."""
    g = f.get(split)
    if not isinstance(g, h5py.Group):
        bad.append(f"/{split} is {'missing' if g is None else 'not a group'}")
        return None
    labels = g.get("labels")
    if not isinstance(labels, h5py.Dataset) or labels.dtype != np.int64 or labels.ndim != 1:
        bad.append(f"/{split}/labels is {describe_dataset(labels)}, expected int64 (N,)")
        return None
    n = len(labels)
    if n == 0:
        bad.append(f"/{split}/labels is empty")
    try:
        lab = load_whole(labels)
    except DataError as e:
        bad.append(str(e))
        return None
    if num_classes is not None and n:
        out = np.flatnonzero((lab < 0) | (lab >= num_classes))
        if len(out):
            bad.append(f"/{split}/labels: {len(out)} values outside [0, {num_classes}), "
                       f"e.g. {lab[out[0]]} at index {out[0]}")
    has_images, has_jpeg = "images" in g, "jpeg" in g or "offsets" in g
    if has_images == has_jpeg:
        bad.append(f"/{split} must hold either images or jpeg+offsets")
        return None
    if has_images:
        d = g["images"]
        if not isinstance(d, h5py.Dataset) or d.dtype != np.uint8 or d.ndim != 4 \
                or d.shape[3] != 3 or d.shape[1] * d.shape[2] == 0:
            bad.append(f"/{split}/images is {describe_dataset(d)}, expected uint8 (N, H, W, 3) "
                       f"with H, W >= 1")
            return None
        if d.shape[0] != n:
            bad.append(f"/{split}/images has {d.shape[0]} images but {n} labels")
        if d.chunks is None or tuple(d.chunks[1:]) != d.shape[1:]:
            bad.append(f"/{split}/images chunks {d.chunks} are not along N only")
        return "images"
    jpeg, offsets = g.get("jpeg"), g.get("offsets")
    if jpeg is None or offsets is None:
        bad.append(f"/{split} has only one of jpeg and offsets")
        return None
    if not isinstance(jpeg, h5py.Dataset) or jpeg.dtype != np.uint8 or jpeg.ndim != 1:
        bad.append(f"/{split}/jpeg is {describe_dataset(jpeg)}, expected uint8 1-D")
        return None
    if not isinstance(offsets, h5py.Dataset) or offsets.dtype != np.int64 \
            or offsets.shape != (n + 1,):
        bad.append(f"/{split}/offsets is {describe_dataset(offsets)}, expected int64 ({n + 1},)")
        return None
    try:
        o = load_whole(offsets)
    except DataError as e:
        bad.append(str(e))
        return None
    if o[0] != 0 or o[-1] != jpeg.shape[0] or np.any(np.diff(o) <= 0):
        bad.append(f"/{split}/offsets must rise strictly from 0 to len(jpeg)={jpeg.shape[0]}")
        return None
    return "jpeg"


def decode(g, i):
    o = g["offsets"]
    data = g["jpeg"][o[i]:o[i + 1]].tobytes()
    with Image.open(io.BytesIO(data)) as im:
        return np.asarray(im.convert("RGB")), im.mode


def check_pixels(f, kinds, bad):
    """Sample decodes (JPEG variant) and the mean/std recomputation (array variant)."""
    rng = np.random.default_rng(0)
    if kinds["train"] == "images" and kinds["val"] == "images":
        if f["train/images"].shape[1:] != f["val/images"].shape[1:]:
            bad.append(f"train images {f['train/images'].shape[1:]} and val images "
                       f"{f['val/images'].shape[1:]} differ in size")
    if "jpeg" in kinds.values():
        size = positive_int(f.attrs.get("image_size"))
        if size is None:
            bad.append(f"attr image_size is {shown(f.attrs.get('image_size'))}, expected the "
                       f"positive shorter side")
        for split in SPLITS:
            if kinds[split] != "jpeg":
                continue
            g, n = f[split], len(f[split]["labels"])
            for i in sorted({0, n - 1} | set(rng.integers(0, n, 16).tolist())):
                try:
                    pixels, mode = decode(g, i)
                except Exception as e:
                    bad.append(f"/{split}/jpeg image {i} does not decode ({type(e).__name__}: {e})")
                    break
                if size is not None and min(pixels.shape[:2]) != int(size):
                    bad.append(f"/{split}/jpeg image {i} is {pixels.shape[1]}x{pixels.shape[0]}, "
                               f"shorter side is not image_size={int(size)}")
                    break
    if kinds["train"] == "images":
        check_stats(f, bad)


def check_stats(f, bad):
    """The stored mean/std against every training image of an array file.

    The packers take the figures from exact integer sums of every training pixel (ChannelStats),
    so the same sums give them again: they must agree to ROUNDING. Every image is read
    (measured: 63 MB/s on a 2-core machine busy with other work, so ImageNet 32x32's 3.9 GB in
    about a minute): a random sample would need a tolerance that holds for any file, and for
    the std none that holds is small enough to catch anything (a sample can miss the few bright
    pictures of a dark set, and then its spread says nothing of them).

    The JPEG variant's figures are not compared: they describe the pictures before JPEG encoding,
    which the file no longer holds, and encoding moves them by more than anything in the file
    bounds (quality 90, measured: colour noise loses a third of its std to the 4:2:0 chroma
    subsampling; red and blue stripes lose 0.41 of their 0.5, and the mean of green, clipped,
    rises by 0.05). A tolerance covering that would pass nearly any figure."""
    mean, std = three_floats(f.attrs.get("mean")), three_floats(f.attrs.get("std"))
    if mean is None or std is None:  # check_root said why
        return
    d = f["train/images"]
    if d.shape[0] == 0:
        bad.append("the training split is empty: no mean/std to check")
        return
    stats = ChannelStats()
    try:
        for lo in range(0, d.shape[0], 256):
            stats.update(d[lo:lo + 256])
    except Exception as e:  # h5py's errors on a damaged file
        bad.append(f"cannot read training images for mean/std ({type(e).__name__}: {e})")
        return
    for key, stored, got in zip(("mean", "std"), (mean, std), stats.mean_std()):
        if np.max(np.abs(np.subtract(stored, got))) > ROUNDING:
            bad.append(f"attr {key} = {np.round(stored, 4).tolist()} but the {d.shape[0]} "
                       f"training images give {np.round(got, 4).tolist()}")


def real_scalar(value):
    """The value as a finite float, or None if it is not one real number."""
    v = np.asarray(value) if value is not None else None
    if v is None or v.ndim != 0 or not (np.issubdtype(v.dtype, np.floating)
                                        or np.issubdtype(v.dtype, np.integer)):
        return None
    return float(v) if np.isfinite(v) else None


def check_token_root(f, bad):
    """The token file's attributes; returns (vocabulary size, the characters of a char vocabulary)
    where they can be read, else None for either."""
    a = f.attrs
    check_version(a, bad)
    if a.get("kind") != "tokens":
        bad.append(f"attr kind is {a.get('kind')!r}, expected 'tokens' (the reader takes a file "
                   f"with /train/tokens for a token file only then)")
    if not isinstance(a.get("source"), str):
        bad.append(f"attr source is {a.get('source')!r}, expected a string")
    n = positive_int(a.get("num_classes"))
    if n is None or n < 2:
        bad.append(f"attr num_classes is {attr(a, 'num_classes')}, expected the vocabulary size, "
                   f"an integer >= 2")
        n = None
    vocab, chars = a.get("vocab"), None
    if vocab == "bytes":
        if n is not None and n != 256:
            bad.append(f"attr num_classes is {n}, but a bytes vocabulary has 256 tokens")
    elif vocab == "char":
        if "vocab" not in f or h5py.check_string_dtype(f["vocab"].dtype) is None \
                or f["vocab"].shape != ():
            bad.append("/vocab is missing or not one string: a char vocabulary stores its "
                       "characters there")
        else:
            chars = f["vocab"][()].decode("utf-8")
            if n is not None and len(chars) != n:
                bad.append(f"/vocab has {len(chars)} characters but attr num_classes is {n}")
            elif list(chars) != sorted(set(chars)):
                bad.append("/vocab is not its distinct characters in sorted order")
    else:
        bad.append(f"attr vocab is {vocab!r}, expected 'bytes' or 'char'")
    per_token = real_scalar(a.get("bytes_per_token"))
    if per_token is None or not 1.0 <= per_token <= 4.0:
        bad.append(f"attr bytes_per_token is {a.get('bytes_per_token')!r}, expected a float in "
                   f"[1, 4] (UTF-8 bytes per token)")
    return n, chars


def check_token_split(f, split, num_classes, bad):
    """One split's ids; returns them if they can be read, else None."""
    d = f.get(f"{split}/tokens")
    if d is None:
        bad.append(f"/{split}/tokens is missing")
        return None
    want = np.uint8 if num_classes is None or num_classes <= 256 else np.int32
    if d.ndim != 1 or d.dtype not in (np.uint8, np.int32) \
            or (num_classes is not None and d.dtype != want):
        bad.append(f"/{split}/tokens is {d.dtype}{d.shape}, expected {np.dtype(want)} (N,)")
        return None
    if len(d) < 2:
        bad.append(f"/{split}/tokens holds {len(d)} ids: a split needs at least 2 (one window "
                   f"and its next token)")
    if d.chunks is None:
        bad.append(f"/{split}/tokens is not chunked")
    ids = d[()]
    if num_classes is not None and len(ids):
        out = np.flatnonzero((ids < 0) | (ids >= num_classes))
        if len(out):
            bad.append(f"/{split}/tokens: {len(out)} ids outside [0, {num_classes}), e.g. "
                       f"{ids[out[0]]} at index {out[0]}")
            return None
    return ids


def check_tokens(f, bad):
    num_classes, chars = check_token_root(f, bad)
    ids = {split: check_token_split(f, split, num_classes, bad) for split in SPLITS}
    stored = real_scalar(f.attrs.get("bytes_per_token"))
    if ids["val"] is None or not len(ids["val"]) or stored is None or \
            (f.attrs.get("vocab") == "char" and chars is None):
        return
    if chars is None:  # bytes: one byte a token
        expected = 1.0
    else:
        sizes = np.array([len(c.encode("utf-8")) for c in chars])
        expected = float(sizes[ids["val"]].mean())
    if abs(stored - expected) > 1e-9:
        bad.append(f"attr bytes_per_token = {stored} but the validation ids give "
                   f"{expected:.6f} UTF-8 bytes per token")


def verify(path):
    """Return (summary lines, violations)."""
    try:
        f = open_readonly(path)
    except OSError as e:
        raise PrepError(f"cannot open {path} as HDF5: {e}") from None
    with f:
        # data the checks below would read: as zeros, without end, or 73 TiB of it
        bad = virtual_problems(f, path) + stored_problems(
            f, [f"{split}/{name}" for split in SPLITS
                for name in ("labels", "images", "offsets", "tokens")] + ["classes"])
        if bad:
            return summary_of(f), bad
        if f.attrs.get("kind") == "tokens" or "train/tokens" in f:
            check_tokens(f, bad)
            return summary_of(f, describe_tokens), bad
        check_root(f, bad)
        num_classes = positive_int(f.attrs.get("num_classes"))
        kinds = {split: check_split(f, split, num_classes, bad) for split in SPLITS}
        check_pixels(f, kinds, bad)
        summary = summary_of(f)
        if "jpeg" in kinds.values():
            summary.append("  (mean/std describe the pictures before JPEG encoding: not "
                           "recomputed from the file)")
    return summary, bad


def summary_of(f, describe=describe):
    """The summary lines of a file (describe or describe_tokens), or why there is none."""
    try:
        return describe(f)
    except Exception as e:  # a broken file can break the summary too; the checks say why
        return [f"  (no summary: {type(e).__name__}: {e})"]


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m petra_mpi.prep.verify", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("file", help="the HDF5 file to check")
    args = p.parse_args(argv)
    summary, bad = verify(args.file)
    print(args.file)
    print("\n".join(summary))
    if bad:
        print(f"{args.file}: INVALID, {len(bad)} problem(s):", file=sys.stderr)
        for line in bad:
            print(f"  - {line}", file=sys.stderr)
        return 1
    print("OK: the file follows schema version 1")
    return 0


if __name__ == "__main__":
    run_cli(main)
