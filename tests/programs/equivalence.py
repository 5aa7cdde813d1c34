"""Run under mpirun: train a few micro-batches with the MPI engine and save each rank's stage,
for several runs in one launch (each launch pays the imports on every rank once).

Usage: mpirun -n J python tests/programs/equivalence.py OUT_DIR N RUN [RUN ...]
RUN is METHOD:K[:FLAG...], K the accumulation, or uN: N images per update (train.update_batch) in
the micro-batches of 4 below, k as a config derives it (accumulation_of); FLAG one of buffer, stash
(the delayed method's switches), short_eval (evaluation ends with a batch of 2), revvit (the tiny
reversible ViT below instead of RevNet18), irevnet (the fully invertible irevnet18 instead of
RevNet18), own (the network of one's own of tests/support/own_nets.py, by its import path: its
package must be on PYTHONPATH), bf16 (the blocks compute in bf16), compress (COMPRESSED below on every message and
buffer), compensate (COMPENSATED below: every delay compensation on), adamw (AdamW instead of SGD),
rebuild_last (model.rebuild_last_stage: the last stage holds no graph), torch (the messages over
torch.distributed, comm.transport torch, instead of MPI). Run RUN writes OUT_DIR/RUN/rank{r}.pt.
"""
import os
import sys
from pathlib import Path

import torch

from petra_mpi.config import load_config
from petra_mpi.comm.compress import NO_COMPRESSION, Compression
from petra_mpi.core.compensation import NO_COMPENSATION, DelayCompensation
from petra_mpi.core.planner import plan_layout
from petra_mpi.engines.build import StageSpec, build_stages, build_workers
from petra_mpi.models import NetSpec
from petra_mpi.engines.mpi import MPIEngine
from petra_mpi.comm.world import World
from petra_mpi.core.optim import LRSchedule


BATCH = 4  # samples per micro-batch of every run


def accumulation_of(k: str) -> int:
    """k of a RUN's K: the number itself, or for uN the k the quick start's config derives from
    train.update_batch N with data.batch_size BATCH (its own train.accumulation gives way)."""
    if not k.startswith("u"):
        return int(k)
    config = Path(__file__).resolve().parents[2] / "configs" / "quickstart.yaml"
    cfg = load_config(config, [f"data.batch_size={BATCH}", f"train.update_batch={k[1:]}"])
    return cfg.train.accumulation


def batches(n, batch=BATCH, size=16, seed=1):
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


def arch_of(flags) -> str:
    """The CNN a run's flags name: RevNet18, irevnet18 or the network of one's own."""
    if "own" in flags:
        from tests.support.own_nets import PICTURES
        return PICTURES
    return "irevnet18" if "irevnet" in flags else "revnet18"


# The tiny revvit of the invariant-3 test in tests/mpi/test_mpi.py (flag "revvit"): 16x16 images,
# 4x4 patches.
REVVIT = dict(width=8, image_size=16, model_kw=dict(depth=4, heads=2, patch=4))


# Flag "compress": every format on some direction, stochastic rounding on (so the random streams
# of both engines must match too).
COMPRESSED = Compression(forward="int8_channel", rebuilt="bf16", gradient="int8", buffers="fp16",
                         stochastic=True, seed=5)


# Flag "compensate": every delay compensation at once (weight prediction, spike, momentum and
# learning rate by delay, the last stage's free momentum), so each must follow the same steps in
# both engines.
COMPENSATED = DelayCompensation(momentum=1.0, prediction=1.0, spike=True, lr_steps=3,
                                free_momentum=0.0)


def optimizer_settings(method, flags) -> dict:
    """build_workers' optimizer keywords for a run's flags (the local reference uses them too)."""
    return dict(method=method, optimizer="adamw" if "adamw" in flags else "sgd",
                compensation=COMPENSATED if "compensate" in flags else NO_COMPENSATION)


def train_and_save(world, out, method, k, n, flags):
    compression = COMPRESSED if "compress" in flags else NO_COMPRESSION
    precision = "bf16" if "bf16" in flags else "fp32"
    if "revvit" in flags:
        net = NetSpec("revvit", REVVIT["width"], 10, image_size=REVVIT["image_size"],
                      model_kw=REVVIT["model_kw"], precision=precision)
    else:
        net = NetSpec(arch_of(flags), 4, 10, precision=precision)
    spec = StageSpec(net, buffer_inputs="buffer" in flags, stash_weights="stash" in flags,
                     rebuild_last_stage="rebuild_last" in flags, compression=compression)
    stages = build_stages(spec, plan_layout(net, world.size), only=world.rank)
    (worker,) = build_workers(stages, LRSchedule(0.3, 4, warmup_epochs=1, milestones=(2,)), k,
                              weight_decay=5e-4, **optimizer_settings(method, flags))
    engine = MPIEngine(worker, method, world, torch.float32, (3, 16, 16), BATCH, compression)
    data = batches(n) if world.rank == 0 else None
    engine.train_segment(data, n)
    engine.train_segment(batches(n, seed=2) if world.rank == 0 else None, n)  # a second segment
    short = "short_eval" in flags
    totals = engine.evaluate(eval_batches(short) if world.rank == 0 else None, 3 + short)
    state = {"params": [p.detach() for p in worker.stage.parameters()],
             "buffers": [b.detach() for b in worker.stage.buffers()],
             "peak_fifo_bytes": worker.stage.peak_fifo_bytes,
             "eval": totals.result() if totals else None}
    os.makedirs(out, exist_ok=True)
    torch.save(state, os.path.join(out, f"rank{world.rank}.pt"))


def main():
    out, n, runs = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    worlds = {}  # comm.transport -> the world over it, started when a run first asks for it
    for run in runs:
        method, k, *flags = run.split(":")
        transport = "torch" if "torch" in flags else "mpi"
        if transport not in worlds:
            worlds[transport] = World.from_environment(transport)
        train_and_save(worlds[transport], os.path.join(out, run), method, accumulation_of(k), n,
                       flags)


if __name__ == "__main__":
    main()
