"""Dataset sources: one split of a dataset, read by index ranges or index lists.

`open_split(path, split)` returns either an `ArraySource` (images held in memory: the built-in
synthetic set) or an `H5Source` (a split of an HDF5 file in the schema of docs/design.md §2). Both
have the same surface: `kind` ("array" | "jpeg"), `num_classes`, `mean`, `std`, `image_size`,
`hflip` (whether the training augmentation may mirror an image: the file's optional root
attribute, true when absent; false for digits and letters), `len()`, `read(start, stop)` and
`take(indices)` -> (images, labels) as numpy, where images are uint8 NHWC for "array" and a list
of encoded JPEG `bytes` for "jpeg".

How an HDF5 split is read (measured on 50k 32x32 images, uncompressed 256-image chunks, file in
the page cache; images/s for random batches of 64):
  h5py fancy indexing ds[sorted_idx]             ~4,000  (one hyperslab per index, slow path)
  ds[i] per index, default 1 MiB chunk cache    ~20,000  (every miss copies a whole chunk in)
  ds[a:b] per run of consecutive indices,
    chunk cache off (rdcc_nbytes=0)             ~120,000 (HDF5 reads just the bytes asked for)
  a slice per image of an np.memmap of the file
    at offsets from the chunks' file positions  ~300,000 (no HDF5 call per read)
So an uncompressed split whose chunks hold whole images (what the packers write) is read straight
from a memory map of the file: HDF5 is asked once where each chunk lies (chunk_iter), and as a
raw chunk stores its rows in order, image i sits at chunk_start + (i % rows) * image_bytes. (The
file must not be rewritten while it is read, as with any reader.) Any other uncompressed
layout is read one h5py slice per run of consecutive indices with the chunk cache off. A
compressed split would decompress a whole chunk per image (~300 images/s), so such a split, and
any split small enough (<= IN_MEMORY_BYTES), is loaded whole into memory on first read.
"""
import os
import threading

import h5py
import numpy as np

from .checks import (DataError, describe_dataset, flag, load_whole, positive_int, shown,
                     stored_problems, three_floats, virtual_problems)
from .hdf5 import open_readonly
from .schema import SCHEMA_VERSION, SPLITS
from .stats import ChannelStats
from .synthetic import NUM_CLASSES as SYNTHETIC_CLASSES
from .synthetic import make_synthetic
from .text import TokenSource, is_token_file

IN_MEMORY_BYTES = 512 << 20  # splits up to this size are loaded whole (CIFAR, ImageNet32 val)


def open_split(path, split, *, synthetic_sizes=(50_000, 10_000), seed=0, in_memory=None):
    """Open one split ("train" | "val") of `path`: an HDF5 file, or "synthetic".

    "synthetic": train = make_synthetic(n_train, seed), val = make_synthetic(n_val, seed + 1);
    both splits are normalised with the statistics of the train images, as for a real file.
    in_memory: load an HDF5 split whole on first read (None: when compressed or small)."""
    if split not in SPLITS:
        raise ValueError(f"{path}: split must be one of {SPLITS}, got {split!r}")
    if str(path) == "synthetic":
        n_train, n_val = (int(n) for n in synthetic_sizes)
        mean, std = _synthetic_stats(n_train, seed)
        images, labels = make_synthetic(n_train if split == "train" else n_val,
                                        seed if split == "train" else seed + 1)
        return ArraySource(images, labels, num_classes=SYNTHETIC_CLASSES, mean=mean, std=std,
                           name=f"synthetic/{split}")
    if is_token_file(path):  # token files of the language models
        return TokenSource(path, split)
    return H5Source(path, split, in_memory=in_memory)


_stats_cache = {}


def _synthetic_stats(n_train, seed):
    # Opening "val" needs the train statistics; cache them so val does not rebuild the train set
    # when train was opened first in the same process.
    key = (n_train, seed)
    if key not in _stats_cache:
        _stats_cache[key] = channel_stats(make_synthetic(n_train, seed)[0])
    return _stats_cache[key]


def channel_stats(images):
    """Per-channel mean and std of uint8 NHWC images on a 0-1 scale, as two 3-tuples."""
    mean, std = ChannelStats().update(images).mean_std()
    return tuple(mean), tuple(std)


def _runs(idx):
    """Split sorted indices into runs of consecutive values: (starts, ends) into idx."""
    breaks = np.flatnonzero(np.diff(idx) != 1) + 1
    return np.concatenate(([0], breaks)), np.concatenate((breaks, [len(idx)]))


