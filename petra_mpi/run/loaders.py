"""The run's data: the training and validation loaders, opened on the processes holding a
stage 0 and checked against the config (classes, images or tokens, context), and the epoch's
lengths every rank agrees on. Here rather than in petra_mpi/data, which knows nothing of a
run's config or its errors (the offline packers use it too)."""
import itertools
import os
import sys

import torch

from ..models import NetSpec
from .errors import TrainingError
from .placement import decode_threads


def open_data(cfg, device, shard=(0, 1), decoders=1):
    """Training and validation loaders (only processes holding a stage 0 call this). shard:
    (replica, R): the training loader hands out this replica's share of every epoch. decoders:
    JPEG decode workers per loader (decode_threads)."""
    from ..data import BatchLoader, open_split
    sizes = (cfg.data.synthetic_train, cfg.data.synthetic_val)
    try:
        train = open_split(cfg.data.path, "train", synthetic_sizes=sizes, seed=cfg.data.synthetic_seed)
        val = open_split(cfg.data.path, "val", synthetic_sizes=sizes, seed=cfg.data.synthetic_seed)
    except (OSError, ValueError) as e:
        raise TrainingError(f"data.path {e}") from None  # e starts with the path
    if train.num_classes != cfg.model.num_classes:
        raise TrainingError(f"data.path {cfg.data.path} has {train.num_classes} classes but "
                            f"model.num_classes is {cfg.model.num_classes}")
    if (train.kind == "tokens") != NetSpec.of_config(cfg).takes_tokens:
        held = "tokens" if train.kind == "tokens" else "images"
        raise TrainingError(f"data.path {cfg.data.path} holds {held} but model.arch is "
                            f"{cfg.model.arch}: token files (petra_mpi.prep.text) go with revlm/lm "
                            f"and networks whose first block reads token ids (input_dtype "
                            f"torch.long, docs/own_model.md)")
    if train.kind == "tokens":  # the windows are the model's context
        try:
            train.set_context(cfg.model.context)
            val.set_context(cfg.model.context)
        except ValueError as e:
            raise TrainingError(f"data.path {e}") from None
    jpeg = train.kind == "jpeg"
    side = train.image_size
    if jpeg:
        from ..data.augment import crop_side, has_gpu_decode
        side = crop_side(train.image_size, cfg.data.crop)
        cpus = len(os.sched_getaffinity(0))
        for warning in (decode_cpu_warning(cfg, cpus, has_gpu_decode(device)),
                        crop_warning(cfg, train.image_size)):
            if warning:
                print(warning, file=sys.stderr, flush=True)
    common = dict(seed=cfg.run.seed, device=device, crop=side if jpeg else None,
                  prefetch=cfg.data.prefetch, decode_threads=decoders,
                  decode_pool=cfg.data.decode_pool)
    shape = (cfg.model.context,) if train.kind == "tokens" else (3, side, side)
    return (BatchLoader(train, cfg.data.batch_size, train=True, augment=cfg.data.augment,
                        shard=shard, **common),
            BatchLoader(val, cfg.data.batch_size, train=False, augment=False, **common),
            shape)


# CPUs a stage-0 rank decoding full-size JPEGs on the CPU should have when data.decode_workers
# leaves it to the rank's CPU set: what the ImageNet batch scripts give each rank.
MIN_DECODE_CPUS = 8


def decode_cpu_warning(cfg, cpus: int, gpu_decode: bool):
    """A warning when this stage-0 rank has fewer CPUs than the config's JPEG decode needs (a
    launcher that binds each rank to one CPU starves the whole pipeline of data), else None."""
    needed = cfg.data.decode_workers or MIN_DECODE_CPUS
    if gpu_decode or cpus >= needed:
        return None
    wanted = ("data.decode_workers asks for" if cfg.data.decode_workers else
              "full-size ImageNet wants")
    return (f"petra_mpi: warning: stage 0 decodes JPEGs on {cpus} CPU(s), fewer than the "
            f"{needed} that {wanted}: the pipeline will wait for data. Under SLURM give the "
            f"job --cpus-per-task={needed} and pass it to srun (slurm/common.sh does); the rank "
            f"map shows each rank's CPUs")


def crop_warning(cfg, image_size: int):
    """A warning when data.crop is larger than the JPEG pictures' stored side (every picture
    upsampled: slower, no more detail), else None."""
    if cfg.data.crop <= image_size:
        return None
    from ..data.augment import crop_side
    return (f"petra_mpi: warning: data.crop {cfg.data.crop} is larger than the pictures' stored "
            f"side {image_size} in {cfg.data.path}: every picture is upsampled "
            f"{cfg.data.crop / image_size:.1f}x (slower, no more detail); leave data.crop at 0 "
            f"for {crop_side(image_size)}, 7/8 of the side")


def open_loaders(cfg, world, placement):
    """(training loaders, validation loader, (training batches, validation batches, input
    shape)): the loaders on stage 0 (in one process one training loader per replica, each its
    shard), none elsewhere; the lengths the same on every rank."""
    train_loaders, val_loader, lengths = [], None, None
    if placement.stage == 0:
        shards = ([(placement.replica, placement.R)] if world else
                  [(r, placement.R) for r in range(placement.R)])
        for shard in shards:
            train_loader, val, input_shape = open_data(
                cfg, placement.device, shard, decode_threads(cfg, placement.threads, len(shards)))
            train_loaders.append(train_loader)
            if val_loader is None:
                val_loader = val
            else:
                val.close()
        lengths = (len(train_loaders[0]), len(val_loader), input_shape)
    if world:
        lengths = world.share_lengths(lengths)
    return train_loaders, val_loader, lengths


def segment_lengths(cfg, train_batches: int, val_batches: int):
    n = train_batches if not cfg.train.limit_batches else min(train_batches, cfg.train.limit_batches)
    m = val_batches if not cfg.train.limit_eval_batches else min(val_batches,
                                                                cfg.train.limit_eval_batches)
    if n < 1:
        raise TrainingError(f"data.path {cfg.data.path}: fewer training images than one batch of "
                            f"{cfg.data.batch_size}")
    return n, m


def training_batches(loaders, epoch, position, dtype):
    """This process's training batches from `position` (stage 0 only): one stream, or in one
    process one per replica, each replica's share at the same position."""
    feeds = []
    for loader in loaders:
        loader.load_state_dict({"epoch": epoch, "position": position})
        feeds.append(as_dtype(iter(loader), dtype))
    return feeds if len(feeds) > 1 else feeds[0]


def validation_batches(loader, count, dtype):
    """The first `count` validation batches (stage 0 only), the same at every evaluation."""
    loader.load_state_dict({"epoch": 0, "position": 0})
    return as_dtype(itertools.islice(iter(loader), count), dtype)


def as_dtype(batches, dtype):
    """The batches with their inputs in the run's storage dtype."""
    if dtype == torch.float32:
        return batches
    return ((x.to(dtype) if x.is_floating_point() else x, y) for x, y in batches)  # ids stay ids
