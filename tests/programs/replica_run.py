"""Run under mpirun: R data-parallel replicas of a J = size / R stage pipeline train two segments
and evaluate; each rank saves its stage's parameters, buffers, evaluation totals and (lr0) the
gradients every step applied.

Usage: mpirun -n R*J python tests/programs/replica_run.py OUT_DIR METHOD K N R [flags]
flags: float64; lr0 (lr = 0, no momentum: record the applied gradients); revvit (the tiny
BN-free reversible ViT); noreduce (negative control: the replicas never average); compensate
(every delay compensation on, as equivalence.py's flag); torch (over torch.distributed:
comm.transport torch).
The data: the global sequence global_batches(R * n, seed), replica r reading micro-batches
r, r + R, r + 2R, ... (as the sampler's shares do).
"""
import sys

import torch

from petra_mpi.core.planner import plan_layout
from petra_mpi.engines.build import StageSpec, build_stages, build_workers
from petra_mpi.models import NetSpec
from petra_mpi.engines.mpi import MPIEngine
from petra_mpi.comm.world import World
from petra_mpi.core.optim import LRSchedule

from equivalence import REVVIT, batches, eval_batches, optimizer_settings


def global_batches(count, seed, dtype=torch.float32):
    return [(x.to(dtype), y) for x, y in batches(count, seed=seed)]


def share(items, replica, replicas):
    return items[replica::replicas]


def schedule(lr0):
    return LRSchedule(0.0, 10**6) if lr0 else LRSchedule(0.3, 4, warmup_epochs=1, milestones=(2,))


def build(arch_flags, J, dtype, only=None):
    net = (NetSpec("revvit", REVVIT["width"], 10, image_size=REVVIT["image_size"],
                   model_kw=REVVIT["model_kw"]) if "revvit" in arch_flags
           else NetSpec("revnet18", 4, 10))
    return build_stages(StageSpec(net, dtype=dtype), plan_layout(net, J), only=only)


def record_applied(worker) -> dict:
    """Per parameter, the sum of the gradients the worker's optimizer steps apply (averaged over
    k and over the replicas: what the step itself sees), recorded as each step begins."""
    applied, optimizer = {}, worker.optimizer
    step = optimizer.step

    def recording_step():
        if optimizer.pending:
            for i, p in enumerate(worker.stage.parameters()):
                applied[i] = applied.get(i, 0) + p.grad / optimizer.pending
        step()

    optimizer.step = recording_step
    return applied


def main():
    out, method, k, n, R = sys.argv[1], sys.argv[2], *map(int, sys.argv[3:6])
    flags = sys.argv[6:]
    dtype = torch.float64 if "float64" in flags else torch.float32
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    world = World.from_environment("torch" if "torch" in flags else "mpi")
    world.split(world.size // R)
    J = world.stages
    stages = build(flags, J, dtype, only=world.stage)
    lr0 = "lr0" in flags
    (worker,) = build_workers(stages, schedule(lr0), k, momentum=0.0 if lr0 else 0.9,
                              weight_decay=0.0 if lr0 else 5e-4,
                              **optimizer_settings(method, flags))
    applied = record_applied(worker) if lr0 else {}
    engine = MPIEngine(worker, method, world, dtype, (3, 16, 16), 4)
    if "noreduce" in flags:
        worker.average_with(None)
    first = world.stage == 0
    for seed in (1, 2):  # two segments
        data = share(global_batches(R * n, seed, dtype), world.replica, R)
        engine.train_segment(iter(data) if first else None, n)
    evals = [(x.to(dtype), y) for x, y in eval_batches()]
    totals = engine.evaluate(iter(evals) if first else None, len(evals))
    state = {"params": [p.detach() for p in worker.stage.parameters()],
             "buffers": [b.detach() for b in worker.stage.buffers()],
             "applied": [applied[i] for i in sorted(applied)],
             "eval": totals.result() if totals else None}
    torch.save(state, f"{out}/rank{world.rank}.pt")


if __name__ == "__main__":
    main()
