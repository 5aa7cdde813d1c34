"""BatchLoader: sampler, batching, background prefetch and on-device augmentation.

Sampler: a train epoch is a permutation seeded by (seed, epoch), cut into full batches (the
last partial one is dropped); an eval pass is the split in order, the last batch possibly short.
With data-parallel replicas, shard=(r, R): replica r's batch i is batch i·R + r of the epoch
(augmentation draws included), so the replicas read disjoint shares of the same permutation and
an epoch is still one pass; each share has the same length (the last < R batches are dropped).
A batch's indices are sorted, so that the reader gets a few increasing slices (a batch is a set:
the order inside it does not matter to the gradient).

Resumable: `position` is the next batch of `epoch`. It advances when a batch is handed out, so
a state_dict taken after training on a batch resumes at the following one; after the last batch
of an epoch the state is (epoch + 1, 0). Augmentation draws come from a numpy Generator seeded
by (seed, epoch, batch), never from a running RNG, so a resumed run sees identical batches.

A daemon thread reads (and, for JPEG on the CPU, decodes and crops) batches ahead into a queue
of `prefetch` entries, so memory stays bounded; the main thread moves each uint8 batch to the
device and augments / normalises it there.
"""
import atexit
import multiprocessing
import os
import queue
import threading
import weakref
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor

import numpy as np
import torch

from . import augment as A


_live = weakref.WeakSet()  # loaders that have started a prefetch thread


@atexit.register
def _stop_all_at_exit():
    # Daemon threads are frozen wherever they stand when the interpreter finalises; one frozen
    # inside h5py holds its global lock, and closing the HDF5 files at teardown then deadlocks
    # (seen: a hang at exit, 1 run in ~10). So stop them first: atexit runs before that freeze.
    for loader in list(_live):
        loader._stop_active()


class _Failure:
    """An exception raised in the prefetch thread, carried to the consumer."""

    def __init__(self, exc):
        self.exc = exc


