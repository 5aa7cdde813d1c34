"""Under `mpirun -n P` (or in one process, P = 1): measure the per-block costs and the
point-to-point link between the actual ranks, predict images/s of PETRA, reversible backprop
and 1F1B (plain ResNet of the same depth and width) for every stage count J from 1 to the number
of blocks with the performance model (petra_mpi/perf/model.py), validate the prediction against
runs of PETRA and backprop at every J from 1 to P, and print the predicted speed-up curve beside
the paper's Table 5 (and draw it as a PNG when matplotlib is there)."""
import argparse
import os
import statistics
import sys
import time

import torch

from .. import model as perfmodel
from ...core.blockcost import measure_autograd_costs, measure_block_costs
from ...engines.build import StageSpec, build_engine, build_stages, build_workers
from ..emulation import PAPER_TABLE5_MS
from ...comm.world import World
from ...models import ARCHS, NetSpec, build_blocks
from ...core.planner import Layout, plan_layout
from .common import emit, last_json_line, measure_link, sleeping_barrier

# Paper Table 5: mean time per micro-batch of 256 CIFAR-10 images, reversible backprop vs PETRA.
# the paper's Table 5: GPUs, the time of one step (emulation.PAPER_TABLE5_MS) and the speed-up
PAPER_TABLE5 = {arch: {"gpus": gpus, "backprop_ms": PAPER_TABLE5_MS[arch]["backprop"],
                       "petra_ms": PAPER_TABLE5_MS[arch]["petra"], "speedup": speedup}
                for arch, gpus, speedup in (("revnet18", 10, 3.0), ("revnet34", 18, 2.4))}


def measured_images_per_s(a, world, J, sizes, method, data):
    """images/s of a segment of a.microbatches on the first J ranks (J = 1: one process)."""
    rank = world.rank if world else 0
    sub = world.alone(range(J)) if J > 1 else None  # collective
    if J == 1:
        if rank != 0:
            return None
        stages = build_stages(StageSpec(NetSpec(a.arch, a.width, 10)), Layout(sizes))
        engine = build_engine(build_workers(stages), method, None, (3, 32, 32), a.batch)
    else:
        if rank >= J:
            return None
        stages = build_stages(StageSpec(NetSpec(a.arch, a.width, 10)), Layout(sizes), only=rank)
        engine = build_engine(build_workers(stages), method, sub, (3, 32, 32), a.batch)

    def segment(n):
        batches = (data[i % len(data)] for i in range(n)) if rank == 0 else None
        if J > 1:
            sub.barrier()
        start = time.perf_counter()
        engine.train_segment(batches, n)
        if J > 1:
            sub.barrier()
        return time.perf_counter() - start

    segment(J + 2)  # warm-up
    wall = statistics.median(segment(a.microbatches) for _ in range(a.rounds))
    return a.microbatches * a.batch / wall


def main(argv):
    a = parse_args(argv)
    report(a, run(a))


def parse_args(argv):
    p = argparse.ArgumentParser(prog="[mpirun -n P] python -m petra_mpi.bench scaling",
                                description=__doc__)
    p.add_argument("--arch", default="revnet18",
                   help="revnet18/34/50 or irevnet18/34/50 (1F1B runs the ResNet of the same "
                        "depth)")
    p.add_argument("--width", type=int, default=32)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--microbatches", type=int, default=24,
                   help="per PETRA/backprop segment (fill and drain included)")
    p.add_argument("--pt-microbatches", type=int, default=4,
                   help="micro-batches per 1F1B step (at least J), as bench peers' --accumulation")
    p.add_argument("--rounds", type=int, default=3, help="timed segments per measured point")
    p.add_argument("--threads", type=int, default=0, help="torch threads per rank (0: share)")
    p.add_argument("--png", default="runs/bench/scaling.png", help="'' to skip the figure")
    p.add_argument("--framework", metavar="JSON",
                   help="the frameworks' own costs per operation, message and step, from the "
                        "last line of a `bench emulate` run (else none)")
    a = p.parse_args(argv)
    a.plain_arch = plain_twin(a.arch)
    return a


