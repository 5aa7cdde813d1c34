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


def missing_virtual_sources(f, path):
    """The source files of /<split>/jpeg virtual datasets (a joined shard set) that do not
    exist: HDF5 would read their bytes as zeros without an error. Relative names are looked for
    where HDF5 looks: under each folder of HDF5_VDS_PREFIX (':'-separated, ${ORIGIN} standing
    for the folder of `path`), then in the folder of `path`, then in the working directory."""
    folder, missing = os.path.dirname(os.path.abspath(path)), []
    prefixes = [p.replace("${ORIGIN}", folder)
                for p in os.environ.get("HDF5_VDS_PREFIX", "").split(":") if p]
    for split in SPLITS:
        ds = f.get(f"{split}/jpeg")
        if isinstance(ds, h5py.Dataset) and ds.is_virtual:
            for source in ds.virtual_sources():
                if source.file_name == ".":
                    continue
                places = [os.path.join(p, source.file_name) for p in prefixes + [folder, "."]]
                if not any(map(os.path.isfile, places)) and places[-2] not in missing:
                    missing.append(places[-2])
    return missing


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
            raise ValueError(f"{self.path}: not a readable HDF5 file ({e})") from None
        with f:
            self._validate_and_load_meta(f, in_memory)
        self._h5 = None      # (pid, h5py.File, dataset): the reading handle, opened lazily
        self._lock = threading.Lock()
        self._labels = self._offsets = self._images = None  # loaded on first read
        self._raw = None  # (memmap of the file, chunk start offsets, rows per chunk)

    def _validate_and_load_meta(self, f, in_memory):
        p, s = self.path, self.split
        version = f.attrs.get("schema_version")
        if version is None or int(version) != SCHEMA_VERSION:
            raise ValueError(f"{p}: schema_version is {version!r}, this reader needs {SCHEMA_VERSION}")
        missing = [a for a in ("num_classes", "mean", "std") if a not in f.attrs]
        if missing:
            raise ValueError(f"{p}: missing root attribute(s) {', '.join(missing)}")
        if s not in f:
            raise ValueError(f"{p}: no split '{s}' (the file has: {', '.join(sorted(f)) or 'nothing'})")
        g = f[s]
        if "labels" not in g:
            raise ValueError(f"{p}: missing /{s}/labels")
        self.num_classes = int(f.attrs["num_classes"])
        self.mean = tuple(float(v) for v in f.attrs["mean"])
        self.std = tuple(float(v) for v in f.attrs["std"])
        if len(self.mean) != 3 or len(self.std) != 3:
            raise ValueError(f"{p}: mean and std must hold 3 floats each")
        self.hflip = bool(f.attrs.get("hflip", True))
        n = g["labels"].shape[0]
        # Checked here, not by the loss mid-epoch: one line at start-up instead of a traceback.
        labels = g["labels"][:]
        if n and (labels.min() < 0 or labels.max() >= self.num_classes):
            wrong = labels[(labels < 0) | (labels >= self.num_classes)]
            raise ValueError(f"{p}: /{s}/labels holds {len(wrong)} label(s) outside [0, "
                             f"{self.num_classes}) (num_classes), e.g. {int(wrong[0])}; "
                             f"python -m petra_mpi.prep.verify {p} checks the whole file")
        if "images" in g:
            d = g["images"]
            if d.dtype != np.uint8 or d.ndim != 4 or d.shape[3] != 3:
                raise ValueError(f"{p}: /{s}/images must be uint8 (N, H, W, 3), got {d.dtype}{d.shape}")
            if d.shape[0] != n:
                raise ValueError(f"{p}: /{s}/images has {d.shape[0]} rows but labels has {n}")
            self.kind, self.image_size = "array", int(d.shape[1])
            compressed = d.id.get_create_plist().get_nfilters() > 0  # gzip, lzf, shuffle...
            self.in_memory = (compressed or d.size <= IN_MEMORY_BYTES) if in_memory is None else in_memory
        elif "jpeg" in g and "offsets" in g:
            if g["offsets"].shape != (n + 1,):
                raise ValueError(f"{p}: /{s}/offsets must have N+1 = {n + 1} entries, "
                                 f"has {g['offsets'].shape}")
            if "image_size" not in f.attrs:
                raise ValueError(f"{p}: JPEG-variant file lacks the root attribute image_size")
            missing = missing_virtual_sources(f, p)
            if missing:
                raise ValueError(f"{p}: joins shard files that are missing: {', '.join(missing)}")
            self.kind, self.image_size = "jpeg", int(f.attrs["image_size"])
            self.in_memory = bool(in_memory)
        else:
            raise ValueError(f"{p}: /{s} holds neither 'images' nor 'jpeg' + 'offsets'")
        self._n = int(n)

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
                self._labels = g["labels"][:]
                ds = g["jpeg" if self.kind == "jpeg" else "images"]
                if self.kind == "jpeg":
                    self._offsets = g["offsets"][:]
                self._images = ds[:] if self.in_memory else None
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