class BatchLoader:
    def __init__(self, src, batch_size, *, train, seed, device="cpu", augment=True, crop=None,
                 prefetch=2, decode_threads=None, decode_pool="thread", shard=(0, 1)):
        """src: a source from open_split. train: shuffled drop-last epochs with augmentation
        (if `augment`); else the split in order, unaugmented. crop: output side of JPEG data
        (default 224); array data keep their size. prefetch: batches read ahead (0: read in the
        consuming thread). decode_threads: PIL decode workers for JPEG data (None: one per CPU
        of this process's affinity set, e.g. the task's --cpus-per-task under srun).
        decode_pool: "thread" or "process" (a process pool started by forkserver, for when
        threads stop scaling on the GIL). shard: (replica, replicas) of a training loader (see
        the module's docstring); `position` then counts this replica's batches."""
        if int(batch_size) < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if int(seed) < 0:
            raise ValueError(f"seed must be >= 0, got {seed}")
        self.src = src
        self.batch_size = int(batch_size)
        self.train = bool(train)
        self.seed = int(seed)
        self.shard, self.shards = int(shard[0]), int(shard[1])
        if not 0 <= self.shard < self.shards or (self.shards > 1 and not self.train):
            raise ValueError(f"shard={shard}: needs 0 <= replica < replicas, on a training loader")
        self.device = torch.device(device)
        self.augment = bool(augment) and self.train
        if src.kind == "array":
            if crop not in (None, src.image_size):
                raise ValueError(f"crop={crop}: array data keep their size ({src.image_size}); "
                                 "crop applies to JPEG data")
            self.crop = src.image_size
        else:
            self.crop = int(crop or 224)
        self.prefetch = max(0, int(prefetch))
        self._gpu_decode = src.kind == "jpeg" and A.has_gpu_decode(self.device)
        if decode_threads is None:
            decode_threads = (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                              else os.cpu_count() or 1)
        self.decode_threads = max(1, int(decode_threads))
        if decode_pool not in ("thread", "process"):
            raise ValueError(f"decode_pool must be thread or process, got {decode_pool!r}")
        self.decode_pool = decode_pool
        self._pool = None
        self._pin = self.device.type == "cuda"  # pinned host memory: asynchronous copies
        self._scale, self._shift = A.norm_constants(src.mean, src.std, self.device)
        self.epoch, self.position = 0, 0
        self._perm = (None, None)   # (epoch, permutation) of the last train epoch asked for
        self._active = None         # (stop event, thread) of the live iterator

    # ---- sampler ---------------------------------------------------------------------------
    def __len__(self):
        n = len(self.src)
        return n // self.batch_size // self.shards if self.train else -(-n // self.batch_size)

    def _order(self, epoch):
        cached = self._perm  # one read: the prefetch thread may replace it concurrently
        if cached[0] != epoch:
            rng = np.random.default_rng([self.seed, 0, epoch])
            cached = (epoch, rng.permutation(len(self.src)))
            self._perm = cached
        return cached[1]

    def batch_indices(self, batch, epoch=None):
        """Sorted dataset indices of batch `batch` of `epoch` (default: the current epoch)."""
        epoch = self.epoch if epoch is None else int(epoch)
        if not 0 <= batch < len(self):
            raise IndexError(f"batch {batch} out of range [0, {len(self)})")
        batch = self._global(batch)
        lo, hi = batch * self.batch_size, (batch + 1) * self.batch_size
        if self.train:
            return np.sort(self._order(epoch)[lo:hi])
        return np.arange(lo, min(hi, len(self.src)), dtype=np.int64)

    def batch_labels(self, batch, epoch=None):
        """The int64 labels of a batch (on the device) without reading its images, in the order
        of that batch's images (the MPI engine sends labels from rank 0 instead)."""
        y = torch.from_numpy(self.src.take_labels(self.batch_indices(batch, epoch)))
        return y.to(self.device)

    def batch_rng(self, batch, epoch=None):
        """The Generator of a batch's augmentation: a pure function of (seed, epoch, batch)."""
        epoch = self.epoch if epoch is None else int(epoch)
        return np.random.default_rng([self.seed, 1, epoch, self._global(batch)])

    def _global(self, batch):
        """This replica's batch `batch` as a batch of the whole epoch."""
        return batch * self.shards + self.shard

    # ---- state -----------------------------------------------------------------------------
    def set_epoch(self, epoch):
        """Start `epoch` at its first batch, unless the loader is already in it (after
        load_state_dict, or after the previous epoch ran out): then it keeps its position, so a
        training loop may call set_epoch at the top of every epoch, resumed or not."""
        self._stop_active()
        if int(epoch) != self.epoch:
            self.epoch, self.position = int(epoch), 0

    def state_dict(self):
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, d):
        self._stop_active()
        epoch, position = int(d["epoch"]), int(d["position"])
        if not 0 <= position <= len(self):
            raise ValueError(f"loader state position {position} outside [0, {len(self)}]")
        self.epoch, self.position = (epoch + 1, 0) if position == len(self) else (epoch, position)

    # ---- reading (runs in the prefetch thread) ---------------------------------------------
    def _load(self, epoch, batch):
        """Read batch `batch` of `epoch` into host tensors (plus its augmentation draws)."""
        idx = self.batch_indices(batch, epoch)
        images, labels = self.src.take(idx)
        rng = self.batch_rng(batch, epoch) if self.augment else None
        item = {"labels": torch.from_numpy(labels)}
        if self.src.kind == "array":
            item["images"] = torch.from_numpy(images)
            if rng is not None:
                dy, dx, flip = A.crop_params(rng, len(idx))
                flip &= self.src.hflip  # drawn all the same: the other draws stay put
                item["params"] = torch.from_numpy(np.stack([dy, dx, flip.astype(np.int64)]))
        elif self.src.kind == "tokens":  # (inputs, next-token targets): no augmentation
            item["images"] = torch.from_numpy(images)
        else:
            flip, uniforms = A.rrc_uniforms(rng, len(idx)) if rng is not None else (None, None)
            if self._gpu_decode:
                item["blobs"], item["uniforms"] = images, uniforms
            else:
                if self.decode_threads > 1 and self._pool is None:
                    self._pool = self._make_pool()
                item["images"] = torch.from_numpy(A.decode_crop_batch_pil(
                    images, self.crop, self.src.image_size, uniforms, self._pool))
            if flip is not None:
                item["flip"] = torch.from_numpy(flip & self.src.hflip)
        if self._pin:
            item = {k: (v.pin_memory() if isinstance(v, torch.Tensor) else v) for k, v in item.items()}
        return item

    def _make_pool(self):
        if self.decode_pool == "thread":
            return ThreadPoolExecutor(self.decode_threads, "petra-jpeg")
        # forkserver/spawn, never fork: this process may hold MPI, CUDA and torch's thread pools
        methods = multiprocessing.get_all_start_methods()
        ctx = multiprocessing.get_context("forkserver" if "forkserver" in methods else "spawn")
        return ProcessPoolExecutor(self.decode_threads, mp_context=ctx)

    def _produce(self, epoch, start, stop_at, q, stop):
        try:
            for b in range(start, stop_at):
                if stop.is_set():
                    return
                if not self._put(q, self._load(epoch, b), stop):
                    return
        except BaseException as e:  # noqa: B902  (carried to the consumer, re-raised there)
            self._put(q, _Failure(e), stop)

    @staticmethod
    def _put(q, item, stop):
        # A timed put: a consumer that went away (stop set) never leaves this thread blocked.
        while not stop.is_set():
            try:
                q.put(item, timeout=0.1)
                return True
            except queue.Full:
                pass
        return False

    # ---- device side (runs in the consuming thread) ----------------------------------------
    def _finish(self, item):
        dev, nb = self.device, self._pin
        y = item["labels"].to(dev, non_blocking=nb)
        if "blobs" in item:
            x = A.decode_crop_batch_cuda(item["blobs"], self.crop, self.src.image_size, dev,
                                         item["uniforms"])
        else:
            x = item["images"].to(dev, non_blocking=nb)  # uint8: 4x less to move than float
        if "params" in item:
            dy, dx, flip = item["params"].to(dev, non_blocking=nb)
            x = A.crop_flip(x, dy, dx, flip.bool())
        elif "flip" in item:
            x = A.flip_images(x, item["flip"].to(dev, non_blocking=nb))
        if self.src.kind == "tokens":
            return x, y  # token ids, not pixels
        return A.normalize(x, self._scale, self._shift), y

    # ---- iteration -------------------------------------------------------------------------
    def __iter__(self):
        # A generator: nothing starts before the first next(), and its `finally` stops the
        # prefetch thread however iteration ends (exhausted, error, break, or garbage collected).
        self._stop_active()  # one live iterator per loader
        epoch, start, n = self.epoch, self.position, len(self)
        stop, thread, q = threading.Event(), None, None
        if self.prefetch:
            q = queue.Queue(self.prefetch)
            thread = threading.Thread(target=self._produce, args=(epoch, start, n, q, stop),
                                      name="petra-data-prefetch", daemon=True)
        self._active = (stop, thread)
        try:
            if thread is not None:
                _live.add(self)
                thread.start()
            for b in range(start, n):
                item = self._load(epoch, b) if q is None else self._get(q, stop, thread)
                if item is None:  # stopped by close(), set_epoch() or load_state_dict()
                    return
                x, y = self._finish(item)
                if stop.is_set():
                    return
                self.epoch, self.position = (epoch + 1, 0) if b + 1 == n else (epoch, b + 1)
                yield x, y
        finally:
            self._stop(stop, thread)

    @staticmethod
    def _get(q, stop, thread):
        while not stop.is_set():
            try:
                item = q.get(timeout=0.1)
            except queue.Empty:
                if not thread.is_alive() and q.empty():
                    raise RuntimeError("data prefetch thread ended unexpectedly") from None
                continue
            if isinstance(item, _Failure):
                raise item.exc
            return item
        return None

    def _stop(self, stop, thread):
        stop.set()
        if thread is not None and thread.ident is not None and thread is not threading.current_thread():
            thread.join(timeout=10)
        if self._active is not None and self._active[0] is stop:
            self._active = None

    def _stop_active(self):
        if self._active is not None:
            self._stop(*self._active)

    def close(self):
        """Stop the prefetch thread (the live iterator ends) and the JPEG decode threads."""
        self._stop_active()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self):
        return (f"BatchLoader({self.src!r}, batch_size={self.batch_size}, train={self.train}, "
                f"augment={self.augment}, device={self.device}, epoch={self.epoch}, "
                f"position={self.position})")
