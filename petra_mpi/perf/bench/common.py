"""Shared helpers of the benchmarks."""
import json
import os
import platform
import resource
import statistics
import time

import numpy as np
import torch

from .. import allocator
from .. import model as perfmodel

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


def random_batch(n, num_classes, g, context=0, image_shape=(3, 32, 32)):
    """(inputs, labels) of n random samples: windows of `context` token ids with a label per
    token (a language model), else images of `image_shape` with a label each."""
    if context:
        x = torch.randint(0, num_classes, (n, context), generator=g)
        return x, torch.randint(0, num_classes, (n * context,), generator=g)
    return (torch.randn(n, *image_shape, generator=g),
            torch.randint(0, num_classes, (n,), generator=g))


def emit(record: dict):
    """The contract: the very last line of a benchmark is one JSON object (with the C allocator
    it ran under)."""
    print(json.dumps({**record, "allocator": allocator.current()}), flush=True)


def sleeping_barrier(world, poll_sleep=POLL_SLEEP_S):
    """A barrier that sleeps while it waits: MPI's Barrier spins a core per waiting rank (MPICH),
    which on a machine with fewer cores than ranks slows the ranks still working."""
    world.barrier(poll_sleep)


def measure_link(world, nbytes, repeats=20, poll_sleep=0.0) -> perfmodel.Link:
    """Latency and bandwidth between ranks 0 and 1 from ping-pong round trips (half of each);
    poll_sleep > 0: every wait sleeps between tests (the emulation's ranks leave their cores)."""
    def half_round_trip(size):
        buf = np.zeros(max(1, size), dtype=np.uint8)
        times = []
        for _ in range(repeats):
            sleeping_barrier(world, poll_sleep)
            start = time.perf_counter()
            if world.rank == 0:
                world.send_bytes(buf, 1, poll_sleep)
                world.receive_bytes(buf, 1, poll_sleep)
            elif world.rank == 1:
                world.receive_bytes(buf, 0, poll_sleep)
                world.send_bytes(buf, 0, poll_sleep)
            times.append((time.perf_counter() - start) / 2)
        return statistics.median(times)

    small, large = half_round_trip(8), half_round_trip(nbytes)
    link = perfmodel.Link(small, nbytes / max(large - small, 1e-9))
    return world.bcast(link)


def last_json_line(path) -> dict:
    """The figures of a benchmark run saved to `path`: its last line that is a JSON object (a
    saved log may have lines after it, such as the shell's timing)."""
    with open(path) as f:
        lines = f.read().splitlines()
    for line in reversed(lines):
        if line.startswith("{"):
            try:
                return json.loads(line)
            except json.JSONDecodeError:
                continue
    raise ValueError(f"{path}: no line of JSON figures (is it a benchmark's output?)")


def process_memory_bytes() -> tuple:
    """(peak, now) of this process's resident memory, as the kernel counts it (VmHWM and VmRSS:
    everything the process touched, the allocator's cached pages, communication buffers,
    gradients, optimizer state and libraries included); without /proc, the peak from getrusage
    for both."""
    try:
        with open("/proc/self/status") as f:
            fields = dict(line.split(":", 1) for line in f if ":" in line)
        return tuple(int(fields[k].split()[0]) * 1024 for k in ("VmHWM", "VmRSS"))
    except (OSError, KeyError, ValueError):
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        return peak, peak


def machine() -> dict:
    """What a benchmark ran on: the CPU, its cores, the memory, the load when it was asked, and
    the software (the allocator is added by `emit`)."""
    cpu, memory = platform.processor() or platform.machine(), None
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f
                        if line.startswith("model name")), cpu)
        with open("/proc/meminfo") as f:
            memory = int(f.readline().split()[1]) * 1024  # MemTotal, kB
    except OSError:
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "memory_bytes": memory,
            "load_average": list(os.getloadavg()), "torch": torch.__version__,
            "python": platform.python_version()}


def save_figure(fig, path, dpi=120) -> str:
    """Lay out a matplotlib figure, write it to `path` (its folder made), close it; the path."""
    import matplotlib.pyplot as plt
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    return path
