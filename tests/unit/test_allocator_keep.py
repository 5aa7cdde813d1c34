"""allocator.keep_freed_memory (training's and the benchmarks' default, run.keep_freed_memory):
glibc keeps what it frees, so a tensor freed and allocated again is not faulted back in page by
page; never over an allocator chosen otherwise. Counted in page faults, not timed."""
import os
import subprocess
import sys

from tests.support.paths import ROOT

# a 40 MiB tensor allocated, written and freed, 10 times to settle, then 20 times counted: glibc's
# defaults map a block that large afresh every time (10,240 pages faulted in each); kept, the
# heap reuses the same memory
PROGRAM = """
import resource, sys
from petra_mpi.perf import allocator
kept = allocator.keep_freed_memory() if sys.argv[1] == "keep" else False
import torch
for _ in range(10):
    t = torch.empty(10 << 20).fill_(1.0)
    del t
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(20):
    t = torch.empty(10 << 20).fill_(1.0)
    del t
print(kept, allocator.current(), resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def run(mode, **env):
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")
              and k not in ("LD_PRELOAD", "PETRA_ALLOCATOR")}, **env}
    out = subprocess.run([sys.executable, "-c", PROGRAM, mode], capture_output=True, text=True,
                         cwd=ROOT, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    kept, name, faults = out.stdout.split()
    return kept == "True", name, int(faults)


def test_kept_memory_is_not_faulted_back_in():
    kept, name, faults = run("keep")
    assert (kept, name) == (True, "glibc-keep")
    assert faults < 1000  # 20 x 10,240 pages without it
    plain, name, plain_faults = run("plain")
    assert (plain, name) == (False, "glibc")
    assert plain_faults > 20 * 10240 * 0.9


def test_an_allocator_chosen_otherwise_is_left_alone():
    # `bench --allocator glibc` re-executes with this mark: plain glibc, as asked
    kept, _, faults = run("keep", PETRA_ALLOCATOR="glibc")
    assert not kept and faults > 20 * 10240 * 0.9
