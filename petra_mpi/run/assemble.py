"""A run's parts from (config, world, placement): its stages, their workers and optimizers, the
learning-rate schedule, the tracers, the watchdog and the engine that runs them (over ranks or in
one process)."""
import dataclasses
import sys

from ..comm.compress import Compression
from ..core.compensation import DelayCompensation
from ..engines.build import StageSpec, build_engine, build_stages, build_workers
from ..models import NetSpec
from ..core.optim import LRSchedule, peak_lr
from ..core.schedule import schedule_for
from ..core import trace
from .watchdog import start_watchdog


@dataclasses.dataclass
class RunParts:
    stages: list
    workers: list
    pipeline_workers: list  # one pipeline's (replica 0's in one process, this rank's under MPI)
    steps_per_epoch: int
    lr_schedule: LRSchedule
    tracers: list
    engine: object          # MPIEngine or LocalEngine
    watchdog: object        # watches the engine's loops and the trainer's collectives

    @property
    def tracer(self):
        return self.tracers[0]  # this process's eval and checkpoint spans


def run_lr_schedule(cfg, steps_per_epoch: int, replicas: int = 1) -> LRSchedule:
    # the paper's rule on the effective batch: R replicas each accumulate k micro-batches a step
    peak = peak_lr(cfg.optim.lr, cfg.data.batch_size * replicas, cfg.train.accumulation,
                   cfg.optim.scale_lr)
    return LRSchedule(peak, steps_per_epoch, cfg.optim.warmup_epochs, tuple(cfg.optim.milestones),
                      cfg.optim.gamma, kind=cfg.optim.schedule,
                      total_steps=steps_per_epoch * cfg.train.epochs)


def assemble_run(cfg, world, placement, layout, input_shape, microbatches_per_epoch,
                 diagnostics=None) -> RunParts:
    """The stages of `layout` (layout.choose_layout; in one process: R identical replicas, in
    rank order; under MPI this rank's), their workers and the engine. diagnostics: a callback
    for train.diag_every's records."""
    J, R = placement.J, placement.R
    compression = Compression.from_config(cfg.comm, cfg.run.seed)
    net = NetSpec.of_config(cfg, input_shape[-1])  # the loader's image side
    spec = StageSpec(net,
                     cfg.train.method, cfg.train.buffer_inputs, cfg.train.stash_weights,
                     cfg.model.rebuild_last_stage, placement.device, placement.dtype, compression)
    stages = []
    for r in range(1 if world else R):
        stages += build_stages(spec, layout, only=placement.stage if world else None,
                               replica=placement.replica if world else r)
    steps_per_epoch = -(-microbatches_per_epoch // cfg.train.accumulation)
    lr_schedule = run_lr_schedule(cfg, steps_per_epoch, R)
    # Collective (a Barrier fixes the common time origin); NULL_TRACERs when run.trace is off.
    tracers = trace.start(cfg.run.trace, world,
                          [placement.rank] if world else list(range(len(stages))),
                          placement.device)
    hooks = []
    if cfg.train.diag_every:
        from .diagnostics import Diagnostics
        hooks.append(Diagnostics(cfg.train.diag_every, cfg.train.accumulation, emit=diagnostics))
    workers = build_workers(stages, lr_schedule, cfg.train.accumulation, cfg.optim.momentum,
                            cfg.optim.nesterov, cfg.optim.weight_decay, optimizer=cfg.optim.name,
                            betas=tuple(cfg.optim.betas), tracers=tracers, hooks=hooks,
                            method=cfg.train.method,
                            compensation=DelayCompensation.from_config(cfg.optim,
                                                                       steps_per_epoch))
    # ends this rank with a report when it hangs (watchdog.py); its first micro-batch through
    # every stage ends the start-up; its heartbeat is in the run directory
    watchdog = start_watchdog(cfg.run.watchdog_s if world else 0, world, schedule_for(
        cfg.train.method, J, cfg.train.accumulation).num_ticks(1), cfg.run.out_dir)
    engine = build_engine(workers, cfg.train.method, world, input_shape, cfg.data.batch_size,
                          dtype=placement.dtype, replicas=R,
                          compression=compression,  # the MPI engine's start-up line shows it
                          **({"heartbeat": watchdog,
                              "labels_per_sample": (cfg.model.context
                                                    if net.takes_tokens else 1)}
                             if world else {}))
    if world:
        watchdog.watch_messages(engine.pending_messages)
    elif compression.active:
        print(f"petra_mpi: {compression.describe()}", file=sys.stderr, flush=True)
    return RunParts(stages, workers, workers[:J], steps_per_epoch, lr_schedule, tracers, engine,
                    watchdog)
