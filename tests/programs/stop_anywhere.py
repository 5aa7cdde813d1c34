"""A stop request at a chosen tick of one segment, in either engine: under mpirun the MPI engine
(one rank per stage), imported the single-process engine, on the same net and data, so that a
test can hold the two to the same state after the same stop.

Usage: mpirun -n J python tests/programs/stop_anywhere.py OUT_DIR RUN [RUN ...]
RUN is METHOD:K:N:STAGE:TICK: a segment of N micro-batches at accumulation K, asked to stop when
stage STAGE reaches tick TICK (the delayed method buffers inputs and stashes weights). Run RUN
writes OUT_DIR/RUN/rank{r}.pt with the stage's state (stage_state) and a checkpoint of it in
OUT_DIR/RUN/checkpoint/.
"""
import os
import sys

import torch

from equivalence import batches
from petra_mpi.run.checkpoint import save_blocks
from petra_mpi.core.planner import plan_layout
from petra_mpi.engines.build import StageSpec, build_stages, build_workers
from petra_mpi.models import NetSpec
from petra_mpi.engines.local import LocalEngine
from petra_mpi.core.worker import WorkerHooks
from petra_mpi.core.optim import LRSchedule
from petra_mpi.core.schedule import schedule_for


class StopAtTick(WorkerHooks):
    """A stop request that turns on as stage `stage` (any stage: None) begins its first action
    at a tick at or after `tick`; the engines read `requested` as they read a signal handler's
    flag. `fired`: the tick it turned on at. A worker hook, so it sees the engine's own order."""

    def __init__(self, schedule, n, tick, stage=None):
        self.requested, self.fired = False, None
        self.tick, self.stage = tick, stage
        # The tick of each action of the segment of n: a shortened segment runs the actions it
        # keeps at the same ticks (a step that the shortening adds is not listed: a backward
        # at the same tick comes before it).
        self.ticks = {(s, a.kind, a.microbatch): t for s in range(schedule.J)
                      for t in range(schedule.num_ticks(n)) for a in schedule.actions(s, t, n)}

    def before(self, worker, action, x=None, labels=None):
        if self.requested or self.stage not in (None, worker.index):
            return
        t = self.ticks.get((worker.index, action.kind, action.microbatch))
        if t is not None and t >= self.tick:
            self.requested, self.fired = True, t


def build(method, J, k, only=None, hooks=()):
    """The stages and workers of the run (all stages, or just stage `only`)."""
    delayed = method == "delayed"
    net = NetSpec("revnet18", 4, 10)
    spec = StageSpec(net, buffer_inputs=delayed, stash_weights=delayed)
    stages = build_stages(spec, plan_layout(net, J), only=only)
    workers = build_workers(stages, LRSchedule(0.3, 4, warmup_epochs=1, milestones=(2,)), k,
                            weight_decay=5e-4, hooks=hooks)
    return stages, workers


def stage_state(worker) -> dict:
    """Everything a checkpoint holds of a stage that training changes."""
    opt = worker.optimizer
    return {"params": [p.detach().clone() for p in worker.stage.parameters()],
            "buffers": [b.detach().clone() for b in worker.stage.buffers()],
            "momentum": [s["momentum_buffer"].clone() for s in opt.torch_optimizer.state.values()],
            "steps": opt.steps, "pending": opt.pending}


def run_local(method, J, k, n, stage, tick):
    """The single-process engine on the same net, data and stop: (trained, one state per stage)."""
    stop = StopAtTick(schedule_for(method, J, k), n, tick, stage)
    _, workers = build(method, J, k, hooks=[stop])
    trained = LocalEngine(workers, method).train_segment(batches(n), n, stop=stop)
    return trained, [stage_state(w) for w in workers]


def run_mpi(world, out, method, k, n, stage, tick):
    from petra_mpi.engines.mpi import MPIEngine
    J = world.size
    stop = StopAtTick(schedule_for(method, J, k), n, tick, stage)
    _, (worker,) = build(method, J, k, only=world.rank, hooks=[stop])
    engine = MPIEngine(worker, method, world, torch.float32, (3, 16, 16), 4)
    trained = engine.train_segment(batches(n) if world.rank == 0 else None, n, stop=stop)
    save_blocks(os.path.join(out, "checkpoint"), worker)  # raises unless every step was taken
    torch.save({"trained": trained, **stage_state(worker)},
               os.path.join(out, f"rank{world.rank}.pt"))


def main():
    from mpi4py import MPI
    from petra_mpi.comm.mpi import MPIGroup
    from petra_mpi.comm.world import World
    out, runs = sys.argv[1], sys.argv[2:]
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    world = World(MPIGroup(MPI.COMM_WORLD))  # also with one rank: the MPI engine at J = 1
    for run in runs:
        method, k, n, stage, tick = run.split(":")
        run_mpi(world, os.path.join(out, run), method, int(k), int(n), int(stage), int(tick))


if __name__ == "__main__":
    main()
