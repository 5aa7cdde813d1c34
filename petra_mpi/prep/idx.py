"""Pack MNIST-format (IDX) files: Fashion-MNIST, MNIST, KMNIST, EMNIST.

  python -m petra_mpi.prep.idx --source DIR --out data/fashion_mnist.h5
         [--dataset fashion-mnist|mnist|kmnist|emnist] [--prefix emnist-balanced-] [--num-classes N]

DIR holds the four files of the release, gzipped or not (told apart by their first bytes):
  train-images-idx3-ubyte[.gz]  train-labels-idx1-ubyte[.gz]   -> the train split
  t10k-images-idx3-ubyte[.gz]   t10k-labels-idx1-ubyte[.gz]    -> the val split
EMNIST's names carry a prefix (emnist-balanced-, emnist-letters-, ...) and say `test` for `t10k`;
some copies write `train-images.idx3-ubyte`. Both are found; --prefix picks one set where a
folder holds several. An IDX file is a 4-byte magic number (two zero bytes, the element type
0x08 = unsigned byte, the number of dimensions), one big-endian uint32 per dimension, then the
elements in C order: images (N, rows, cols), labels (N,).

The images are grayscale; the schema stores RGB, so every pixel's byte is written to all three
channels (R = G = B = the file's byte, nothing rescaled). The data set (--dataset, by default
recognised from the file prefix or the folder's name) gives the class names and whether a
horizontal mirror keeps an image's class: yes for Fashion-MNIST's clothes, no for digits and
letters. That answer is stored as the root attribute `hflip`, which the training reader follows.
"""
import argparse
import gzip
import os
import re
import time
import zlib

import numpy as np

from .common import (ArrayWriter, ChannelStats, PrepError, Progress, add_output_options,
                     atomic_h5, check_labels, claim_output, print_summary, run_cli,
                     write_root_attrs)

# Per data set: class names (None: as many classes as the labels need) and whether a horizontal
# mirror keeps the class (a mirrored shoe is still a shoe; a mirrored 2 or b is not).
DATASETS = {
    "fashion-mnist": dict(classes=["T-shirt/top", "Trouser", "Pullover", "Dress", "Coat",
                                   "Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot"], hflip=True),
    "mnist": dict(classes=[str(d) for d in range(10)], hflip=False),
    "kmnist": dict(classes=["o", "ki", "su", "tsu", "na", "ha", "ma", "ya", "re", "wo"],
                   hflip=False),
    # EMNIST's splits have 10 to 62 classes; `letters` labels 1..26 (so 27 classes, 0 unused).
    "emnist": dict(classes=None, hflip=False),
}

# <prefix><train|t10k|test><- or .><images|labels><- or .>idx<1|3>-ubyte[.gz]
FILE_NAME = re.compile(r"^(?P<prefix>.*?)(?P<split>train|t10k|test)[-.](?P<kind>images|labels)"
                       r"[-.]idx(?P<ndim>[13])-ubyte(?P<gz>\.gz)?$")
SPLIT_OF = {"train": "train", "t10k": "val", "test": "val"}
NDIM = {"images": 3, "labels": 1}
ROWS_PER_WRITE = 10_000  # images converted to RGB and written at a time (~24 MB at 28x28)


