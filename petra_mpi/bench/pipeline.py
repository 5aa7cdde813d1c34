"""Under `mpirun -n J`: the same model, batch and ranks trained with PETRA and with backprop
(model parallelism, one stage busy at a time), alternated in one run. Reports images/s of each,
the speed-up, and per rank the fraction of wall time spent waiting on MPI and the compute-only
time per tick next to the wall time per tick. `--device cuda`: every rank on its GPU, bound as
training binds it (ranks share the GPUs when there are fewer GPUs than ranks: under MPS, J ranks
on one GPU emulate J smaller GPUs and time the real GPU transport)."""
import argparse
import statistics
import sys
import time

import torch

from ..devices import bind_early, bound_cuda_device, rank_map, synchronize
from ..engine.build import build_stages, build_workers
from ..mpi.engine import MPIEngine
from ..mpi.world import World
from ..models import PRECISIONS, num_blocks
from ..optim import LRSchedule
from ..schedule import num_ticks
from .. import trace
from .common import emit


def split_for(a, world, device):
    """Blocks per stage: given (--partition), measured on rank 0 and shared (as training does by
    default), or the estimate."""
    if a.partition:
        return [int(n) for n in a.partition.split(",")]
    if a.balance == "estimate" or world.size == num_blocks(a.arch):  # one block per stage
        return None
    sizes = None
    if world.rank == 0:
        from ..blockcost import measured_partition
        sizes, costs = measured_partition(a.arch, a.width, 10, world.size, (3, 32, 32), a.batch,
                                          device=device, precision=a.precision)
        print(f"measured split {sizes}: ms per micro-batch per stage "
              f"{[round(1e3 * c) for c in costs.stage_seconds(sizes)]}", flush=True)
    return world.comm.bcast(sizes, root=0)


def main(argv):
    a = parse_args(argv)
    result = run(a)
    if result is not None:  # rank 0 reports
        report(a, result)


def parse_args(argv):
    p = argparse.ArgumentParser(prog="mpirun -n J python -m petra_mpi.bench pipeline",
                                description=__doc__)
    p.add_argument("--arch", default="revnet18")
    p.add_argument("--width", type=int, default=32)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--microbatches", type=int, default=24, help="per timed segment")
    p.add_argument("--rounds", type=int, default=3, help="alternated rounds of each method")
    p.add_argument("--threads", type=int, default=0, help="torch threads per rank (0: share)")
    p.add_argument("--balance", choices=("measure", "estimate"), default="measure",
                   help="how the stages are balanced (as model.balance)")
    p.add_argument("--partition", metavar="N,N,...",
                   help="blocks per stage, instead of balancing (to compare splits)")
    p.add_argument("--no-poll", action="store_true",
                   help="do not poll MPI between blocks (to measure what polling gives)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--precision", choices=tuple(PRECISIONS), default="fp32",
                   help="as run.precision: bf16 autocast inside the blocks")
    p.add_argument("--trace", metavar="FILE",
                   help="write the Chrome-trace timeline of the last timed PETRA segment")
    return p.parse_args(argv)


def start_world(a):
    """The MPI world and this rank's device, bound as training binds it."""
    if a.device == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("--device cuda: no CUDA device is visible")
        bind_early("cuda")  # before MPI starts, as training does
    world = World.from_environment()
    if world is None:
        raise SystemExit("run under mpirun with at least 2 ranks")
    torch.set_num_threads(a.threads or world.thread_share())
    device = torch.device("cpu")
    if a.device == "cuda":
        device = bound_cuda_device(world.local_rank)
        table = rank_map(world, device)
        if table:
            print(table, flush=True)
    return world, device


