"""The MPI engine's stop vote, driven deterministically: one rank is asked to stop at a fixed
tick of a segment long enough for votes to happen (every STOP_CHECK_TICKS ticks, while two checks
remain). The segment must end early, identically on every rank, and leave exactly the
parameters of an uninterrupted local run of the length it returned (bitwise, on CPU)."""
import pytest
import torch

from petra_mpi.engines.build import build_workers
from tests.support.nets import stages_of
from petra_mpi.engines.local import LocalEngine
from petra_mpi.core.optim import LRSchedule
from petra_mpi.core.schedule import num_ticks
from petra_mpi.engines.stopping import STOP_CHECK_TICKS
from tests.support.launch import mpirun
from tests.support.paths import PROGRAMS
from equivalence import batches  # the data the MPI script trains on

J, N = 3, 40


def local_run(n):
    """An uninterrupted segment of n micro-batches in one process: the MPI run stopped mid-segment
    must equal it for the length it returned (test_stop_engines_agree.py compares the stopped
    runs of both engines)."""
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    try:
        stages = stages_of("revnet18", 4, 10, J, seed=0)
        workers = build_workers(stages, LRSchedule(0.3, 4, warmup_epochs=1, milestones=(2,)), 2,
                                weight_decay=5e-4)
        assert LocalEngine(workers, "petra").train_segment(batches(n), n) == n
    finally:
        torch.use_deterministic_algorithms(False)
    return [list(s.parameters()) + list(s.buffers()) for s in stages]


def mpi_run(tmp_path, stop_rank, stop_tick):
    proc = mpirun(J, [PROGRAMS / "stop_vote.py", tmp_path, stop_rank, stop_tick, N],
                  timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [torch.load(tmp_path / f"rank{r}.pt") for r in range(J)]


def same(mpi_states, local_stages):
    return all(torch.equal(g, w.detach()) for st, ws in zip(mpi_states, local_stages)
               for g, w in zip(st["params"] + st["buffers"], ws))


# Votes are posted at ticks 0, 8, 16, 24 (t + 2 * STOP_CHECK_TICKS < 44 ticks) and read one
# check later; a request is seen by the first vote posted after it.
assert num_ticks("petra", J, N) == 44 and STOP_CHECK_TICKS == 8


# expected length: the flag is raised during tick T (after that tick's check), the next vote
# (first multiple of 8 above T) carries it, its result is read one check later at tick t, and the
# segment becomes what entered by t plus the receives already posted (RECEIVE_DEPTH + 1):
# T=10 -> vote 16, read 24 -> 27; T=5 -> 8, 16 -> 19; T=20 -> 24, 32 -> 35.
@pytest.mark.parametrize("stop_rank,stop_tick,expected", [
    (0, 10, 27),
    pytest.param(1, 5, 19, marks=pytest.mark.extended),
    pytest.param(2, 20, 35, marks=pytest.mark.extended),
])
def test_stop_on_one_rank_mid_segment_shortens_it_everywhere(tmp_path, stop_rank, stop_tick,
                                                             expected):
    states = mpi_run(tmp_path, stop_rank, stop_tick)
    trained = {s["trained"] for s in states}
    assert len(trained) == 1, f"ranks disagree on the segment length: {trained}"
    (m,) = trained
    assert stop_tick - stop_rank < m < N, m  # shortened, but what entered before the stop trained
    assert m == expected
    assert all(s["any_stop"] for s in states)
    want = local_run(m)
    assert same(states, want), "MPI run differs from a local run of the length it returned"
    if stop_rank == 0:  # the bitwise comparison has teeth: one micro-batch less is detected
        assert not same(states, local_run(m - 1))


@pytest.mark.extended
def test_stop_after_the_last_vote_trains_the_whole_segment(tmp_path):
    """A request after the last vote (tick 24 here) does not shorten the segment; the drain-point
    check still sees it on every rank."""
    states = mpi_run(tmp_path, 0, 30)
    assert [s["trained"] for s in states] == [N] * J
    assert all(s["any_stop"] for s in states)
    assert same(states, local_run(N))
