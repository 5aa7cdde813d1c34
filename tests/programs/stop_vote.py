"""Run under mpirun: one segment in which ONE rank is asked to stop at a fixed tick of its own
engine, to exercise the MPI engine's stop vote deterministically (no signal, no timing).

Usage: mpirun -n J python tests/programs/stop_vote.py OUT_DIR STOP_RANK STOP_TICK N
Writes OUT_DIR/rank{r}.pt with the segment length train_segment returned, whether the drain-point
check saw the stop, and the stage's parameters and buffers.
"""
import sys

import torch

from equivalence import batches
from petra_mpi.core.planner import plan_layout
from petra_mpi.engines.build import StageSpec, build_stages, build_workers
from petra_mpi.models import NetSpec
from petra_mpi.core.worker import WorkerHooks
from petra_mpi.engines.mpi import MPIEngine
from petra_mpi.comm.world import World
from petra_mpi.core.optim import LRSchedule
from petra_mpi.core.schedule import Kind
from petra_mpi.engines.stopping import agree


class StopAtTick(WorkerHooks):
    """A stop request that turns on once this rank's worker reaches tick `tick` (stage s runs the
    forward of micro-batch b at tick b + s), on the chosen rank only; the engine reads
    `requested` as it reads a signal handler's flag. A worker hook: it looks before the real
    forward runs."""

    def __init__(self, tick, active):
        self.requested = False
        self.tick, self.active = tick, active

    def before(self, worker, action, x=None, labels=None):
        forwards = action.kind in (Kind.FORWARD, Kind.FORWARD_BACKWARD)
        if forwards and self.active and action.microbatch + worker.index >= self.tick:
            self.requested = True


def main():
    out, stop_rank, stop_tick, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    world = World.from_environment()
    net = NetSpec("revnet18", 4, 10)
    stages = build_stages(StageSpec(net), plan_layout(net, world.size), only=world.rank)
    stop = StopAtTick(stop_tick, world.rank == stop_rank)
    (worker,) = build_workers(stages, LRSchedule(0.3, 4, warmup_epochs=1, milestones=(2,)), 2,
                              weight_decay=5e-4, hooks=[stop])
    engine = MPIEngine(worker, "petra", world, torch.float32, (3, 16, 16), 4)
    trained = engine.train_segment(batches(n) if world.rank == 0 else None, n, stop=stop)
    state = {"trained": trained, "any_stop": bool(agree(world, stop)),
             "params": [p.detach() for p in worker.stage.parameters()],
             "buffers": [b.detach() for b in worker.stage.buffers()]}
    torch.save(state, f"{out}/rank{world.rank}.pt")


if __name__ == "__main__":
    main()
