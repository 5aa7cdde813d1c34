"""Check that an HDF5 file follows the petra_mpi dataset schema (version 1).

  python -m petra_mpi.prep.verify FILE.h5 [--sample 1000]

Checks datasets, dtypes, shapes and attributes, that labels lie in [0, num_classes), that the
class names of /classes (the folder and parquet packers write them) are distinct, that
mean/std agree with a recomputation on a random sample of training images, and for the JPEG
variant that offsets are consistent and sample images decode at the stated size. A token file
(petra_mpi.prep.text, attr kind "tokens") is checked against the token schema instead: the
attributes, each split's ids (dtype, chunking, every id inside the vocabulary), a character
vocabulary and bytes_per_token recomputed from the validation ids. Prints a summary; exit status
0 if the file is valid, 1 with one line per violation if not, 2 if the file cannot be opened.
"""
import argparse
import io
import sys

import h5py
import numpy as np
from PIL import Image

from ..data.hdf5 import open_readonly
from ..data.source import missing_virtual_sources

from .common import (SCHEMA_VERSION, SPLITS, ChannelStats, PrepError, describe,
                              run_cli)
from .text import describe_tokens

FULL_TOL = 0.005    # mean/std vs a recomputation over every training image (JPEG rounding)
SAMPLE_TOL = 0.05   # vs a random sample: several standard errors for ~1000 natural images


def check_root(f, bad):
    a = f.attrs
    version = a.get("schema_version")
    if version is None or not np.issubdtype(np.asarray(version).dtype, np.integer) \
            or int(version) != SCHEMA_VERSION:
        bad.append(f"attr schema_version is {'missing' if version is None else repr(version)}, "
                   f"expected integer {SCHEMA_VERSION}")
    n = a.get("num_classes")
    if n is None or not np.issubdtype(np.asarray(n).dtype, np.integer) or int(n) < 1:
        bad.append(f"attr num_classes is {'missing' if n is None else repr(n)}, expected a "
                   f"positive integer")
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
    if not isinstance(a.get("source"), str):
        source = a.get("source")
        bad.append(f"attr source is {'missing' if source is None else repr(source)}, expected "
                   f"a string")
    if "classes" in f:
        c = f["classes"]
        if c.ndim != 1 or (n is not None and len(c) != int(n)) or h5py.check_string_dtype(c.dtype) is None:
            bad.append(f"/classes is {c.dtype}{c.shape}, expected {n} strings")
        else:  # predict answers with these names: each must say one class
            names = [v.decode("utf-8", "replace") if isinstance(v, bytes) else str(v)
                     for v in c[:]]
            twice = sorted({v for v in names if names.count(v) > 1})
            if twice or "" in names:
                bad.append(f"/classes names a class twice or not at all: "
                           f"{twice[0] if twice else repr('')}")


def check_split(f, split, num_classes, bad):
    """Check one split; return its kind ('images' or 'jpeg') or None if unusable."""
    if split not in f:
        bad.append(f"/{split} is missing")
        return None
    g = f[split]
    labels = g.get("labels")
    if labels is None or labels.dtype != np.int64 or labels.ndim != 1:
        bad.append(f"/{split}/labels is {labels.dtype}{labels.shape}, expected int64 (N,)"
                   if labels is not None else f"/{split}/labels is missing")
        return None
    n = len(labels)
    if n == 0:
        bad.append(f"/{split}/labels is empty")
    lab = labels[:]
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
        if d.dtype != np.uint8 or d.ndim != 4 or d.shape[3] != 3:
            bad.append(f"/{split}/images is {d.dtype}{d.shape}, expected uint8 (N, H, W, 3)")
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
    if jpeg.dtype != np.uint8 or jpeg.ndim != 1:
        bad.append(f"/{split}/jpeg is {jpeg.dtype}{jpeg.shape}, expected uint8 1-D")
    if offsets.dtype != np.int64 or offsets.shape != (n + 1,):
        bad.append(f"/{split}/offsets is {offsets.dtype}{offsets.shape}, expected int64 ({n + 1},)")
        return None
    o = offsets[:]
    if o[0] != 0 or o[-1] != jpeg.shape[0] or np.any(np.diff(o) <= 0):
        bad.append(f"/{split}/offsets must rise strictly from 0 to len(jpeg)={jpeg.shape[0]}")
        return None
    return "jpeg"


def decode(g, i):
    o = g["offsets"]
    data = g["jpeg"][o[i]:o[i + 1]].tobytes()
    with Image.open(io.BytesIO(data)) as im:
        return np.asarray(im.convert("RGB")), im.mode


