"""Under `mpirun -n J`: the same model, batch and ranks trained with PETRA and with backprop
(model parallelism, one stage busy at a time), alternated in one run. Reports images/s of each,
the speed-up, and per rank the fraction of wall time spent waiting on MPI, the compute-only
time per tick next to the wall time per tick, and the bytes sent per tick (compressed as
`--compress` says, e.g. `--compress forward=int8,gradient=bf16`). `--device cuda`: every rank on
its GPU, bound as training binds it (ranks share the GPUs when there are fewer GPUs than ranks:
under MPS, J ranks on one GPU emulate J smaller GPUs and time the real GPU transport)."""
import argparse
import statistics
import sys
import time

import torch

from ...comm.compress import DIRECTIONS, Codec, Compression
from ...comm.devices import bind_early, bound_cuda_device, rank_map, synchronize
from ...engines.build import StageSpec, build_engine, build_stages, build_workers
from ...comm.world import World
from ...models import PRECISIONS, NetSpec
from ...core.planner import Layout, plan_layout
from ..model import speedup_bound
from ...core.schedule import num_ticks
from ...core import trace
from .common import emit, sleeping_barrier


def split_for(a, world, device):
    """(blocks per stage, the measured per-block costs on rank 0 or None elsewhere). The split is
    given (--partition), balanced by the measured costs (as training does by default), or the
    estimate; the costs are measured in every case, for the speed-up bound of the split."""
    given = [int(n) for n in a.partition.split(",")] if a.partition else None
    sizes = costs = None
    if world.rank == 0:
        from ...core.blockcost import measure_net_costs
        net = NetSpec(a.arch, a.width, 10, precision=a.precision)
        costs = measure_net_costs(net, a.batch, device=device)
        estimated = given or a.balance == "estimate"
        sizes = plan_layout(net, world.size, partition=given,
                            costs=None if estimated else costs).split
        print(f"split {sizes}: measured ms per micro-batch per stage "
              f"{[round(1e3 * c) for c in costs.stage_seconds(sizes)]}", flush=True)
    sleeping_barrier(world)  # a rank spinning in Bcast would slow rank 0's timing
    return world.bcast(sizes), costs


def scaled_to(costs, sizes, stage_seconds):
    """The per-block costs with each stage's blocks scaled so that the stage costs
    `stage_seconds[s]` per micro-batch (its middle-stage or last-stage work, as stage_seconds)."""
    from ...core.blockcost import BlockCosts
    scale = []
    for n, have, want in zip(sizes, costs.stage_seconds(sizes), stage_seconds):
        scale += [want / have if have > 0 else 1.0] * n
    forward, backward, last, step, kept = ([c * f for c, f in zip(field, scale)]
                                           for field in (costs.forward, costs.backward,
                                                         costs.last, costs.step, costs.kept))
    return BlockCosts(forward, backward, last, step, costs.output_bytes, costs.input_bytes, kept)


def main(argv):
    a = parse_args(argv)
    report(a, run(a))


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
    p.add_argument("--compress", metavar="DIRECTION=FORMAT,...", default="",
                   help=f"compress messages and buffers as comm.* does; directions "
                        f"{', '.join(DIRECTIONS)}, or `stochastic` alone for stochastic rounding")
    p.add_argument("--trace", metavar="FILE",
                   help="write the Chrome-trace timeline of the last timed PETRA segment")
    return p.parse_args(argv)