def plain_twin(arch: str) -> str:
    """The non-reversible net 1F1B runs: the plain ResNet of the same depth and width, for a
    RevNet and a fully invertible RevNet alike (irevnetN has the block layout of revnetN)."""
    for prefix in ("irevnet", "revnet", "resnet"):
        depth = arch[len(prefix):]
        if arch.startswith(prefix) and "resnet" + depth in ARCHS:
            return "resnet" + depth
    raise SystemExit(f"bench scaling: --arch {arch} has no plain ResNet twin for 1F1B; "
                     f"use revnet18/34/50 or irevnet18/34/50")


def read_framework(path):
    """(ours, pipelining): the frameworks' costs from the last line of a `bench emulate` run."""
    if not path:
        return perfmodel.NO_FRAMEWORK, perfmodel.NO_FRAMEWORK
    fw = last_json_line(path)["framework"]
    return tuple(perfmodel.Framework.from_record(fw[k]) if k in fw else perfmodel.NO_FRAMEWORK
                 for k in ("ours", "pipelining"))


def run(a):
    """Measure, predict every J and validate at J = 1 .. P; the JSON record on rank 0, else
    None."""
    ours, pipelining = read_framework(a.framework)
    world = World.from_environment()
    P = world.size if world else 1
    rank = world.rank if world else 0
    torch.set_num_threads(a.threads or (world.thread_share() if world else 1))

    # 1. What each block costs, with this rank's threads (rank 0 measures, the others wait).
    blocks = build_blocks(a.arch, a.width, 10)
    plain = build_blocks(a.plain_arch, a.width, 10)
    costs = plain_costs = None
    if rank == 0:
        costs = measure_block_costs(blocks, (3, 32, 32), a.batch, 10)
        plain_costs = measure_autograd_costs(plain, (3, 32, 32), a.batch, 10)
    if world:
        sleeping_barrier(world)  # a rank spinning in Bcast would slow rank 0's timing
        costs, plain_costs = world.bcast((costs, plain_costs))
    # 2. The link between the actual ranks.
    link = (measure_link(world, max(costs.output_bytes)) if world
            else perfmodel.Link(0.0, float("inf")))
    # 3. Predictions for every J. 4. Validation at every J the ranks allow.
    predictions = [predict(a, costs, plain_costs, link, ours, pipelining, J)
                   for J in range(1, len(blocks) + 1)]
    validation = validate(a, world, min(P, len(blocks)), predictions)
    if rank != 0:
        return None
    return {"bench": "scaling", "arch": a.arch, "width": a.width, "batch": a.batch, "ranks": P,
            "threads": torch.get_num_threads(),
            "link": {"latency_s": link.latency, "bandwidth_bytes_per_s": link.bandwidth},
            "block_costs": costs.to_dict(), "predictions": predictions, "validation": validation,
            "framework": {"ours": vars(ours), "pipelining": vars(pipelining)},
            "paper_table5": PAPER_TABLE5}


def predict(a, costs, plain_costs, link, ours, pipelining, J) -> dict:
    """The predicted images/s of the three methods at J stages, with the split PETRA uses."""
    sizes = plan_layout(NetSpec(a.arch, a.width, 10), J, costs=costs).split
    sc = perfmodel.stage_costs(costs, sizes)
    plain_sizes = plan_layout(NetSpec(a.plain_arch, a.width, 10), J, costs=plain_costs).split
    pc = perfmodel.stage_costs(plain_costs, plain_sizes, rebuilt_down=[False] * J)
    row = {"ranks": J, "split": sizes,
           "petra": perfmodel.predict_images_per_s("petra", sc, link, a.microbatches, a.batch,
                                                   framework=ours),
           "backprop": perfmodel.predict_images_per_s("backprop", sc, link, a.microbatches,
                                                      a.batch, framework=ours),
           "1f1b": perfmodel.predict_images_per_s("1f1b", pc, link,
                                                  max(a.pt_microbatches, J), a.batch,
                                                  framework=pipelining)}
    row["speedup"] = row["petra"] / row["backprop"]
    return row