def check_pixels(f, kinds, sample, bad):
    """Sample decodes (JPEG variant) and the mean/std recomputation."""
    rng = np.random.default_rng(0)
    if kinds["train"] == "images" and kinds["val"] == "images":
        if f["train/images"].shape[1:] != f["val/images"].shape[1:]:
            bad.append(f"train images {f['train/images'].shape[1:]} and val images "
                       f"{f['val/images'].shape[1:]} differ in size")
    if "jpeg" in kinds.values():
        size = f.attrs.get("image_size")
        if size is None or int(size) < 1:
            bad.append(f"attr image_size is {size!r}, expected the positive shorter side")
            size = None
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
    # mean/std: recompute on a sample of training images.
    mean, std = np.asarray(f.attrs.get("mean", [])), np.asarray(f.attrs.get("std", []))
    if kinds["train"] is None or mean.shape != (3,) or std.shape != (3,):
        return
    n = len(f["train/labels"])
    if n == 0:
        bad.append("the training split is empty: no mean/std to check")
        return
    idx = np.arange(n) if n <= sample else np.sort(rng.choice(n, sample, replace=False))
    stats = ChannelStats()
    try:
        if kinds["train"] == "images":
            d = f["train/images"]
            for lo in range(0, len(idx), 256):
                part = idx[lo:lo + 256]
                # A contiguous run is one slice; otherwise a sorted fancy read.
                stats.update(d[part[0]:part[-1] + 1] if part[-1] - part[0] + 1 == len(part) else d[part])
        else:
            for i in idx:
                stats.update(decode(f["train"], i)[0])
    except Exception as e:
        bad.append(f"cannot read training images for mean/std ({type(e).__name__}: {e})")
        return
    m, s = stats.mean_std()
    tol = FULL_TOL if len(idx) == n else SAMPLE_TOL
    for key, stored, got in (("mean", mean, m), ("std", std, s)):
        if np.max(np.abs(stored - np.asarray(got))) > tol:
            bad.append(f"attr {key} = {np.round(stored, 4).tolist()} but {len(idx)} training "
                       f"images give {np.round(got, 4).tolist()} (tolerance {tol})")


def is_integer(value) -> bool:
    return value is not None and np.asarray(value).ndim == 0 and \
        np.issubdtype(np.asarray(value).dtype, np.integer)


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
    version = a.get("schema_version")
    if not is_integer(version) or int(version) != SCHEMA_VERSION:
        bad.append(f"attr schema_version is {'missing' if version is None else repr(version)}, "
                   f"expected integer {SCHEMA_VERSION}")
    if a.get("kind") != "tokens":
        bad.append(f"attr kind is {a.get('kind')!r}, expected 'tokens' (the reader takes a file "
                   f"with /train/tokens for a token file only then)")
    if not isinstance(a.get("source"), str):
        bad.append(f"attr source is {a.get('source')!r}, expected a string")
    n = a.get("num_classes")
    if is_integer(n) and int(n) >= 2:
        n = int(n)
    else:
        bad.append(f"attr num_classes is {n!r}, expected the vocabulary size, an integer >= 2")
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


def verify(path, sample=1000):
    """Return (summary lines, violations)."""
    try:
        f = open_readonly(path)
    except OSError as e:
        raise PrepError(f"cannot open {path} as HDF5: {e}") from None
    bad = [f"joins a shard file that is missing: {name}" for name in missing_virtual_sources(f, path)]
    with f:
        if bad:  # its bytes would read as zeros
            return describe(f), bad
        if f.attrs.get("kind") == "tokens" or "train/tokens" in f:
            check_tokens(f, bad)
            try:
                return describe_tokens(f), bad
            except Exception as e:  # as below: the checks say why
                return [f"  (no summary: {type(e).__name__}: {e})"], bad
        check_root(f, bad)
        n = f.attrs.get("num_classes")
        num_classes = int(n) if n is not None and np.asarray(n).ndim == 0 else None
        kinds = {split: check_split(f, split, num_classes, bad) for split in SPLITS}
        check_pixels(f, kinds, sample, bad)
        try:
            summary = describe(f)
        except Exception as e:  # a broken file can break the summary too; the checks say why
            summary = [f"  (no summary: {type(e).__name__}: {e})"]
    return summary, bad


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m petra_mpi.prep.verify", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("file", help="the HDF5 file to check")
    p.add_argument("--sample", type=int, default=1000,
                   help="training images used to recompute mean/std (default 1000)")
    args = p.parse_args(argv)
    summary, bad = verify(args.file, args.sample)
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