def find_files(source, prefix=None):
    """{(split, kind): path} of the one IDX set in the folder `source`, and its prefix."""
    if not os.path.isdir(source):
        raise PrepError(f"{source}: not a folder (give the folder holding the IDX files)")
    sets = {}  # prefix -> {(split, kind): [paths]}
    for name in sorted(os.listdir(source)):
        m = FILE_NAME.match(name)
        if m and int(m["ndim"]) == NDIM[m["kind"]]:
            key = (SPLIT_OF[m["split"]], m["kind"])
            sets.setdefault(m["prefix"], {}).setdefault(key, []).append(name)
    if prefix is not None:
        sets = {p: s for p, s in sets.items() if p == prefix}
    if not sets:
        wanted = f"{prefix or ''}train-images-idx3-ubyte[.gz]"
        raise PrepError(f"{source}: no IDX files (looked for {wanted} and the three others)")
    if len(sets) > 1:
        names = ", ".join(repr(p) for p in sorted(sets))
        raise PrepError(f"{source} holds several IDX sets (prefixes {names}): "
                        "choose one with --prefix")
    prefix, found = next(iter(sets.items()))
    files = {}
    for split in ("train", "val"):
        for kind in ("images", "labels"):
            names = found.get((split, kind), [])
            upstream = "train" if split == "train" else "t10k"
            if not names:
                raise PrepError(f"{source}: missing {prefix}{upstream}-{kind}-idx{NDIM[kind]}"
                                f"-ubyte[.gz] (the {split} {kind})")
            # The same file twice (say gunzip -k left both): take the uncompressed one; two
            # spellings of the split (t10k and test) are a real ambiguity.
            plain = [n for n in names if not n.endswith(".gz")]
            if len(plain) > 1 or len(names) - len(plain) > 1:
                raise PrepError(f"{source}: several files for the {split} {kind}: "
                                f"{', '.join(names)}")
            files[split, kind] = os.path.join(source, (plain or names)[0])
    return files, prefix


def read_idx(path, ndim):
    """The uint8 array of an IDX file of `ndim` dimensions (gzipped or not), checked whole."""
    gzipped = False
    try:
        with open(path, "rb") as fh:
            gzipped = fh.read(2) == b"\x1f\x8b"
        with (gzip.open if gzipped else open)(path, "rb") as fh:
            data = fh.read()
    except (OSError, EOFError, zlib.error) as e:  # a truncated or corrupt .gz lands here
        raise PrepError(f"{path}: cannot read{' (gzip)' if gzipped else ''}: {e}") from None
    expected = 0x0800 | ndim
    if len(data) < 4:
        raise PrepError(f"{path}: {len(data)} bytes, too short for an IDX header")
    magic = int.from_bytes(data[:4], "big")
    if magic != expected:
        what = {0x0801: "a labels file", 0x0803: "an images file"}.get(
            magic, "not an IDX file of bytes")
        raise PrepError(f"{path}: magic number 0x{magic:08x} ({what}), expected 0x{expected:08x} "
                        f"(unsigned bytes, {ndim} dimension{'s' if ndim > 1 else ''})")
    header = 4 + 4 * ndim
    if len(data) < header:
        raise PrepError(f"{path}: truncated in its header ({len(data)} bytes)")
    dims = tuple(int.from_bytes(data[4 + 4 * i:8 + 4 * i], "big") for i in range(ndim))
    need, have = int(np.prod(dims)), len(data) - header
    if have != need:
        state = "truncated" if have < need else f"{have - need} bytes too long"
        raise PrepError(f"{path}: {state}: its header says {'x'.join(map(str, dims))} = {need} "
                        f"bytes of data, it holds {have}")
    return np.frombuffer(data, np.uint8, offset=header).reshape(dims)


def guess_dataset(source, prefix):
    """The data set named by the file prefix or the folder (or its parent: torchvision keeps
    FashionMNIST/raw/), else None. Fashion before MNIST: its names contain 'mnist'."""
    folder = os.path.abspath(source)
    words = [prefix, os.path.basename(folder), os.path.basename(os.path.dirname(folder))]
    for word in words:
        flat = re.sub(r"[^a-z]", "", word.lower())
        for name in ("fashionmnist", "kmnist", "emnist", "mnist"):
            if name in flat:
                return "fashion-mnist" if name == "fashionmnist" else name
    return None


