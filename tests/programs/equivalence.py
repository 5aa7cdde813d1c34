"""Run under mpirun: train a few micro-batches with the MPI engine and save each rank's stage.

Usage: mpirun -n J python tests/mpi/equivalence.py OUT_DIR METHOD K N [buffer] [stash] [short_eval]
(buffer, stash: the delayed method's switches; short_eval: evaluation ends with a batch of 2)
"""
import sys

import torch

from petra_mpi.engine.build import build_stages, build_workers
from petra_mpi.engine.mpi import MPIEngine
from petra_mpi.engine.world import World
from petra_mpi.optim import LRSchedule


def batches(n, batch=4, size=16, seed=1):
    g = torch.Generator().manual_seed(seed)
    for _ in range(n):
        yield (torch.randn(batch, 3, size, size, generator=g),
               torch.randint(0, 10, (batch,), generator=g))


def eval_batches(short=False):
    """3 full evaluation batches of 4, and with `short` a last one of 2 (as when the validation
    set does not divide by the batch size: receivers learn the size from the message)."""
    yield from batches(3, seed=3)
    if short:
        x, y = next(batches(1, seed=4))
        yield x[:2], y[:2]


# The tiny revvit of tests/test_revvit.py's invariant 3 (flag "revvit"): 16x16 images, 4x4 patches.
REVVIT = dict(width=8, image_size=16, model_kw=dict(depth=4, heads=2, patch=4))


def main():
    out, method, k, n = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    flags = dict(buffer_inputs="buffer" in sys.argv[5:], stash_weights="stash" in sys.argv[5:])
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    world = World.from_environment()
    if "revvit" in sys.argv[5:]:
        stages = build_stages("revvit", REVVIT["width"], 10, world.size, seed=0, only=world.rank,
                              image_size=REVVIT["image_size"], model_kw=REVVIT["model_kw"],
                              **flags)
    else:
        stages = build_stages("revnet18", 4, 10, world.size, seed=0, only=world.rank, **flags)
    (worker,) = build_workers(stages, LRSchedule(0.3, 4, warmup_epochs=1, milestones=(2,)), k,
                              weight_decay=5e-4)
    engine = MPIEngine(worker, method, world, torch.float32, (3, 16, 16), 4)
    data = batches(n) if world.rank == 0 else None
    engine.train_segment(data, n)
    engine.train_segment(batches(n, seed=2) if world.rank == 0 else None, n)  # a second segment
    short = "short_eval" in sys.argv[5:]
    totals = engine.evaluate(eval_batches(short) if world.rank == 0 else None, 3 + short)
    state = {"params": [p.detach() for p in worker.stage.parameters()],
             "buffers": [b.detach() for b in worker.stage.buffers()],
             "eval": totals.result() if totals else None}
    torch.save(state, f"{out}/rank{world.rank}.pt")


if __name__ == "__main__":
    main()
