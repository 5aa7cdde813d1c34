"""What every packer shares: the schema writer (the schema: petra_mpi/data/schema.py), exact
channel statistics, atomic output, a progress printer, the error/exit-status convention of
the command lines, and the ordered pool of worker processes (ordered_map).
"""
import collections
import contextlib
import functools
import importlib
import itertools
import multiprocessing
import os
import pickle
import signal
import sys
import time

import h5py
import numpy as np
# Imported now, not by a packer's first np.random call: numpy imports it lazily, and a Ctrl-C
# that lands in its C initialisation is dropped, so a packer whose output is already open would
# compute on to its next write before it stopped.
import numpy.random  # noqa: F401

from .. import files
from ..data.schema import SCHEMA_VERSION, SPLITS  # noqa: F401 (the packers' schema)
from ..data.stats import ChannelStats  # noqa: F401 (the packers' statistics)
from ..data.hdf5 import open_unlocked
from ..run.metrics import Progress  # noqa: F401 (the packers' progress line)


class PrepError(Exception):
    """An expected failure caused by the input (missing file, bad archive, bad label...).

    The command lines print it as one line and exit with status 2, without a traceback."""


def run_cli(main, argv=None):
    """Run main(argv) as a command: PrepError or files.OutputRefused -> one line + exit 2,
    Ctrl-C/SIGTERM -> exit 130; the caller's handlers of both signals are restored after.

    Both signals get our own handler (_on_interrupt). SIGINT is installed explicitly because a
    process started in the background by a shell without job control inherits SIGINT as
    ignored, and Python then leaves it ignored."""
    # Under `python -m petra_mpi.prep.x` main.__module__ is "__main__"; its spec has the real name.
    spec = getattr(sys.modules[main.__module__], "__spec__", None)
    prog = spec.name if spec else main.__module__
    _interrupt_signals.clear()
    previous = {sig: signal.signal(sig, _on_interrupt) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        status = main(argv)
        check_interrupt()  # a signal whose exception something swallowed still counts
    except (KeyboardInterrupt, Exception) as e:  # not SystemExit: argparse's exits pass
        # an error after a signal is the signal's doing (a library it left half done)
        if isinstance(e, KeyboardInterrupt) or _interrupt_signals:
            print(f"\n{prog}: interrupted; partial output removed", file=sys.stderr)
            status = 130
        elif isinstance(e, (PrepError, files.OutputRefused)):
            message = " ".join(str(e).split())  # one line, even when a library's message is not
            print(f"{prog}: error: {message}", file=sys.stderr)
            status = 2
        else:
            raise
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        _interrupt_signals.clear()  # a caller that goes on (a test) starts afresh
    raise SystemExit(status or 0)


# The signals received since run_cli started. The handler raises KeyboardInterrupt at once, as
# Python's own Ctrl-C does, and records the signal: where the exception was lost (raised inside
# an import, a finalizer or a C extension, which drop it), the write loops (check_interrupt) stop
# the packer at its next picture or batch, and the commit of the output (atomic_path) and
# run_cli refuse to finish. (Where a C extension ran the code that the exception left through
# PyRun_String, as numpy.random's first import can, CPython then ends the process by SIGINT
# instead of status 130, once everything is cleaned up: a shell sees 130 either way.)
_interrupt_signals = []


def _on_interrupt(signum, frame):
    _interrupt_signals.append(signum)
    raise KeyboardInterrupt


def check_interrupt():
    """Raise KeyboardInterrupt if a Ctrl-C or SIGTERM reached run_cli's handler."""
    if _interrupt_signals:
        raise KeyboardInterrupt


def shown(text):
    """`text` (a path, a name) fit for a one-line message: bytes that are not UTF-8 and control
    characters (a newline in a file name) escaped as Python writes them."""
    return "".join(f"\\x{ord(c) - 0xdc00:02x}" if "\udc80" <= c <= "\udcff"  # os's escapes
                   else c if c.isprintable() else repr(c)[1:-1] for c in str(text))


def add_output_options(p, help="the HDF5 file to write"):
    """--out and --force, the output options of every packer."""
    p.add_argument("--out", required=True, help=help)
    p.add_argument("--force", action="store_true", help="replace --out if it exists")


def claim_output(args, inputs=()):
    """Check args.out before any input is read (files.check_output: not a folder, not one of
    `inputs` nor inside an input folder, not an existing file unless --force), and remove the
    temporary files that a packer killed by SIGKILL left beside it, saying so."""
    files.check_output(args.out, inputs, force=args.force)
    for path in files.remove_stale_temporaries(args.out):
        print(f"removed {shown(path)}, left by an earlier run that was killed", file=sys.stderr)


def announce_start(path):
    """Print the line that says the packer is under way: its signal handlers are installed and
    the temporary output exists, so an interrupt from now on removes it (scripts and tests wait
    for this line before they interrupt)."""
    print(f"started: writing {shown(path)} (Ctrl-C stops and removes it)", flush=True)


@contextlib.contextmanager
def interrupts_held_back():
    """Hold back SIGINT and SIGTERM while the block runs (they stay pending, not lost).

    Processes forked inside the block start with both blocked, so a Ctrl-C to the process group
    cannot reach a pool worker before worker_init has told it to ignore SIGINT; the parent gets
    the pending signal as soon as the block ends."""
    held = {signal.SIGINT, signal.SIGTERM}
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, held)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def worker_init():
    """ordered_map's workers leave Ctrl-C to the parent (which then kills them) and die quietly
    on a SIGTERM instead of running our handler. The signals blocked by interrupts_held_back
    are unblocked once these dispositions are in place."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, signal.SIGTERM})


# CIFAR batches and the pickled Imagenet32 release are pickles. Unpickling can run arbitrary
# code, so only the globals a pickled numpy array needs are allowed (files written by old numpy
# name numpy.core, numpy >= 2 writes numpy._core).
_SAFE_GLOBALS = {("numpy.core.multiarray", "_reconstruct"), ("numpy._core.multiarray", "_reconstruct"),
                 ("numpy.core.multiarray", "scalar"), ("numpy._core.multiarray", "scalar"),
                 ("numpy", "ndarray"), ("numpy", "dtype"), ("_codecs", "encode")}


class _SafeUnpickler(pickle.Unpickler):
    def find_class(self, module, name):
        if (module, name) not in _SAFE_GLOBALS:
            raise pickle.UnpicklingError(f"refusing to load global {module}.{name}")
        return getattr(importlib.import_module(module), name)


def load_pickle(fileobj, where):
    """Load a pickled dict of arrays; keys come back as str whether pickled as str or bytes."""
    try:
        # latin1: the upstream pickles come from Python 2 (str keys, byte-string arrays).
        d = _SafeUnpickler(fileobj, encoding="latin1").load()
    except Exception as e:
        raise PrepError(f"{where}: cannot unpickle ({e})") from None
    if not isinstance(d, dict):
        raise PrepError(f"{where}: expected a pickled dict, got {type(d).__name__}")
    return {(k.decode() if isinstance(k, bytes) else k): v for k, v in d.items()}


@contextlib.contextmanager
def atomic_path(path):
    """files.atomic_path (a temporary name beside `path`, renamed to `path` only if the block
    succeeds), which also leaves nothing in place after an interrupt."""
    with files.atomic_path(path) as tmp:
        yield tmp
        check_interrupt()


@contextlib.contextmanager
def atomic_h5(path):
    """An h5py.File open for writing that appears at `path` only when complete."""
    with atomic_path(path) as tmp:
        with open_unlocked(tmp, "w") as f:
            announce_start(tmp)
            yield f


def chunk_rows(image_bytes):
    """Images per chunk: a few hundred small images, fewer big ones (chunks of <= ~4 MiB).

    Measured on 50k 32x32 images: contiguous 256-image slices read in ~0.15 ms with 256-image
    chunks (0.3 ms with 1024); lzf gained nothing on image data and halved full-scan speed,
    so no compression."""
    return int(max(1, min(256, (4 << 20) // image_bytes)))


class _LabelsMixin:
    def _write_labels(self):
        labels = np.asarray(self.labels, dtype=np.int64)
        self.f.create_dataset(f"{self.split}/labels", data=labels)
        return labels


class ArrayWriter(_LabelsMixin):
    """Appends batches of one split to /<split>/images (resizable, chunked along N) and
    collects the labels, written in one piece by close()."""

    def __init__(self, f, split, height, width):
        self.f, self.split, self.labels = f, split, []
        self.pending = []  # (image, label) of append_one, written a chunk at a time
        rows = chunk_rows(height * width * 3)
        self.images = f.create_dataset(
            f"{split}/images", shape=(0, height, width, 3), maxshape=(None, height, width, 3),
            dtype=np.uint8, chunks=(rows, height, width, 3))

    def append(self, images, labels):
        check_interrupt()
        if images.dtype != np.uint8 or images.shape[1:] != self.images.shape[1:]:
            raise PrepError(f"{self.split}: batch of {images.dtype}{images.shape} does not match "
                            f"uint8{self.images.shape[1:]}")
        n0 = self.images.shape[0]
        self.images.resize(n0 + len(images), axis=0)
        self.images[n0:] = images
        self.labels.extend(int(v) for v in labels)

    def append_one(self, image, label):
        """One image (H, W, 3); buffered, so that HDF5 grows the dataset a chunk at a time."""
        self.pending.append((image, label))
        if len(self.pending) >= self.images.chunks[0]:
            self._flush()

    def _flush(self):
        if self.pending:
            images, labels = zip(*self.pending)
            self.pending = []
            self.append(np.stack(images), labels)

    def close(self):
        self._flush()
        return self._write_labels()


class JpegWriter(_LabelsMixin):
    """Appends encoded JPEGs of one split to /<split>/jpeg (1-D, resizable) and records
    /<split>/offsets. Small chunks (64 KiB) because readers fetch single images at random:
    a big chunk would be read whole for one ~50 KB image."""

    FLUSH_BYTES = 64 << 20

    def __init__(self, f, split, chunk_bytes=64 << 10):
        self.f, self.split, self.labels = f, split, []
        self.offsets = [0]
        self.buf = bytearray()
        self.jpeg = f.create_dataset(f"{split}/jpeg", shape=(0,), maxshape=(None,),
                                     dtype=np.uint8, chunks=(chunk_bytes,))

    def append(self, data, label):
        """One encoded image (bytes)."""
        self.append_many(data, [0, len(data)], [label])

    append_one = append  # the interface write_pictures uses for both writers

    def append_many(self, data, rel_offsets, labels):
        """Several images at once: their concatenated bytes, their offsets from 0, labels."""
        check_interrupt()
        # memoryview: `bytearray += ndarray` would be numpy's elementwise add.
        self.buf += memoryview(data)
        base = self.offsets[-1]
        self.offsets.extend(base + int(o) for o in rel_offsets[1:])
        self.labels.extend(int(v) for v in labels)
        if len(self.buf) >= self.FLUSH_BYTES:
            self._flush()

    def _flush(self):
        if self.buf:
            n0 = self.jpeg.shape[0]
            self.jpeg.resize((n0 + len(self.buf),))
            self.jpeg[n0:] = np.frombuffer(self.buf, dtype=np.uint8)
            self.buf = bytearray()

    def close(self):
        self._flush()
        self.f.create_dataset(f"{self.split}/offsets", data=np.asarray(self.offsets, np.int64))
        return self._write_labels()


def write_root_attrs(f, *, num_classes, stats, source, classes=None, **extra):
    """The root attributes of the schema (+ optional /classes and extra attributes)."""
    try:
        mean, std = stats.mean_std()
    except ValueError as e:  # an empty training split
        raise PrepError(str(e)) from None
    f.attrs["schema_version"] = np.int64(SCHEMA_VERSION)
    f.attrs["num_classes"] = np.int64(num_classes)
    f.attrs["mean"] = np.asarray(mean, dtype=np.float64)
    f.attrs["std"] = np.asarray(std, dtype=np.float64)
    f.attrs["source"] = str(source)
    for key, value in extra.items():
        f.attrs[key] = value
    if classes is not None:
        if len(classes) != num_classes:
            raise PrepError(f"{len(classes)} class names for {num_classes} classes")
        f.create_dataset("classes", data=list(classes), dtype=h5py.string_dtype("utf-8"))


def check_labels(labels, num_classes, where):
    """Raise PrepError naming `where` if any label is outside [0, num_classes)."""
    labels = np.asarray(labels)
    bad = np.flatnonzero((labels < 0) | (labels >= num_classes))
    if len(bad):
        raise PrepError(f"{where}: label {labels[bad[0]]} at index {bad[0]} is outside "
                        f"[0, {num_classes}) ({len(bad)} bad labels)")


def planes_to_nhwc(rows, size):
    """CIFAR/Imagenet32 rows (N, 3*size*size): the R plane, then G, then B -> (N, size, size, 3)."""
    return np.ascontiguousarray(rows.reshape(-1, 3, size, size).transpose(0, 2, 3, 1))


def describe(f):
    """Human-readable lines about an open schema file (used by every summary and by verify)."""
    lines = []
    for split in SPLITS:
        g = f.get(split)
        if g is None:
            continue
        n = len(g["labels"]) if "labels" in g else "?"
        if "images" in g:
            shape = "x".join(str(s) for s in g["images"].shape[1:])
            lines.append(f"  {split}: {n} images {shape}")
        elif "jpeg" in g:
            joined = ""
            if g["jpeg"].is_virtual:
                files = {v.file_name for v in g["jpeg"].virtual_sources()}
                joined = f", read from {len(files)} shard files"
            lines.append(f"  {split}: {n} JPEGs, {g['jpeg'].shape[0] / 2**20:.1f} MiB{joined}")
    a = f.attrs
    names = f["classes"][:3] if "classes" in f else []
    names = ", ".join(n.decode() if isinstance(n, bytes) else str(n) for n in names)
    lines.append(f"  classes: {a.get('num_classes')}" + (f" ({names}, ...)" if names else ""))
    if "image_size" in a:
        lines.append(f"  image_size (shorter side): {a['image_size']}")
    for key in ("mean", "std"):
        if key in a:
            lines.append(f"  {key}: " + ", ".join(f"{v:.4f}" for v in np.ravel(a[key])))
    lines.append(f"  source: {a.get('source')}, schema_version {a.get('schema_version')}")
    return lines


def print_summary(path, start_time):
    """The end-of-run summary of a packer, printed on stdout."""
    with open_unlocked(path, "r") as f:
        lines = describe(f)
    size = os.path.getsize(path)
    print(f"wrote {shown(path)} ({size / 2**20:.1f} MiB) in {time.monotonic() - start_time:.1f} s")
    print("\n".join(lines))


@contextlib.contextmanager
def ordered_map(workers, chunk=8):
    """Yield a map(fn, items) that preserves order, over `workers` processes (or in-process).

    At most 2 * workers chunks of `chunk` items are handed to the workers and not yet consumed: a
    consumer that stalls (a slow file system under the writer) stops the workers instead of
    letting finished images pile up in memory. Leaving the `with` (end, error, Ctrl-C) kills
    and reaps the workers. Open it before any output file: forked workers would otherwise
    inherit the file's descriptor and HDF5 lock.

    Each worker has a pipe of its own and nothing is shared between them. (multiprocessing.Pool
    sends every result through one queue behind one lock; a worker that Pool.terminate kills
    while it holds that lock leaves the pool's task thread waiting for it forever, and the
    packer hangs on its way out of a Ctrl-C.)"""
    if workers <= 1:
        yield map
        return
    procs, conns = [], []
    try:
        with interrupts_held_back():  # no worker may see a Ctrl-C before worker_init ignores it
            for _ in range(workers):
                ours, theirs = multiprocessing.Pipe()
                proc = multiprocessing.Process(target=worker_loop, args=(theirs,), daemon=True)
                proc.start()
                theirs.close()
                procs.append(proc)
                conns.append(ours)
        yield functools.partial(bounded_imap, list(zip(procs, conns)), chunk=chunk,
                                max_chunks=2 * workers)
    finally:
        for proc in procs:
            proc.kill()  # stateless: nothing to finish, whether the map ended or not
        for proc, conn in zip(procs, conns):
            proc.join()  # reaped: no zombie left behind
            conn.close()


def bounded_imap(workers, fn, items, *, chunk, max_chunks):
    """map(fn, items) in order over `workers` [(process, pipe)]: chunk number c goes to worker
    c mod len(workers), and each worker answers its chunks in the order it got them. At most
    max_chunks chunks are handed out and unconsumed; items are drawn from `items` only as room
    frees up, in the caller's thread."""
    items = iter(items)
    pending = collections.deque()  # the (process, pipe) of each chunk handed out, in order
    handed = 0
    while True:
        while len(pending) < max_chunks:
            batch = list(itertools.islice(items, chunk))
            if not batch:
                break
            proc, conn = workers[handed % len(workers)]
            try:
                conn.send((fn, batch))
            except OSError:  # a broken pipe: the worker is gone
                raise worker_died(proc) from None
            pending.append((proc, conn))
            handed += 1
        if not pending:
            return
        proc, conn = pending.popleft()
        try:
            ok, result = conn.recv()
        except (EOFError, OSError):
            raise worker_died(proc) from None
        if not ok:
            raise result
        yield from result


def worker_died(proc):
    proc.join(timeout=5)
    return PrepError(f"a worker process ended before its work was done (exit status "
                     f"{proc.exitcode}; out of memory?)")


def worker_loop(conn):
    """A worker of ordered_map: (fn, batch) in, (True, [fn(x) for x in batch]) or (False, the
    exception) out, until the parent kills it."""
    worker_init()
    while True:
        fn, batch = conn.recv()
        try:
            reply = (True, [fn(x) for x in batch])
        except Exception as e:  # raised again in the parent, as the map's caller would see it
            reply = (False, e)
        try:
            conn.send(reply)
        except Exception as e:  # an exception that does not pickle: its text
            conn.send((False, RuntimeError(f"{type(e).__name__} in a worker: {e}")))