def read_splits(files):
    """{split: (images uint8 (N, H, W), labels int64 (N,))}, every check made before writing."""
    bar = Progress(len(files), "reading IDX files")
    splits = {}
    for split in ("train", "val"):
        images = read_idx(files[split, "images"], 3)
        bar.advance()
        labels = read_idx(files[split, "labels"], 1).astype(np.int64)
        bar.advance()
        if len(images) != len(labels):
            raise PrepError(f"{files[split, 'images']} holds {len(images)} images but "
                            f"{files[split, 'labels']} holds {len(labels)} labels")
        if len(images) == 0:
            raise PrepError(f"{files[split, 'images']} holds no images")
        if images.shape[1] != images.shape[2]:
            raise PrepError(f"{files[split, 'images']}: images are {images.shape[1]}x"
                            f"{images.shape[2]}; the trainer needs square images")
        splits[split] = (images, labels)
    bar.close()
    if splits["train"][0].shape[1:] != splits["val"][0].shape[1:]:
        raise PrepError(f"train images are {'x'.join(map(str, splits['train'][0].shape[1:]))} "
                        f"but val images {'x'.join(map(str, splits['val'][0].shape[1:]))}")
    return splits


def gray_to_rgb(images):
    """uint8 (N, H, W) -> (N, H, W, 3) with R = G = B = the grayscale byte."""
    return np.repeat(images[..., None], 3, axis=3)


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m petra_mpi.prep.idx", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--source", required=True, help="the folder holding the four IDX files")
    add_output_options(p)
    p.add_argument("--dataset", choices=sorted(DATASETS),
                   help="which data set the files are (class names, mirror augmentation); "
                        "default: recognised from the file prefix or the folder's name")
    p.add_argument("--prefix", help="the file-name prefix of the set to pack, e.g. "
                                    "emnist-balanced- (needed where the folder holds several)")
    p.add_argument("--num-classes", type=int,
                   help="number of classes (default: the data set's, or the largest label + 1)")
    args = p.parse_args(argv)
    if args.num_classes is not None and args.num_classes < 2:
        p.error("--num-classes must be at least 2")

    start = time.monotonic()
    files, prefix = find_files(args.source, args.prefix)
    claim_output(args, files.values())
    dataset = args.dataset or guess_dataset(args.source, prefix)
    if dataset is None:
        raise PrepError(f"cannot tell which data set {args.source} holds from its names: "
                        f"name it with --dataset ({', '.join(sorted(DATASETS))})")
    spec = DATASETS[dataset]
    splits = read_splits(files)
    top = max(int(labels.max()) for _, labels in splits.values())
    num_classes = args.num_classes or (len(spec["classes"]) if spec["classes"] else top + 1)
    for split in splits:
        check_labels(splits[split][1], num_classes, files[split, "labels"])
    names = spec["classes"] if spec["classes"] and len(spec["classes"]) == num_classes else None
    source = prefix.strip("-.") if dataset == "emnist" and prefix else dataset
    print(f"data set: {dataset} (hflip {'on' if spec['hflip'] else 'off'}), files: "
          + ", ".join(os.path.basename(files[k]) for k in sorted(files)), flush=True)

    side = splits["train"][0].shape[1]
    stats = ChannelStats()
    with atomic_h5(args.out) as f:
        bar = Progress(sum(len(labels) for _, labels in splits.values()), "writing images")
        for split, (images, labels) in splits.items():
            writer = ArrayWriter(f, split, side, side)
            for lo in range(0, len(images), ROWS_PER_WRITE):
                rgb = gray_to_rgb(images[lo:lo + ROWS_PER_WRITE])
                writer.append(rgb, labels[lo:lo + ROWS_PER_WRITE])
                if split == "train":
                    stats.update(rgb)
                bar.advance(len(rgb))
            writer.close()
        bar.close()
        write_root_attrs(f, num_classes=num_classes, stats=stats, source=source, classes=names,
                         hflip=np.int64(spec["hflip"]))
    print_summary(args.out, start)


if __name__ == "__main__":
    run_cli(main)