class Segments:
    """This rank's stage under both methods, and timed segments of either."""

    def __init__(self, a, world, device):
        self.a, self.world, self.device = a, world, device
        sizes = split_for(a, world, device)
        self.stages = build_stages(a.arch, a.width, 10, world.size, seed=0, only=world.rank,
                                   partition=sizes, device=device, precision=a.precision)
        (self.worker,) = build_workers(self.stages, LRSchedule(0.01, 10**6))
        self.engines = {m: MPIEngine(self.worker, m, world, torch.float32, (3, 32, 32), a.batch)
                        for m in ("petra", "backprop")}
        g = torch.Generator().manual_seed(0)
        self.data = [(torch.randn(a.batch, 3, 32, 32, generator=g).to(device),
                      torch.randint(0, 10, (a.batch,), generator=g).to(device))
                     for _ in range(4)]

    def time(self, method, n, traced=False):
        """(wall, MPI wait, compute) seconds of one segment of n micro-batches."""
        a, world, worker, data = self.a, self.world, self.worker, self.data
        batches = (data[i % len(data)] for i in range(n)) if world.rank == 0 else None
        engine = self.engines[method]
        if a.no_poll:
            engine.transport.boxes = []  # poll() then does nothing
        if traced:  # this segment only: the other ones keep the untraced NULL_TRACER
            (worker.tracer,) = trace.start(True, world, [world.rank],
                                           next(worker.stage.parameters()).device)
            worker.tracer.wrap_boxes(engine)
        synchronize(self.device)
        world.comm.Barrier()
        start, waited, computed = (time.perf_counter(), engine.wait_seconds(),
                                   engine.compute_seconds)
        engine.train_segment(batches, n)
        synchronize(self.device)  # the segment ends when this rank's GPU work has
        world.comm.Barrier()
        result = (time.perf_counter() - start, engine.wait_seconds() - waited,
                  engine.compute_seconds - computed)
        if traced:
            trace.unwrap_boxes(engine)
            trace.finish([worker.tracer], world, a.trace,
                         {"bench": "pipeline", "arch": a.arch, "width": a.width, "batch": a.batch,
                          "method": method, "microbatches": n})
            worker.tracer = trace.NULL_TRACER
        return result


def run(a):
    """Alternate timed segments of both methods; the JSON figures on rank 0, None elsewhere."""
    world, device = start_world(a)
    comm, J = world.comm, world.size
    segments = Segments(a, world, device)
    for m in segments.engines:  # warm-up
        segments.time(m, J + 2)
    results = {m: [] for m in segments.engines}
    for r in range(a.rounds):
        for m in segments.engines:
            traced = bool(a.trace) and m == "petra" and r == a.rounds - 1
            results[m].append(segments.time(m, a.microbatches, traced))
    rows = {}
    for m, runs in results.items():
        wall = statistics.median(r[0] for r in runs)
        ticks = num_ticks(m, J, a.microbatches) * len(runs)
        total = sum(r[0] for r in runs)
        rows[m] = {"images_per_s": a.microbatches * a.batch / wall,
                   "wait_fraction": comm.gather(sum(r[1] for r in runs) / total, root=0),
                   "compute_ms_per_tick": comm.gather(1e3 * sum(r[2] for r in runs) / ticks,
                                                      root=0),
                   "wall_ms_per_tick": 1e3 * total / ticks}
    if world.rank != 0:
        return None
    return {"bench": "pipeline", "arch": a.arch, "width": a.width, "batch": a.batch,
            "ranks": J, "device": str(device), "precision": a.precision,
            "transport": segments.engines["petra"].transport.mode,
            "split": segments.stages[0].partition, "poll": not a.no_poll,
            "petra_images_per_s": rows["petra"]["images_per_s"],
            "backprop_images_per_s": rows["backprop"]["images_per_s"],
            "speedup": rows["petra"]["images_per_s"] / rows["backprop"]["images_per_s"],
            **{f"{m}_{k}": rows[m][k] for m in rows
               for k in ("wait_fraction", "compute_ms_per_tick", "wall_ms_per_tick")}}


def report(a, r: dict):
    device = torch.device(r["device"])
    where = (f"{torch.cuda.get_device_name(device)}, {a.precision}" if device.type == "cuda"
             else f"{torch.get_num_threads()} threads")
    print(f"{a.arch} width {a.width}, batch {a.batch}, {r['ranks']} ranks x {where}, "
          f"split {r['split']}, {a.microbatches} micro-batches per segment (fill "
          f"and drain included), median of {a.rounds} alternated rounds"
          + (", no polling" if a.no_poll else ""))
    print(f"{'method':<10} {'images/s':>9} {'wall ms/tick':>13}  per rank: MPI wait fraction "
          f"| compute ms/tick")
    for m in ("petra", "backprop"):
        fr = " ".join(f"{f:.2f}" for f in r[f"{m}_wait_fraction"])
        ct = " ".join(f"{c:.0f}" for c in r[f"{m}_compute_ms_per_tick"])
        print(f"{m:<10} {r[f'{m}_images_per_s']:>9.1f} {r[f'{m}_wall_ms_per_tick']:>13.0f}  "
              f"{fr} | {ct}")
    print(f"speed-up PETRA / backprop: {r['speedup']:.2f} (ideal {r['ranks']}.0)")
    sys.stdout.flush()
    emit(r)
