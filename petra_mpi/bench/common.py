"""Shared helpers of the benchmarks."""
import json
import statistics
import time


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def alternate(fns: dict, repeats: int) -> dict:
    """Time each function `repeats` times, interleaved (A B A B ...) so that machine noise hits
    every contender alike; returns the median seconds of each."""
    times = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            times[name].append(timed(fn))
    return {name: statistics.median(t) for name, t in times.items()}


def emit(record: dict):
    """The contract: the very last line of a benchmark is one JSON object."""
    print(json.dumps(record), flush=True)
