"""Shared helpers of the benchmarks."""
import json
import statistics
import time

POLL_SLEEP_S = 0.0005


def timed(fn, sync=None) -> float:
    """Seconds fn() takes; `sync` (e.g. torch.cuda.synchronize) waits for queued device work
    before the clock starts and before it stops."""
    if sync:
        sync()
    start = time.perf_counter()
    fn()
    if sync:
        sync()
    return time.perf_counter() - start


def alternate(fns: dict, repeats: int, sync=None) -> dict:
    """Time each function `repeats` times, interleaved (A B A B ...) so that machine noise hits
    every contender alike; returns the median seconds of each."""
    times = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            times[name].append(timed(fn, sync))
    return {name: statistics.median(t) for name, t in times.items()}


def emit(record: dict):
    """The contract: the very last line of a benchmark is one JSON object."""
    print(json.dumps(record), flush=True)


def sleeping_barrier(comm, poll_sleep=POLL_SLEEP_S):
    """A barrier that sleeps while it waits: MPI's Barrier spins a core per waiting rank (MPICH),
    which on a machine with fewer cores than ranks slows the ranks still working."""
    request = comm.Ibarrier()
    while not request.Test():
        time.sleep(poll_sleep)
