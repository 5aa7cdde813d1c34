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

from ..engine.build import build_stages, build_workers
from ..mpi.engine import MPIEngine
from ..mpi.world import World
from ..optim import LRSchedule
from .common import emit


def idle_barrier(comm):
    """A barrier that sleeps instead of spinning: ranks that sit out the single-pipeline timing
    must not take CPU from the ranks being timed (Open MPI's blocking waits busy-poll)."""
    request = comm.Ibarrier()
    while not request.Test():
        time.sleep(0.002)


def main(argv):
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
    a = p.parse_args(argv)
    world = World.from_environment()
    if world is None or world.size % a.stages or world.size == a.stages:
        raise SystemExit(f"run under mpirun with a multiple of --stages ({a.stages}) ranks, at "
                         f"least two replicas")
    torch.set_num_threads(a.threads)
    J = a.stages
    world.split(J)
    R, comm = world.replicas, world.comm
    # A replica's ranks alone, as a world of their own (no replicas): replica 0's alone is the
    # single pipeline; all of them at once are the independent layout.
    alone = World(world.pipe)

    def engine(w):
        (stage,) = build_stages(a.arch, a.width, 10, J, seed=0, only=w.stage,
                                model_kw=None, image_size=32)
        (worker,) = build_workers([stage], LRSchedule(0.01, 10**6), a.accumulation)
        return MPIEngine(worker, "petra", w, torch.float32, (3, 32, 32), a.batch)

    engines = {"replicas": engine(world), "independent": engine(alone)}
    if world.replica == 0:
        engines["single"] = engines["independent"]
    g = torch.Generator().manual_seed(world.replica)
    data = [(torch.randn(a.batch, 3, 32, 32, generator=g),
             torch.randint(0, 10, (a.batch,), generator=g)) for _ in range(4)]

    def segment(name, n):
        """Seconds for n micro-batches per replica, fill and drain included."""
        idle_barrier(comm)
        if name not in engines:  # sitting out the single pipeline
            idle_barrier(comm)
            return None
        e = engines[name]
        batches = (data[i % len(data)] for i in range(n)) if world.stage == 0 else None
        # independent pipelines end when the last one does: time them across the whole world
        sync = comm if name == "independent" else e.world.comm
        sync.Barrier()
        start = time.perf_counter()
        e.train_segment(batches, n)
        sync.Barrier()
        seconds = time.perf_counter() - start
        idle_barrier(comm)
        return seconds

    for name in ("single", "replicas", "independent"):  # warm-up
        segment(name, J + 2)
    reducer = engines["replicas"].w.reducer
    times = {"single": [], "replicas": [], "independent": []}
    waited = 0.0
    for _ in range(a.rounds):
        for name in times:
            before = reducer.waited
            times[name].append(segment(name, a.microbatches))
            if name == "replicas":
                waited += reducer.waited - before
    wait_fraction = comm.gather(waited / sum(times["replicas"]), root=0)
    if world.rank != 0:
        return
    images = a.microbatches * a.batch
    single = images / statistics.median(times["single"])
    replicas = R * images / statistics.median(times["replicas"])
    independent = R * images / statistics.median(times["independent"])
    efficiency, ceiling = replicas / (R * single), independent / (R * single)
    print(f"{a.arch} width {a.width}, batch {a.batch}, k {a.accumulation}, {R} replicas x {J} "
          f"stages, {a.threads} thread(s) per rank, {a.microbatches} micro-batches per replica "
          f"per segment, median of {a.rounds} alternated rounds")
    print(f"{'layout':<22} {'images/s':>9}")
    print(f"{f'1 pipeline ({J} ranks)':<22} {single:>9.1f}")
    print(f"{f'{R} replicas ({R * J} ranks)':<22} {replicas:>9.1f}")
    print(f"{f'{R} pipelines, alone':<22} {independent:>9.1f}")
    load = os.getloadavg()[0]  # other work on the machine skews the comparison: say how much
    print(f"efficiency images/s / ({R} x single): {efficiency:.3f}; the machine's ceiling "
          f"({R} pipelines alone at once / ({R} x single)): {ceiling:.3f}; fraction of time finishing "
          f"all-reduces per rank: {' '.join(f'{f:.3f}' for f in wait_fraction)}; load average "
          f"{load:.2f} on {os.cpu_count()} CPUs")
    sys.stdout.flush()
    emit({"bench": "replicas", "replicas": R, "stages": J, "images_per_s": replicas,
          "single_images_per_s": single, "efficiency": efficiency,
          "independent_images_per_s": independent, "ceiling": ceiling, "arch": a.arch,
          "width": a.width, "batch": a.batch, "accumulation": a.accumulation,
          "threads": a.threads, "allreduce_wait_fraction": wait_fraction, "load_average": load,
          "cpus": os.cpu_count()})
