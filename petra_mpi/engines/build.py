"""Building the stages, their workers and the engine that runs them, identically in every engine
and on every rank: the trainer (run/assemble.py) and every benchmark build through here."""

from dataclasses import dataclass

import torch

from ..comm.devices import to_device
from ..models import NetSpec
from ..comm.compress import NO_COMPRESSION, Compression
from ..core.compensation import NO_COMPENSATION, DelayCompensation
from ..core.optim import StageOptimizer, constant_lr
from ..core.partition import check_split, split_blocks
from ..core.planner import Layout
from ..core.schedule import schedule_for
from ..core.stages import Stage
from ..core.trace import NULL_TRACER
from ..core.worker import StageWorker


@dataclass(frozen=True)
class StageSpec:
    """How every stage of a run is built, beside its layout: the net, the method (whose
    schedule gives each stage its in-flight count), its switches, where the stages live."""
    net: NetSpec
    method: str = "petra"
    buffer_inputs: bool = False  # delayed: reversible blocks keep their input
    stash_weights: bool = False  # delayed: each in-flight micro-batch keeps its weights
    rebuild_last_stage: bool = False  # the last stage holds no graph (Stage.set_rebuild_last)
    device: object = "cpu"
    dtype: torch.dtype = torch.float32
    compression: Compression | None = None  # its `buffers` format packs the FIFO entries


def build_stages(spec: StageSpec, layout: Layout, *, only: int | None = None,
                 replica: int = 0) -> list[Stage]:
    """All stages of `layout` (planner.plan_layout), or just stage `only`, with weights that
    depend on the net's seed alone: every rank builds the whole net and keeps its own part.
    Placed by devices.to_device (channels-last on CUDA). The FIFO entries of each stage are
    packed with the random stream of its own stage and `replica` (the replica these stages
    belong to: stochastic rounding draws differently in every replica, as their messages do)."""
    blocks = spec.net.blocks()
    J = layout.num_stages
    check_split(layout.split, J, len(blocks))
    schedule = schedule_for(spec.method, J)
    stages = []
    for s, stage_blocks in enumerate(split_blocks(blocks, layout.split)):
        if only is not None and s != only:
            continue
        stage = Stage(stage_blocks, s, J, schedule=schedule, buffer_inputs=spec.buffer_inputs,
                      stash_weights=spec.stash_weights,
                      kept=layout.kept[s] if layout.kept else None, partition=layout.split,
                      rebuild_last=spec.rebuild_last_stage and s == J - 1,
                      buffer_codec=(None if spec.compression is None
                                    else spec.compression.codec("buffers", s, replica)))
        stages.append(to_device(stage, spec.device, spec.dtype))
    return stages


def build_workers(stages, lr_schedule=None, accumulation: int = 1, momentum: float = 0.9,
                  nesterov: bool = True, weight_decay: float = 0.0, *,
                  optimizer: str = "sgd", betas=(0.9, 0.999), tracers=None, hooks=(),
                  method: str = "petra", compensation: DelayCompensation = NO_COMPENSATION):
    """One worker per stage; lr_schedule: the learning rate per optimizer step (None:
    constant_lr, for benchmarks); tracers: one per stage (trace.start), hooks: WorkerHooks for
    all; compensation: delay compensation, by each stage's delay in updates under `method`'s
    schedule."""
    lr_schedule = lr_schedule or constant_lr()
    tracers = tracers or [NULL_TRACER] * len(stages)
    schedule = schedule_for(method, stages[0].num_stages, accumulation)
    return [StageWorker(s, StageOptimizer(s, lr_schedule, momentum, nesterov, weight_decay,
                                          name=optimizer, betas=betas,
                                          delay=schedule.delay_in_updates(s.index),
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
