"""Building the stages, their workers and the engine that runs them, identically in every engine
and on every rank: the trainer (run/assemble.py) and every benchmark build through here."""

import torch

from ..comm.devices import to_device
from ..models import build_blocks, set_precision
from ..comm.compress import NO_COMPRESSION
from ..core.compensation import NO_COMPENSATION, DelayCompensation, delay_steps
from ..core.optim import StageOptimizer, constant_lr
from ..core.memory_plan import plan_split
from ..core.partition import resolve_partition, split_blocks
from ..core.stages import Stage
from ..core.trace import NULL_TRACER
from ..core.worker import StageWorker


def build_stages(arch: str, width: int, num_classes: int, num_stages: int, *, seed: int = 0,
                 imagenet_stem: bool = False, partition=None, image_size: int = 32,
                 buffer_inputs: bool = False, stash_weights: bool = False,
                 device="cpu", dtype=torch.float32, only: int | None = None,
                 model_kw: dict | None = None, precision: str = "fp32",
                 compression=None, replica: int = 0, kept=None, memory_budget=0,
                 batch_size: int = 1, rebuild_last_stage: bool = False) -> list[Stage]:
    """All stages (or just stage `only`), with weights that depend on the seed alone: every rank
    builds the whole net from the same seed and keeps its own part. `model_kw`: depth, heads and
    patch of revvit/vit (config.model_kwargs). precision: fp32, or bf16 (autocast inside each
    block; the tensors between blocks keep `dtype`). Placed by devices.to_device (channels-last on
    CUDA). compression (compress.Compression): its `buffers` format packs the FIFO entries, each
    stage's with the random stream of its own stage and `replica` (the replica these stages
    belong to: stochastic rounding draws differently in every replica, as their messages do).
    kept: per stage of the whole split, the kept plan of its blocks (Stage.set_kept; None:
    PETRA); else, with a memory_budget (model.memory_budget) other than 0, memory_plan.plan_split's
    plan for micro-batches of `batch_size` samples, the same on every rank.
    rebuild_last_stage (model.rebuild_last_stage): the last stage holds no graph but rebuilds
    and recomputes in its backward (Stage.set_rebuild_last)."""
    torch.manual_seed(seed)
    blocks = build_blocks(arch, width, num_classes, imagenet_stem, image_size=image_size,
                          **(model_kw or {}))
    set_precision(blocks, precision)
    sizes = resolve_partition(blocks, num_stages, partition, image_size)
    if memory_budget and kept is None:
        sizes, plan = plan_split(blocks, num_stages, partition, memory_budget, batch_size,
                                 image_size=image_size, device=device, dtype=dtype)
        kept = plan.kept
    stages = []
    for s, stage_blocks in enumerate(split_blocks(blocks, sizes)):
        if only is not None and s != only:
            continue
        stage = Stage(stage_blocks, s, num_stages, buffer_inputs=buffer_inputs,
                      stash_weights=stash_weights, kept=kept[s] if kept else None,
                      partition=sizes, rebuild_last=rebuild_last_stage and s == num_stages - 1,
                      buffer_codec=(None if compression is None
                                    else compression.codec("buffers", s, replica)))
        stages.append(to_device(stage, device, dtype))
    return stages


def build_workers(stages, lr_schedule=None, accumulation: int = 1, momentum: float = 0.9,
                  nesterov: bool = True, weight_decay: float = 0.0, *,
                  optimizer: str = "sgd", betas=(0.9, 0.999), tracers=None, hooks=(),
                  method: str = "petra", compensation: DelayCompensation = NO_COMPENSATION):
    """One worker per stage; lr_schedule: the learning rate per optimizer step (None:
    constant_lr, for benchmarks); tracers: one per stage (trace.start), hooks: WorkerHooks for
    all; compensation: delay compensation, by each stage's delay under `method`."""
    lr_schedule = lr_schedule or constant_lr()
    tracers = tracers or [NULL_TRACER] * len(stages)
    return [StageWorker(s, StageOptimizer(s, lr_schedule, momentum, nesterov, weight_decay,
                                          name=optimizer, betas=betas,
                                          delay=delay_steps(method, s.window, accumulation),
                                          compensation=compensation.for_method(method)),
                        accumulation, tracer=tracer, hooks=hooks)
            for s, tracer in zip(stages, tracers)]


def build_engine(workers, method: str, world, input_shape, batch_size: int, *,
                 dtype=torch.float32, compression=NO_COMPRESSION, replicas: int = 1,
                 **mpi_options):
    """The engine that runs `workers` with `method`: over ranks (world given) this rank's single
    worker on the MPIEngine (mpi_options: its heartbeat, poll_between_blocks, poll_sleep,
    labels_per_sample), else every worker (R replicas of J stages, in rank order) in one
    process. Several engines may share a worker: benchmarks alternate methods on one stage."""
    if world:
        from .mpi import MPIEngine
        return MPIEngine(workers[0], method, world, dtype, input_shape, batch_size,
                         compression, **mpi_options)
    from .local import LocalEngine
    return LocalEngine(workers, method, replicas, compression)