class PipelineBench:
    """This rank's stage, one engine per method and the data: times segments of either."""

    def __init__(self, a):
        self.a = a
        self.compression = parse_compression(a.compress)
        if a.device == "cuda":
            if not torch.cuda.is_available():
                raise SystemExit("--device cuda: no CUDA device is visible")
            bind_early("cuda")  # before MPI starts, as training does
        world = self.world = World.from_environment()
        if world is None:
            raise SystemExit("run under mpirun with at least 2 ranks")
        torch.set_num_threads(a.threads or world.thread_share())
        self.device = torch.device("cpu")
        if a.device == "cuda":
            self.device = bound_cuda_device(world.local_rank)
            table = rank_map(world, self.device)
            if table:
                print(table, flush=True)
        sizes, self.costs = split_for(a, world, self.device)
        net = NetSpec(a.arch, a.width, 10, precision=a.precision)
        stages = build_stages(StageSpec(net, device=self.device, compression=self.compression),
                              Layout(sizes), only=world.rank)
        self.split = stages[0].partition
        workers = build_workers(stages)
        self.worker = workers[0]
        self.engines = {m: build_engine(workers, m, world, (3, 32, 32), a.batch,
                                        compression=self.compression,
                                        poll_between_blocks=not a.no_poll)
                        for m in ("petra", "backprop")}
        g = torch.Generator().manual_seed(0)
        self.data = [(torch.randn(a.batch, 3, 32, 32, generator=g).to(self.device),
                      torch.randint(0, 10, (a.batch,), generator=g).to(self.device))
                     for _ in range(4)]

    def segment(self, method, n, traced=False):
        """(wall, MPI wait, compute seconds, bytes sent) of one segment of n micro-batches."""
        a, world, engine = self.a, self.world, self.engines[method]
        batches = (self.data[i % len(self.data)] for i in range(n)) if world.rank == 0 else None
        if traced:  # this segment only: the other ones keep the untraced NULL_TRACER
            (tracer,) = trace.start(True, world, [world.rank],
                                    next(self.worker.stage.parameters()).device)
            self.worker.trace_with(tracer)
        synchronize(self.device)
        world.barrier()
        start, waited, computed, sent = (time.perf_counter(), engine.wait_seconds(),
                                         engine.compute_seconds, engine.sent_bytes())
        engine.train_segment(batches, n)
        synchronize(self.device)  # the segment ends when this rank's GPU work has
        world.barrier()
        result = (time.perf_counter() - start, engine.wait_seconds() - waited,
                  engine.compute_seconds - computed, engine.sent_bytes() - sent)
        if traced:
            trace.finish([tracer], world, a.trace,
                         {"bench": "pipeline", "arch": a.arch, "width": a.width, "batch": a.batch,
                          "method": method, "microbatches": n})
            self.worker.trace_with(trace.NULL_TRACER)
        return result

    def measure(self) -> dict:
        """The warm-up, then a.rounds alternated segments of each method: their results."""
        a = self.a
        for m in self.engines:  # warm-up
            self.segment(m, self.world.size + 2)
        results = {m: [] for m in self.engines}
        for r in range(a.rounds):
            for m in self.engines:
                traced = bool(a.trace) and m == "petra" and r == a.rounds - 1
                results[m].append(self.segment(m, a.microbatches, traced))
        return results

    def rows(self, results) -> dict:
        """Per method: images/s, wall ms per tick, and per rank (gathered on rank 0) the MPI
        wait fraction, the compute ms per tick and the bytes sent per tick."""
        a, world, J = self.a, self.world, self.world.size
        rows = {}
        for m, runs in results.items():
            wall = statistics.median(r[0] for r in runs)
            ticks = num_ticks(m, J, a.microbatches) * len(runs)
            total = sum(r[0] for r in runs)
            rows[m] = {"images_per_s": a.microbatches * a.batch / wall,
                       "wait_fraction": world.gather(sum(r[1] for r in runs) / total),
                       "compute_ms_per_tick": world.gather(1e3 * sum(r[2] for r in runs) / ticks),
                       "wall_ms_per_tick": 1e3 * total / ticks,
                       "sent_bytes_per_tick": world.gather(sum(r[3] for r in runs) / ticks)}
        return rows


def run(a):
    """Time both methods on every rank; the JSON record on rank 0, None elsewhere."""
    bench = PipelineBench(a)
    results = bench.measure()
    rows = bench.rows(results)
    # each rank's compute per micro-batch in PETRA's own runs (both ranks busy at once, under the
    # load the runs saw): the stage costs of the bound, beside those timed at start-up
    in_run = {m: bench.world.gather(
        sum(r[2] for r in results[m]) / (a.microbatches * len(results[m]))) for m in results}
    if bench.world.rank != 0:
        return None
    return record(a, bench, rows, in_run)


