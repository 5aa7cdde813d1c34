"""The same stop request in both engines leaves the same state: under mpirun one rank is asked to
stop at a chosen tick (no signal, no timing), and the MPI engine's segment length and every
stage's weights, batch-norm statistics, momentum and step count after the drain must equal those
of the single-process engine given the same request (bitwise, on CPU); each rank also writes a
checkpoint, which it refuses while gradients wait for a step."""
import pytest
import torch

from tests.support.launch import mpirun
from tests.support.paths import PROGRAMS
from stop_anywhere import run_local

# METHOD:K:N:STAGE:TICK, chosen so that the stop shortens the segment (a stop that the last
# vote misses leaves a full segment, which the unit tests cover): backprop, and PETRA and the
# delayed method with a short last accumulation group.
RUNS = ["backprop:3:8:1:6", "petra:3:21:2:3", "delayed:2:21:0:2"]


def check_same_as_local(out_dir, J, run):
    method, k, n, stage, tick = run.split(":")
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    try:
        trained, local = run_local(method, J, int(k), int(n), int(stage), int(tick))
    finally:
        torch.use_deterministic_algorithms(False)
    ranks = [torch.load(out_dir / run / f"rank{r}.pt") for r in range(J)]
    assert [r["trained"] for r in ranks] == [trained] * J, run
    assert trained < int(n), f"{run}: the stop did not shorten the segment"
    for s, (got, want) in enumerate(zip(ranks, local)):
        assert got["pending"] == want["pending"] == 0
        assert got["steps"] == want["steps"], (run, s)
        for key in ("params", "buffers", "momentum"):
            assert len(got[key]) == len(want[key]) > 0
            assert all(torch.equal(a, b) for a, b in zip(got[key], want[key])), (run, s, key)
        assert (out_dir / run / "checkpoint" / f"stage{s}.pt").exists()


@pytest.mark.extended  # the stop vote under mpirun is tests/mpi/test_stop.py's default test
def test_a_stop_leaves_the_state_of_the_single_process_engine(tmp_path):
    proc = mpirun(3, [PROGRAMS / "stop_anywhere.py", tmp_path, *RUNS], timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for run in RUNS:
        check_same_as_local(tmp_path, 3, run)


@pytest.mark.extended
@pytest.mark.parametrize("J,runs", [(1, ["petra:3:25:0:1", "backprop:2:25:0:5"]),
                                    (2, ["backprop:2:10:0:3", "petra:3:23:1:5"])])
def test_one_and_two_stages(tmp_path, J, runs):
    proc = mpirun(J, [PROGRAMS / "stop_anywhere.py", tmp_path, *runs], timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for run in runs:
        check_same_as_local(tmp_path, J, run)
