"""BatchLoader: batches of a split, read ahead in a thread and augmented on the device.

Which samples make a batch, and its augmentation draws: sampler.EpochSampler. Resumable:
`position` is the next batch of `epoch`. It advances when a batch is handed out, so a state_dict
taken after training on a batch resumes at the following one; after the last batch of an epoch
the state is (epoch + 1, 0).

A daemon thread (prefetch.Prefetch) reads (and, for JPEG on the CPU, decodes and crops) batches
ahead into a queue of `prefetch` entries, so memory stays bounded; the main thread moves each
uint8 batch to the device and augments / normalises it there.
"""
import io
import multiprocessing
import os
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor

import numpy as np
import torch
from PIL import Image, UnidentifiedImageError

from . import augment as A
from .checks import DataError
from .prefetch import NoPrefetch, Prefetch
from .sampler import EpochSampler


def undecodable(src, indices, blobs, error):
    """The DataError of a batch of JPEGs that did not decode: names the file and the first
    picture that does not (the batch's indices if each decodes alone)."""
    for i, blob in zip(indices, blobs):
        try:
            with Image.open(io.BytesIO(blob)) as im:
                im.load()
        except Exception as e:
            why = "not a picture" if isinstance(e, UnidentifiedImageError) else \
                f"{type(e).__name__}: {e}"
            return DataError(f"{src.path}: /{src.split}/jpeg image {i} does not decode ({why})")
    return DataError(f"{src.path}: /{src.split}/jpeg images {indices[0]}..{indices[-1]}: "
                     f"{type(error).__name__}: {error}")


class BatchLoader:
    def __init__(self, src, batch_size, *, train, seed, device="cpu", augment=True, crop=None,
                 prefetch=2, decode_threads=None, decode_pool="thread", shard=(0, 1)):
        """src: a source from open_split. train: shuffled drop-last epochs with augmentation
        (if `augment`); else the split in order, unaugmented. crop: output side of JPEG data
        (None or 0: about 7/8 of the stored side, augment.crop_side); array data keep their
        size. prefetch: batches read ahead (0: read in the consuming thread). decode_threads: PIL decode workers for JPEG data (None: one per CPU
        of this process's affinity set, e.g. the task's --cpus-per-task under srun).
        decode_pool: "thread" or "process" (a process pool started by forkserver, for when
        threads stop scaling on the GIL). shard: (replica, replicas) of a training loader (see
        the module's docstring); `position` then counts this replica's batches."""
        self.sampler = EpochSampler(len(src), batch_size, train=train, seed=seed, shard=shard)
        self.src = src
        self.batch_size, self.train = self.sampler.batch_size, self.sampler.train
        self.device = torch.device(device)
        self.augment = bool(augment) and self.train
        if src.kind == "array":
            if crop not in (None, src.image_size):
                raise ValueError(f"crop={crop}: array data keep their size ({src.image_size}); "
                                 "crop applies to JPEG data")
            self.crop = src.image_size
        else:
            self.crop = A.crop_side(src.image_size, crop)
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
        self._active = None  # the Prefetch (or NoPrefetch) of the live iterator

    # ---- sampler ---------------------------------------------------------------------------
    def __len__(self):
        return len(self.sampler)

    def batch_indices(self, batch, epoch=None):
        """Sorted dataset indices of batch `batch` of `epoch` (default: the current epoch)."""
        return self.sampler.indices(batch, self.epoch if epoch is None else int(epoch))

    def batch_labels(self, batch, epoch=None):
        """The int64 labels of a batch (on the device) without reading its images, in the order
        of that batch's images (the MPI engine sends labels from rank 0 instead)."""
        y = torch.from_numpy(self.src.take_labels(self.batch_indices(batch, epoch)))
        return y.to(self.device)

    def batch_rng(self, batch, epoch=None):
        """The Generator of a batch's augmentation: a pure function of (seed, epoch, batch)."""
        return self.sampler.rng(batch, self.epoch if epoch is None else int(epoch))

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
                try:
                    decoded = A.decode_crop_batch_pil(images, self.crop, self.src.image_size,
                                                      uniforms, self._pool)
                except Exception as e:  # PIL's errors, re-raised by the pool
                    raise undecodable(self.src, idx, images, e) from None
                item["images"] = torch.from_numpy(decoded)
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

        def load(b):
            return self._load(epoch, b)
        source = Prefetch(load, start, n, self.prefetch) if self.prefetch else \
            NoPrefetch(load, start)
        self._active = source
        try:
            for b in range(start, n):
                item = source.get()
                if item is None:  # stopped by close(), set_epoch() or load_state_dict()
                    return
                x, y = self._finish(item)
                if source.stopped.is_set():
                    return
                self.epoch, self.position = (epoch + 1, 0) if b + 1 == n else (epoch, b + 1)
                yield x, y
        finally:
            source.stop()
            if self._active is source:
                self._active = None

    def _stop_active(self):
        if self._active is not None:
            self._active.stop()
            self._active = None

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
