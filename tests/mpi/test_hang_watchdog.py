"""The hang watchdog in a real MPI run: one rank stalls, every rank reports and the job ends with
the watchdog's exit status instead of hanging."""
import re

from conftest import PROGRAMS, QUICK, mpirun
from petra_mpi.watchdog import EXIT_STALLED


# What mpirun passes on: EXIT_STALLED, or, when a rank's exit made it kill the others before they
# exited themselves, the SIGKILL's status of one of those (a race among ranks that stalled within
# the same second). Each rank's report carries EXIT_STALLED; the batch scripts read the reports.
ENDED_BY_WATCHDOG = (EXIT_STALLED, 9)


def stalled_run(fault, microbatch, tmp_path):
    """3 ranks of the quick start, rank 1 stalled (tests/programs/faulty_train.py), watchdog 3 s:
    the finished process and its output."""
    proc = mpirun(3, [PROGRAMS / "faulty_train.py", fault, 1, microbatch,
                      "configs/quickstart.yaml", "--set", f"run.out_dir={tmp_path}",
                      "--set", "run.watchdog_s=3", *QUICK], timeout=120)
    return proc, proc.stdout + proc.stderr


def test_a_stalled_rank_ends_the_job_and_every_rank_reports(tmp_path):
    """Rank 1's forward of micro-batch 5 sleeps for an hour; with run.watchdog_s=3 each rank
    prints its last action and pending messages: rank 1 that its own work stalled, ranks 0 and 2
    that they wait on rank 1. The job ends (ENDED_BY_WATCHDOG) instead of hanging."""
    proc, out = stalled_run("stall", 5, tmp_path)
    assert proc.returncode in ENDED_BY_WATCHDOG, out[-3000:]
    heads = dict(re.findall(r"petra_mpi: watchdog: rank (\d) \(\S+, stage \d\): (.*)", out))
    assert sorted(heads) == ["0", "1", "2"], out[-3000:]
    assert "forward of micro-batch 5; not waiting on MPI: this rank's own work stalled" in \
        heads["1"]
    for r in ("0", "2"):
        assert re.search(r"waiting on the (receive|send) of [a-z ]+ (from|to) rank 1 ",
                         heads[r]), heads[r]
        assert heads[r].endswith(f"exit status {EXIT_STALLED}")
    assert "  waiting: receive activation from rank 1" in out  # rank 2's pending list


def test_a_rank_lost_before_a_stop_vote_ends_the_job(tmp_path):
    """Rank 1 never votes at the end of the first segment (it sleeps in the vote): ranks 0 and
    2 wait inside that collective, where no neighbour can be named. Every rank's watchdog says
    so, and the job ends (ENDED_BY_WATCHDOG) instead of hanging."""
    proc, out = stalled_run("stall-vote", 0, tmp_path)
    assert proc.returncode in ENDED_BY_WATCHDOG, out[-3000:]
    heads = dict(re.findall(r"petra_mpi: watchdog: rank (\d) \(\S+, stage \d\): (.*)", out))
    assert sorted(heads) == ["0", "1", "2"], out[-3000:]
    for head in heads.values():
        assert head == (f"no progress for 3 s (run.watchdog_s) in the stop vote, a collective of "
                        f"every rank: a rank or its node is lost or stalled; exit status "
                        f"{EXIT_STALLED}"), head
