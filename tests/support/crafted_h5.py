"""HDF5 files from elsewhere, each wrong in one way, for the tests of the readers (the trainer's
loader, `evaluate --data`, `petra_mpi.prep.verify`): what each reader must refuse in one line
naming the file, without a traceback, a crash or a hang.

CASES maps a name to (write(path), words): `write` makes the file, and every reader's line about
it holds each of `words`. Splits are broken alike, so that a reader of either split meets it."""
import io

import h5py
import numpy as np
from PIL import Image

from petra_mpi.data.stats import ChannelStats

N, SIDE, CLASSES = 16, 8, 10


def array_file(f, rng=None):
    """A valid array file of N noise pictures of SIDE x SIDE per split, CLASSES classes."""
    rng = rng or np.random.default_rng(0)
    f.attrs.update(schema_version=1, num_classes=CLASSES, source="test")
    for split in ("train", "val"):
        images = rng.integers(0, 256, (N, SIDE, SIDE, 3), dtype=np.uint8)
        if split == "train":
            f.attrs["mean"], f.attrs["std"] = ChannelStats().update(images).mean_std()
        f.create_dataset(f"{split}/images", data=images, chunks=(4, SIDE, SIDE, 3))
        f[f"{split}/labels"] = np.arange(N, dtype=np.int64) % CLASSES


def jpeg_file(f, rng=None, side=SIDE):
    """A valid file of the JPEG variant: N noise pictures of side x side per split."""
    rng = rng or np.random.default_rng(0)
    f.attrs.update(schema_version=1, num_classes=CLASSES, source="test", image_size=side,
                   mean=[0.5] * 3, std=[0.25] * 3)
    for split in ("train", "val"):
        blobs = []
        for _ in range(N):
            out = io.BytesIO()
            Image.fromarray(rng.integers(0, 256, (side, side, 3), dtype=np.uint8)).save(out, "JPEG")
            blobs.append(out.getvalue())
        f[f"{split}/jpeg"] = np.frombuffer(b"".join(blobs), np.uint8)
        f[f"{split}/offsets"] = np.cumsum([0] + [len(b) for b in blobs]).astype(np.int64)
        f[f"{split}/labels"] = np.arange(N, dtype=np.int64) % CLASSES


def replace(f, name, **dataset):
    """Dataset `name` of `f` replaced by create_dataset(name, **dataset)."""
    del f[name]
    f.create_dataset(name, **dataset)


def each_split(change, base=array_file):
    """A writer: a valid file (base), then change(f, split) for both splits."""
    def write(f):
        base(f)
        for split in ("train", "val"):
            change(f, split)
    return write


def sparse(f):
    """Datasets that declare 10**13 pictures and labels, none written: a few KiB on disk."""
    f.attrs.update(schema_version=1, num_classes=CLASSES, mean=[0.5] * 3, std=[0.25] * 3,
                   source="test")
    for split in ("train", "val"):
        f.create_dataset(f"{split}/images", shape=(10 ** 13, SIDE, SIDE, 3), dtype=np.uint8,
                         chunks=(256, SIDE, SIDE, 3))
        f.create_dataset(f"{split}/labels", shape=(10 ** 13,), dtype=np.int64, chunks=(4096,))


def attr(key, value, base=array_file):
    def write(f):
        base(f)
        f.attrs[key] = value
    return write


def offsets_past_the_end(f, split):
    offsets = f[f"{split}/offsets"][:]
    offsets[3] = 10 ** 12
    f[f"{split}/offsets"][:] = offsets


def virtual_jpeg(source):
    """/<split>/jpeg a virtual dataset mapping /<split>/jpeg of the file named `source`: the
    file's own name makes a loop (what `merge --out p0.h5 p0.h5 p1.h5` would write)."""
    def change(f, split):
        size = f[f"{split}/jpeg"].shape[0]
        del f[f"{split}/jpeg"]
        layout = h5py.VirtualLayout(shape=(size,), dtype=np.uint8)
        layout[:] = h5py.VirtualSource(source, f"{split}/jpeg", shape=(size,))
        f.create_virtual_dataset(f"{split}/jpeg", layout)
    return each_split(change, base=jpeg_file)


def labels_of_floats(f, split):
    replace(f, f"{split}/labels", data=np.arange(N, dtype=np.float64))


def labels_of_two_columns(f, split):
    replace(f, f"{split}/labels", data=np.zeros((N, 1), np.int64))


def labels_missing(f, split):
    del f[f"{split}/labels"]


def label_out_of_range(f, split):
    f[f"{split}/labels"][3] = CLASSES


def images_of_floats(f, split):
    replace(f, f"{split}/images", data=np.zeros((N, SIDE, SIDE, 3), np.float32))


def images_of_4_channels(f, split):
    replace(f, f"{split}/images", data=np.zeros((N, SIDE, SIDE, 4), np.uint8))


def images_of_0_pixels(f, split):
    replace(f, f"{split}/images", shape=(N, 0, 0, 3), dtype=np.uint8)


def no_val_split(f):
    array_file(f)
    del f["val"]


def write_h5(path, writer):
    with h5py.File(path, "w") as f:
        writer(f)


def not_hdf5(path):
    path.write_text("a text file with an .h5 name\n")


def truncated(path):
    write_h5(path, array_file)
    data = path.read_bytes()
    path.write_bytes(data[:len(data) // 2])


NAME = "crafted.h5"  # the name make() gives every file: the loop below maps the file by it
CASES = {
    "sparse 10**13 labels": (sparse, ["labels", "declares (10000000000000,)", "stores 0 of"]),
    "num_classes 'three'": (attr("num_classes", "three"), ["num_classes", "'three'"]),
    "labels of floats": (each_split(labels_of_floats), ["labels", "float64"]),
    "labels of two columns": (each_split(labels_of_two_columns), ["labels", f"({N}, 1)"]),
    "labels missing": (each_split(labels_missing), ["labels", "missing"]),
    "labels out of range": (each_split(label_out_of_range), ["labels", f"outside [0, {CLASSES})"]),
    "images of floats": (each_split(images_of_floats), ["images", "float32"]),
    "images of 4 channels": (each_split(images_of_4_channels),
                             ["images", f"({N}, {SIDE}, {SIDE}, 4)"]),
    "images of 0 pixels": (each_split(images_of_0_pixels), ["images", f"({N}, 0, 0, 3)"]),
    "mean a word": (attr("mean", "dark"), ["attr mean", "'dark'"]),
    "no val split": (no_val_split, ["/val is missing"]),
    "image_size 0": (attr("image_size", 0, base=jpeg_file), ["attr image_size is 0"]),
    "offsets past the bytes": (each_split(offsets_past_the_end, base=jpeg_file),
                               ["offsets", "rise strictly"]),
    "virtual dataset of itself": (virtual_jpeg(NAME), ["lead back to"]),
    "virtual dataset of a missing file": (virtual_jpeg("nowhere.h5"), ["missing", "nowhere.h5"]),
    "not HDF5": (not_hdf5, ["file signature not found"]),
    "truncated": (truncated, ["truncated file"]),
}
WHOLE_FILES = {"not HDF5", "truncated"}  # writers of a path; the others write into an h5py file


def make(case, folder):
    """The file of CASES[case] in `folder`, named NAME; its path."""
    path = folder / NAME
    write, _ = CASES[case]
    if case in WHOLE_FILES:
        write(path)
    else:
        write_h5(path, write)
    return path