def validate(a, world, max_J, predictions) -> list:
    """Measured against predicted images/s at J = 1 .. max_J, alternating the two methods
    (every rank takes part; the rows are filled on rank 0 only)."""
    rank = world.rank if world else 0
    g = torch.Generator().manual_seed(0)
    data = [(torch.randn(a.batch, 3, 32, 32, generator=g),
             torch.randint(0, 10, (a.batch,), generator=g)) for _ in range(4)]
    validation = []
    for J in range(1, max_J + 1):
        for method in ("petra", "backprop"):
            measured = measured_images_per_s(a, world, J, predictions[J - 1]["split"], method, data)
            if world:  # the ranks beyond J wait without spinning a core the J ranks need
                sleeping_barrier(world)
            if rank == 0:
                predicted = predictions[J - 1][method]
                validation.append({"ranks": J, "method": method, "predicted": predicted,
                                   "measured": measured,
                                   "error": predicted / measured - 1})
    return validation


def report(a, r):
    """The tables and the figure on rank 0, then the JSON line (nothing on the other ranks)."""
    if r is None:
        return
    link, predictions, validation = r["link"], r["predictions"], r["validation"]
    print(f"{a.arch} width {a.width}, batch {a.batch}, {r['threads']} threads per "
          f"rank; link latency {1e6 * link['latency_s']:.1f} us, bandwidth "
          f"{link['bandwidth_bytes_per_s'] / 1e9:.2f} GB/s; PETRA/backprop segments of "
          f"{a.microbatches} micro-batches, 1F1B steps of max({a.pt_microbatches}, J)")
    print(f"{'J':>3} {'split':<32} {'petra':>8} {'backprop':>9} {'1f1b':>8} {'speed-up':>9}  "
          f"(predicted images/s)")
    for row in predictions:
        paper = [f"paper Table 5: {v['speedup']}x ({name}, {v['gpus']} GPUs)"
                 for name, v in PAPER_TABLE5.items() if v["gpus"] == row["ranks"]]
        print(f"{row['ranks']:>3} {str(row['split']):<32} {row['petra']:>8.1f} "
              f"{row['backprop']:>9.1f} {row['1f1b']:>8.1f} {row['speedup']:>8.2f}x  "
              f"{' '.join(paper)}")
    print(f"{'J':>3} {'method':<9} {'predicted':>10} {'measured':>9} {'error':>7}")
    for v in validation:
        print(f"{v['ranks']:>3} {v['method']:<9} {v['predicted']:>10.1f} {v['measured']:>9.1f} "
              f"{100 * v['error']:>+6.1f}%")
    if a.png:
        _plot(a, predictions, validation)
    sys.stdout.flush()
    emit(r)


def _plot(a, predictions, validation):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no figure", file=sys.stderr)
        return
    J = [r["ranks"] for r in predictions]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(J, [r["speedup"] for r in predictions], "o-", label="predicted PETRA / backprop")
    ax.plot(J, [r["1f1b"] / predictions[0]["1f1b"] for r in predictions], "s--",
            label="predicted 1F1B (ResNet) over 1 rank")
    measured = {}
    for v in validation:
        measured.setdefault(v["ranks"], {})[v["method"]] = v["measured"]
    mj = sorted(j for j, m in measured.items() if len(m) == 2)
    ax.plot(mj, [measured[j]["petra"] / measured[j]["backprop"] for j in mj], "k^",
            markersize=9, label="measured PETRA / backprop")
    for name, v in PAPER_TABLE5.items():
        ax.plot([v["gpus"]], [v["speedup"]], "r*", markersize=12)
        ax.annotate(f"paper {name}", (v["gpus"], v["speedup"]), textcoords="offset points",
                    xytext=(-40, 8))
    ax.plot(J, J, ":", color="grey", label="linear")
    ax.set_xlabel("stages J (ranks)")
    ax.set_ylabel("speed-up")
    ax.set_title(f"{a.arch} width {a.width}, batch {a.batch}")
    ax.legend(fontsize=8)
    os.makedirs(os.path.dirname(a.png) or ".", exist_ok=True)
    fig.tight_layout()
    fig.savefig(a.png, dpi=100)
    print(f"wrote {a.png}")
