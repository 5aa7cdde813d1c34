"""Under mpirun, a rank that starts itself again with another allocator (before MPI starts) is
still the same rank of the same world: `mpirun -n 2 python -m petra_mpi.bench ... --allocator`."""
import pytest

from petra_mpi.perf import allocator
from tests.support.launch import mpirun
from tests.support.paths import ROOT

PROBE = r"""import sys
from petra_mpi.perf import allocator
allocator.use("jemalloc", sys.argv)
from mpi4py import MPI
comm = MPI.COMM_WORLD
ranks = comm.allgather(comm.Get_rank())
loaded = "jemalloc" in open("/proc/self/maps").read()
sys.stdout.write(f"rank {comm.Get_rank()} of {comm.Get_size()} {ranks} {loaded}\n")  # one write
sys.stdout.flush()
"""


@pytest.mark.extended
def test_ranks_started_again_under_jemalloc_form_the_same_world(tmp_path):
    try:
        allocator.library_path("jemalloc")
    except allocator.AllocatorError as e:
        pytest.skip(str(e))
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    proc = mpirun(2, [str(script)], timeout=120, env={"PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = sorted(line for line in proc.stdout.splitlines() if line.startswith("rank"))
    assert lines == ["rank 0 of 2 [0, 1] True", "rank 1 of 2 [0, 1] True"], proc.stdout
