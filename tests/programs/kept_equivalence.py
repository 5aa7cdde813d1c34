"""Run under mpirun: train irevnet18 with each kept-blocks plan of PLANS with the MPI engine and
save each rank's stage, for the MPI = local tests in tests/mpi/test_kept_blocks_mpi.py.

Usage: mpirun -n J python tests/programs/kept_equivalence.py OUT_DIR N K
Writes OUT_DIR/{plan}-rank{r}.pt: parameters, buffers, the plan, the peak kept bytes and the
rank's streams (the bytes each outgoing one sent, None for an incoming one)."""
import os
import sys

import torch

from petra_mpi.comm.compress import NO_COMPRESSION
from petra_mpi.core.planner import plan_layout
from petra_mpi.engines.build import StageSpec, build_stages, build_workers
from petra_mpi.models import NetSpec
from petra_mpi.engines.mpi import MPIEngine
from petra_mpi.comm.world import World
from petra_mpi.core.optim import LRSchedule

ARCH, SIDE = "irevnet18", 16


def batches(n, batch=4, seed=1):
    g = torch.Generator().manual_seed(seed)
    for _ in range(n):
        yield (torch.randn(batch, 3, SIDE, SIDE, generator=g),
               torch.randint(0, 10, (batch,), generator=g))


def mixed_plan(stage) -> list[int]:
    """Block i of stage s keeps (i + s) mod (d_s + 1) of every d_s micro-batches where it can:
    some blocks keep none, some a few, some all (with 3 stages: [0, 1] and [1, 2, 0])."""
    return [(i + stage.index) % (stage.window + 1) if stage.can_keep else 0
            for i in range(len(stage.blocks))]


def last_keeps_all(stage) -> list[int]:
    """mixed_plan, but the last block of every stage with a delay keeps all d_s micro-batches:
    such a stage never uses a rebuilt input, so its successor sends none."""
    plan = mixed_plan(stage)
    return plan[:-1] + [stage.window] if stage.window else plan


PLANS = {"mixed": mixed_plan, "last_keeps_all": last_keeps_all}


def schedule():
    return LRSchedule(0.3, 4, warmup_epochs=1, milestones=(2,))


def main():
    out, n, k = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    world = World.from_environment()
    os.makedirs(out, exist_ok=True)
    for name, plan in PLANS.items():
        net = NetSpec(ARCH, 4, 10, image_size=SIDE)
        (stage,) = build_stages(StageSpec(net), plan_layout(net, world.size), only=world.rank)
        stage.set_kept(plan(stage))  # before the engine opens its streams
        (worker,) = build_workers([stage], schedule(), k, weight_decay=5e-4)
        engine = MPIEngine(worker, "petra", world, torch.float32, (3, SIDE, SIDE), 4,
                           NO_COMPRESSION)
        engine.train_segment(batches(n) if world.rank == 0 else None, n)
        engine.train_segment(batches(n, seed=2) if world.rank == 0 else None, n)
        torch.save({"params": [p.detach() for p in stage.parameters()],
                    "buffers": [b.detach() for b in stage.buffers()],
                    "kept": stage.kept, "peak_kept_bytes": stage.peak_kept_bytes,
                    "streams": {s: getattr(box, "sent_bytes", None)
                                for s, box in engine.streams.items()}},
                   os.path.join(out, f"{name}-rank{world.rank}.pt"))


if __name__ == "__main__":
    main()