def _chunk_file_offsets(ds):
    """File byte offset of each chunk of an (N, H, W, 3) uint8 dataset whose chunks hold whole
    images and are stored raw, or None when HDF5 must do the reading (filters, a chunk not yet
    allocated, partial-image chunks, an HDF5 too old to say where chunks lie)."""
    try:
        if ds.id.get_create_plist().get_nfilters() > 0:
            return None
        if ds.chunks is None:  # contiguous layout: one "chunk" of all rows
            offset = ds.id.get_offset()
            return None if offset is None else np.array([offset], np.int64)
        if tuple(ds.chunks[1:]) != tuple(ds.shape[1:]):
            return None
        rows = ds.chunks[0]
        starts = np.full(-(-ds.shape[0] // rows), -1, np.int64)

        def visit(info):
            starts[info.chunk_offset[0] // rows] = info.byte_offset
        if hasattr(ds.id, "chunk_iter"):
            ds.id.chunk_iter(visit)
        else:
            for i in range(ds.id.get_num_chunks()):
                visit(ds.id.get_chunk_info(i))
        return None if (starts < 0).any() else starts
    except (AttributeError, RuntimeError, OSError, ValueError):
        return None


class ArraySource:
    """A split held in memory as numpy arrays (the synthetic set)."""

    kind = "array"
    hflip = True

    def __init__(self, images, labels, *, num_classes, mean, std, name="arrays"):
        if images.dtype != np.uint8 or images.ndim != 4 or images.shape[3] != 3:
            raise ValueError(f"{name}: images must be uint8 (N, H, W, 3), got "
                             f"{images.dtype}{images.shape}")
        if len(labels) != len(images):
            raise ValueError(f"{name}: {len(images)} images but {len(labels)} labels")
        self.images, self.labels = images, np.asarray(labels, dtype=np.int64)
        self.num_classes = int(num_classes)
        self.mean, self.std = tuple(map(float, mean)), tuple(map(float, std))
        self.image_size = int(images.shape[1])
        self.name = name

    def __len__(self):
        return len(self.labels)

    def read(self, start, stop):
        return self.images[start:stop], self.labels[start:stop]

    def take(self, indices):
        indices = np.asarray(indices, dtype=np.int64)
        return self.images[indices], self.labels[indices]

    def take_labels(self, indices):
        return self.labels[np.asarray(indices, dtype=np.int64)]

    def __repr__(self):
        return f"ArraySource({self.name}, n={len(self)}, size={self.image_size})"


class H5Source:
    """One split of an HDF5 file in the schema of docs/design.md §2 ("array" or "jpeg" kind).

    The file is opened at construction only to validate it and read metadata, then closed: the
    handle used for reading is opened lazily by the first read, and again after a fork (h5py
    handles must not cross a fork). Labels (and JPEG offsets) are loaded whole on first read."""

    def __init__(self, path, split, *, in_memory=None):
        self.path, self.split = str(path), split
        if not os.path.isfile(self.path):
            raise FileNotFoundError(f"{self.path}: no such file; pack a dataset into it with "
                                    f"python -m petra_mpi.prep.cifar, .idx, .imagenet32, .imagenet, "
                                    f".folder (your own pictures), .parquet or .synthetic "
                                    f"(docs/data.md)")
        try:
            f = open_readonly(self.path)
        except OSError as e:
            raise DataError(f"{self.path}: not a readable HDF5 file ({e})") from None
        with f:
            self._validate_and_load_meta(f, in_memory)
        self._h5 = None      # (pid, h5py.File, dataset): the reading handle, opened lazily
        self._lock = threading.Lock()
        self._labels = self._offsets = self._images = None  # loaded on first read
        self._raw = None  # (memmap of the file, chunk start offsets, rows per chunk)

    def _refuse(self, what):
        raise DataError(f"{self.path}: {what}")

    def _validate_and_load_meta(self, f, in_memory):
        """Check the file as far as this split needs (docs/data.md, "Files from elsewhere") and
        read its metadata; DataError names the first problem."""
        self._read_root_attrs(f)
        g = f.get(self.split)
        if g is None:
            self._refuse(f"/{self.split} is missing (the file has: "
                         f"{', '.join(sorted(f)) or 'nothing'})")
        if not isinstance(g, h5py.Group):
            self._refuse(f"/{self.split} is not a group")
        problems = virtual_problems(f, self.path) + stored_problems(
            f, [f"{self.split}/{name}" for name in ("labels", "images", "offsets")])
        if problems:
            self._refuse(problems[0])
        self._n = self._check_labels(g.get("labels"))
        if "images" in g:
            self._check_images(g["images"], in_memory)
        elif "jpeg" in g and "offsets" in g:
            self._check_jpeg(f, g["jpeg"], g["offsets"], in_memory)
        else:
            self._refuse(f"/{self.split} holds neither 'images' nor 'jpeg' + 'offsets'")

    def _read_root_attrs(self, f):
        a = f.attrs
        if positive_int(a.get("schema_version")) != SCHEMA_VERSION:
            self._refuse(f"schema_version is {shown(a.get('schema_version'))}, this reader needs "
                         f"{SCHEMA_VERSION}")
        missing = [key for key in ("num_classes", "mean", "std") if key not in a]
        if missing:
            self._refuse(f"missing root attribute(s) {', '.join(missing)}")
        self.num_classes = positive_int(a["num_classes"])
        if self.num_classes is None:
            self._refuse(f"attr num_classes is {shown(a['num_classes'])}, expected a positive "
                         f"integer")
        self.mean, self.std = three_floats(a["mean"]), three_floats(a["std"])
        for key, value in (("mean", self.mean), ("std", self.std)):
            if value is None or (key == "std" and min(value) <= 0):  # normalising divides by std
                self._refuse(f"attr {key} is {shown(a[key])}, expected 3 finite floats"
                             + (" above 0" if key == "std" else ""))
        self.hflip = flag(a.get("hflip", True))
        if self.hflip is None:
            self._refuse(f"attr hflip is {shown(a['hflip'])}, expected 0 or 1")

    def _check_labels(self, d):
        """The split's label count, after checking every label lies in [0, num_classes): one
        line at start-up, not an error of the loss mid-epoch."""
        s = self.split
        if not isinstance(d, h5py.Dataset) or d.ndim != 1 or not np.issubdtype(d.dtype, np.integer):
            self._refuse(f"/{s}/labels is {describe_dataset(d)}, expected integers (N,)")
        labels = load_whole(d, self.path)
        if len(labels) and (labels.min() < 0 or labels.max() >= self.num_classes):
            wrong = labels[(labels < 0) | (labels >= self.num_classes)]
            self._refuse(f"/{s}/labels holds {len(wrong)} label(s) outside [0, "
                         f"{self.num_classes}) (num_classes), e.g. {int(wrong[0])}; python -m "
                         f"petra_mpi.prep.verify {self.path} checks the whole file")
        return len(labels)

    def _check_images(self, d, in_memory):
        s = self.split
        if not isinstance(d, h5py.Dataset) or d.dtype != np.uint8 or d.ndim != 4 \
                or d.shape[3] != 3 or d.shape[1] * d.shape[2] == 0:
            self._refuse(f"/{s}/images is {describe_dataset(d)}, expected uint8 (N, H, W, 3) "
                         f"with H, W >= 1")
        if d.shape[0] != self._n:
            self._refuse(f"/{s}/images has {d.shape[0]} rows but labels has {self._n}")
        self.kind, self.image_size = "array", int(d.shape[1])
        compressed = d.id.get_create_plist().get_nfilters() > 0  # gzip, lzf, shuffle...
        self.in_memory = (compressed or d.size <= IN_MEMORY_BYTES) if in_memory is None else in_memory

    def _check_jpeg(self, f, jpeg, d, in_memory):
        s, n = self.split, self._n
        if not isinstance(jpeg, h5py.Dataset) or jpeg.dtype != np.uint8 or jpeg.ndim != 1:
            self._refuse(f"/{s}/jpeg is {describe_dataset(jpeg)}, expected uint8 (total bytes,)")
        if not isinstance(d, h5py.Dataset) or d.shape != (n + 1,) \
                or not np.issubdtype(d.dtype, np.integer):
            self._refuse(f"/{s}/offsets is {describe_dataset(d)}, expected N+1 = {n + 1} integers")
        offsets = load_whole(d, self.path)  # a read past the bytes would fail mid-epoch
        if offsets[0] != 0 or offsets[-1] != jpeg.shape[0] or np.any(np.diff(offsets) <= 0):
            self._refuse(f"/{s}/offsets must rise strictly from 0 to len(jpeg) = {jpeg.shape[0]}")
        self.image_size = positive_int(f.attrs.get("image_size"))
        if self.image_size is None:
            self._refuse(f"attr image_size is {shown(f.attrs.get('image_size'))}, expected the "
                         f"pictures' shorter side, a positive integer (the JPEG variant)")
        self.kind, self.in_memory = "jpeg", bool(in_memory)

    def __len__(self):
        return self._n

    def _data(self):
        """The image (or JPEG byte) dataset, through this process's reading handle: opened on
        first use, and anew after a fork."""
        with self._lock:
            if self._h5 is None or self._h5[0] != os.getpid():
                # rdcc_nbytes=0: no chunk cache, so a random read costs just its bytes (see top).
                f = open_readonly(self.path, rdcc_nbytes=0)
                g = f[self.split]
                self._labels = load_whole(g["labels"], self.path).astype(np.int64, copy=False)
                ds = g["jpeg" if self.kind == "jpeg" else "images"]
                if self.kind == "jpeg":
                    self._offsets = load_whole(g["offsets"], self.path).astype(np.int64, copy=False)
                self._images = load_whole(ds, self.path) if self.in_memory else None
                self._raw = None
                if self.kind == "array" and not self.in_memory:
                    starts = _chunk_file_offsets(ds)
                    if starts is not None:
                        rows = ds.chunks[0] if ds.chunks else max(1, ds.shape[0])
                        self._raw = (np.memmap(self.path, np.uint8, "r"), starts, rows)
                self._h5 = (os.getpid(), f, ds)  # the dataset object too: a lookup costs ~40 us
            return self._h5[2]

    def read(self, start, stop):
        start, stop = max(0, start), min(self._n, stop)
        return self.take(np.arange(start, max(start, stop), dtype=np.int64))

    def take(self, indices):
        indices = np.asarray(indices, dtype=np.int64)
        if indices.size and (indices.min() < 0 or indices.max() >= self._n):
            raise IndexError(f"{self.path}/{self.split}: index out of range [0, {self._n})")
        ds = self._data()
        order = None
        if np.any(np.diff(indices) < 0):  # read in increasing order, give back in the asked one
            order = np.argsort(indices, kind="stable")
            indices = indices[order]
        if self.kind == "jpeg":
            images = self._take_jpeg(ds, indices)
        elif self._images is not None:
            images = self._images[indices]
        elif self._raw is not None:
            images = self._take_raw(indices, ds.shape[1:])
        else:
            images = self._take_array(ds, indices)
        labels = self._labels[indices]
        if order is not None:
            inverse = np.empty_like(order)
            inverse[order] = np.arange(len(order))
            labels = labels[inverse]
            images = [images[i] for i in inverse] if self.kind == "jpeg" else images[inverse]
        return images, labels

    def take_labels(self, indices):
        """Labels only (no image read): for a rank that needs targets but not pixels."""
        self._data()
        return self._labels[np.asarray(indices, dtype=np.int64)]

    def _take_raw(self, idx, shape):
        mm, starts, rows = self._raw
        size = int(np.prod(shape))
        out = np.empty((len(idx), size), np.uint8)
        # a slice copy per image from the page cache costs ~1 us: cheaper than building a
        # (n, size) fancy index
        for k, o in enumerate((starts[idx // rows] + idx % rows * size).tolist()):
            out[k] = mm[o:o + size]
        return out.reshape((len(idx),) + tuple(shape))

    @staticmethod
    def _take_array(ds, idx):
        out = np.empty((len(idx),) + ds.shape[1:], np.uint8)
        if len(idx):
            starts, ends = _runs(idx)
            for a, b in zip(starts.tolist(), ends.tolist()):  # one slice read per run
                first = int(idx[a])
                out[a:b] = ds[first:first + (b - a)]
        return out

    def _take_jpeg(self, ds, idx):
        off = self._offsets
        blobs = []
        if not len(idx):
            return blobs
        starts, ends = _runs(idx)
        for a, b in zip(starts.tolist(), ends.tolist()):  # one byte-range read per run
            first, last = int(idx[a]), int(idx[b - 1]) + 1
            lo, hi = int(off[first]), int(off[last])
            buf = self._images[lo:hi] if self._images is not None else ds[lo:hi]
            buf = buf.tobytes()
            cuts = (off[first:last + 1] - lo).tolist()
            blobs.extend(buf[cuts[k]:cuts[k + 1]] for k in range(last - first))
        return blobs

    def close(self):
        with self._lock:
            if self._h5 is not None and self._h5[0] == os.getpid():
                self._h5[1].close()
            self._h5 = self._raw = None

    def __getstate__(self):
        # Picklable for spawned processes: the open handle and loaded arrays stay behind.
        state = dict(self.__dict__)
        state.update(_h5=None, _lock=None, _labels=None, _offsets=None, _images=None, _raw=None)
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def __repr__(self):
        return f"H5Source({self.path}:{self.split}, kind={self.kind}, n={self._n}, size={self.image_size})"
