"""Run under mpirun: one segment in which ONE rank is asked to stop at a fixed tick of its own
engine, to exercise the MPI engine's stop vote deterministically (no signal, no timing).

Usage: mpirun -n J python tests/programs/stop_vote.py OUT_DIR STOP_RANK STOP_TICK N
Writes OUT_DIR/rank{r}.pt with the segment length train_segment returned, whether the drain-point
check saw the stop, and the stage's parameters and buffers.
"""
import sys

import torch

from equivalence import batches
from petra_mpi.engine.build import build_stages, build_workers
from petra_mpi.mpi.engine import MPIEngine
from petra_mpi.mpi.world import World
from petra_mpi.optim import LRSchedule


class StopAtTick:
    """A stop request that turns on once this rank's engine reaches tick `tick` (stage s runs the
    forward of micro-batch b at tick b + s), on the chosen rank only; the engine reads
    `requested` as it reads a signal handler's flag."""

    def __init__(self, worker, tick, active):
        self.requested = False
        for name in ("forward", "forward_backward"):
            original = getattr(worker, name)

            def watched(b, *args, original=original):
                if active and b + worker.index >= tick:
                    self.requested = True
                return original(b, *args)

            setattr(worker, name, watched)  # the real operation still runs, after the check


def main():
    out, stop_rank, stop_tick, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    world = World.from_environment()
    stages = build_stages("revnet18", 4, 10, world.size, seed=0, only=world.rank)
    (worker,) = build_workers(stages, LRSchedule(0.3, 4, warmup_epochs=1, milestones=(2,)), 2,
                              weight_decay=5e-4)
    engine = MPIEngine(worker, "petra", world, torch.float32, (3, 16, 16), 4)
    stop = StopAtTick(worker, stop_tick, world.rank == stop_rank)
    trained = engine.train_segment(batches(n) if world.rank == 0 else None, n, stop=stop)
    state = {"trained": trained, "any_stop": engine.any_stop(stop),
             "params": [p.detach() for p in worker.stage.parameters()],
             "buffers": [b.detach() for b in worker.stage.buffers()]}
    torch.save(state, f"{out}/rank{world.rank}.pt")


if __name__ == "__main__":
    main()
