"""Under `mpirun -n N`: R = N / J data-parallel replicas of a J-stage pipeline (J = 1 by default)
against one pipeline alone (replica 0's ranks, no gradient averaging), alternated in one run
with a third layout: R pipelines at once, each alone (no averaging). Reports images/s of each,
the efficiency images/s / (R x single), the ceiling the machine itself allows (independent / (R x
single): what sharing memory bandwidth, caches and clocks costs with no communication at all),
and the fraction of wall time the ranks spent finishing their all-reduces."""
import argparse
import os
import statistics
import sys
import time

import torch

from ...core.planner import plan_layout
from ...engines.build import StageSpec, build_engine, build_stages, build_workers
from ...models import NetSpec
from ...comm.world import World
from .common import emit, sleeping_barrier


def idle_barrier(world):
    """A barrier that sleeps instead of spinning: ranks that sit out the single-pipeline timing
    must not take CPU from the ranks being timed (Open MPI's blocking waits busy-poll)."""
    sleeping_barrier(world, 0.002)


def main(argv):
    a = parse_args(argv)
    result = run(a)
    if result is not None:  # rank 0 reports
        report(a, result)


def parse_args(argv):
    p = argparse.ArgumentParser(prog="mpirun -n N python -m petra_mpi.bench replicas",
                                description=__doc__)
    p.add_argument("--arch", default="revnet18")
    p.add_argument("--width", type=int, default=16)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--stages", type=int, default=1, help="J: stages per replica (divides N)")
    p.add_argument("--accumulation", type=int, default=1, help="k: micro-batches per step")
    p.add_argument("--microbatches", type=int, default=16, help="per replica per timed segment")
    p.add_argument("--rounds", type=int, default=5, help="alternated rounds of each layout")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    return p.parse_args(argv)


class Layouts:
    """This rank's engines in the three layouts, and timed segments of each."""

    def __init__(self, a, world):
        self.world = world
        # A replica's ranks alone, as a world of their own (no replicas): replica 0's alone is
        # the single pipeline; all of them at once are the independent layout.
        alone = world.pipeline()
        self.engines = {"replicas": self._engine(a, world), "independent": self._engine(a, alone)}
        if world.replica == 0:
            self.engines["single"] = self.engines["independent"]
        g = torch.Generator().manual_seed(world.replica)
        self.data = [(torch.randn(a.batch, 3, 32, 32, generator=g),
                      torch.randint(0, 10, (a.batch,), generator=g)) for _ in range(4)]

    @staticmethod
    def _engine(a, w):
        net = NetSpec(a.arch, a.width, 10)
        (stage,) = build_stages(StageSpec(net), plan_layout(net, a.stages), only=w.stage)
        workers = build_workers([stage], accumulation=a.accumulation)
        return build_engine(workers, "petra", w, (3, 32, 32), a.batch)

    def time(self, name, n):
        """Seconds for n micro-batches per replica, fill and drain included."""
        data = self.data
        idle_barrier(self.world)
        if name not in self.engines:  # sitting out the single pipeline
            idle_barrier(self.world)
            return None
        e = self.engines[name]
        batches = (data[i % len(data)] for i in range(n)) if self.world.stage == 0 else None
        # independent pipelines end when the last one does: time them across the whole world
        sync = self.world if name == "independent" else e.world
        sync.barrier()
        start = time.perf_counter()
        e.train_segment(batches, n)
        sync.barrier()
        seconds = time.perf_counter() - start
        idle_barrier(self.world)
        return seconds


def run(a):
    """Alternate the three layouts; the JSON figures on rank 0, None elsewhere."""
    world = World.from_environment()
    if world is None or world.size % a.stages or world.size == a.stages:
        raise SystemExit(f"run under mpirun with a multiple of --stages ({a.stages}) ranks, at "
                         f"least two replicas")
    torch.set_num_threads(a.threads)
    J = a.stages
    world.split(J)
    R = world.replicas
    layouts = Layouts(a, world)
    for name in ("single", "replicas", "independent"):  # warm-up
        layouts.time(name, J + 2)
    reducer = layouts.engines["replicas"].w.reducer
    times = {"single": [], "replicas": [], "independent": []}
    waited = 0.0
    for _ in range(a.rounds):
        for name in times:
            before = reducer.waited
            times[name].append(layouts.time(name, a.microbatches))
            if name == "replicas":
                waited += reducer.waited - before
    wait_fraction = world.gather(waited / sum(times["replicas"]))
    if world.rank != 0:
        return None
    images = a.microbatches * a.batch
    single = images / statistics.median(times["single"])
    replicas = R * images / statistics.median(times["replicas"])
    independent = R * images / statistics.median(times["independent"])
    return {"bench": "replicas", "replicas": R, "stages": J, "images_per_s": replicas,
            "single_images_per_s": single, "efficiency": replicas / (R * single),
            "independent_images_per_s": independent, "ceiling": independent / (R * single),
            "arch": a.arch, "width": a.width, "batch": a.batch, "accumulation": a.accumulation,
            "threads": a.threads, "allreduce_wait_fraction": wait_fraction,
            # other work on the machine skews the comparison: say how much
            "load_average": os.getloadavg()[0], "cpus": os.cpu_count()}


def report(a, r: dict):
    R, J = r["replicas"], r["stages"]
    print(f"{a.arch} width {a.width}, batch {a.batch}, k {a.accumulation}, {R} replicas x {J} "
          f"stages, {a.threads} thread(s) per rank, {a.microbatches} micro-batches per replica "
          f"per segment, median of {a.rounds} alternated rounds")
    print(f"{'layout':<22} {'images/s':>9}")
    print(f"{f'1 pipeline ({J} ranks)':<22} {r['single_images_per_s']:>9.1f}")
    print(f"{f'{R} replicas ({R * J} ranks)':<22} {r['images_per_s']:>9.1f}")
    print(f"{f'{R} pipelines, alone':<22} {r['independent_images_per_s']:>9.1f}")
    print(f"efficiency images/s / ({R} x single): {r['efficiency']:.3f}; the machine's ceiling "
          f"({R} pipelines alone at once / ({R} x single)): {r['ceiling']:.3f}; fraction of time "
          f"finishing all-reduces per rank: "
          f"{' '.join(f'{f:.3f}' for f in r['allreduce_wait_fraction'])}; load average "
          f"{r['load_average']:.2f} on {r['cpus']} CPUs")
    sys.stdout.flush()
    emit(r)