def record(a, bench, rows, in_run) -> dict:
    """The JSON record: the rates, the speed-up and the bounds the split allows."""
    speedup = rows["petra"]["images_per_s"] / rows["backprop"]["images_per_s"]
    # What the split allows: the stages' work over the slowest stage's, with fill and drain
    # for segments of this length (the model; the link taken as free).
    costs, split, compression = bench.costs, bench.split, bench.compression
    timed_bound = speedup_bound(costs, split, a.microbatches)
    bound = speedup_bound(scaled_to(costs, split, in_run["petra"]), split, a.microbatches)
    alone = speedup_bound(scaled_to(costs, split, in_run["backprop"]), split, a.microbatches)
    # where ranks share cores, PETRA's stages (all busy at once) compute slower than
    # backprop's (one at a time): this ratio says by how much
    contention = sum(in_run["petra"]) / sum(in_run["backprop"])
    return {"bench": "pipeline", "arch": a.arch, "width": a.width, "batch": a.batch,
            "ranks": bench.world.size, "device": str(bench.device), "precision": a.precision,
            "transport": bench.engines["petra"].transport.mode,
            "split": split, "poll": not a.no_poll,
            "compression": {d: getattr(compression, d) for d in DIRECTIONS}
            | {"stochastic": compression.stochastic},
            "petra_images_per_s": rows["petra"]["images_per_s"],
            "backprop_images_per_s": rows["backprop"]["images_per_s"], "speedup": speedup,
            "speedup_bound": bound["segment"], "speedup_bound_steady": bound["steady"],
            "of_bound": speedup / bound["segment"],
            "speedup_bound_timed_costs": timed_bound["segment"],
            "speedup_bound_backprop_costs": alone["segment"],
            "stage_seconds_in_run": in_run, "petra_over_backprop_compute": contention,
            "microbatches": a.microbatches, "rounds": a.rounds,
            "block_costs": costs.to_dict(),  # timed at start-up: the performance model's input
            **{f"{m}_{k}": rows[m][k] for m in rows
               for k in ("wait_fraction", "compute_ms_per_tick", "wall_ms_per_tick",
                         "sent_bytes_per_tick")}}


def report(a, r):
    """The table on rank 0, then the JSON line (nothing on the other ranks)."""
    if r is None:
        return
    J = r["ranks"]
    where = (f"{torch.cuda.get_device_name(r['device'])}, {a.precision}"
             if r["device"].startswith("cuda") else f"{torch.get_num_threads()} threads")
    print(f"{a.arch} width {a.width}, batch {a.batch}, {J} ranks x {where}, "
          f"split {r['split']}, {a.microbatches} micro-batches per segment (fill "
          f"and drain included), median of {a.rounds} alternated rounds"
          + (", no polling" if a.no_poll else "") + f", {parse_compression(a.compress).describe()}")
    print(f"{'method':<10} {'images/s':>9} {'wall ms/tick':>13}  per rank: MPI wait fraction "
          f"| compute ms/tick | kB sent/tick")
    for m in ("petra", "backprop"):
        fr = " ".join(f"{f:.2f}" for f in r[f"{m}_wait_fraction"])
        ct = " ".join(f"{c:.0f}" for c in r[f"{m}_compute_ms_per_tick"])
        kb = " ".join(f"{b / 1e3:.0f}" for b in r[f"{m}_sent_bytes_per_tick"])
        print(f"{m:<10} {r[f'{m}_images_per_s']:>9.1f} {r[f'{m}_wall_ms_per_tick']:>13.0f}  "
              f"{fr} | {ct} | {kb}")
    print(f"speed-up PETRA / backprop: {r['speedup']:.2f}; the split allows "
          f"{r['speedup_bound']:.2f} for segments of {a.microbatches} "
          f"({r['speedup_bound_steady']:.2f} "
          f"for endless ones) with the stage costs of the PETRA runs, "
          f"{r['speedup_bound_backprop_costs']:.2f} with those of the backprop runs, "
          f"{r['speedup_bound_timed_costs']:.2f} with those timed at start-up: "
          f"{r['of_bound']:.2f} of its bound (ideal {J}.0); PETRA's stages "
          f"computed {r['petra_over_backprop_compute']:.2f}x as long per micro-batch as "
          f"backprop's")
    sys.stdout.flush()
    emit(r)


def parse_compression(text: str) -> Compression:
    """`forward=int8,gradient=bf16,stochastic` -> a Compression (run seed 0)."""
    formats, stochastic = {}, False
    for item in filter(None, text.split(",")):
        if item == "stochastic":
            stochastic = True
            continue
        direction, _, fmt = item.partition("=")
        if direction not in DIRECTIONS:
            raise SystemExit(f"--compress {item}: direction must be one of {', '.join(DIRECTIONS)}")
        formats[direction] = fmt
    try:
        compression = Compression(**formats, stochastic=stochastic)
        for d in DIRECTIONS:
            Codec(getattr(compression, d))  # raises on an unknown format
    except ValueError as e:
        raise SystemExit(f"--compress: {e}")
    return compression
