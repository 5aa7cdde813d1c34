"""The hang watchdog on its own (petra_mpi/run/watchdog.py), with a fake rank: no MPI."""
import io
import signal
import subprocess
import sys
import threading
import time

from tests.support.paths import ROOT

from petra_mpi.run.watchdog import AUTO_FLOOR_S, AUTO_TICKS, EXIT_STALLED, Watchdog, auto_limit


class FakeRank:
    def __init__(self):
        self.exited = threading.Event()
        self.status = None
        self.out = io.StringIO()

    def exit(self, status):
        self.status = status
        self.exited.set()

    @staticmethod
    def pending():
        return [(True, "receive", "gradient", "rank 4 (n3)", 2),
                (False, "send", "activation", "rank 4 (n3)", 1)]


def test_a_silent_rank_reports_its_last_action_and_what_it_waits_for():
    rank = FakeRank()
    dog = Watchdog(0.3, "rank 3 (n2, stage 3)", rank.pending, out=rank.out, exit=rank.exit)
    dog.beat(17, "backward", 9)
    assert rank.exited.wait(30), "the watchdog never fired"
    dog.close()
    assert rank.status == EXIT_STALLED
    head, *rest = rank.out.getvalue().splitlines()
    assert head.startswith("petra_mpi: watchdog: rank 3 (n2, stage 3): no progress for 0.3 s")
    assert "after tick 17, backward of micro-batch 9" in head
    assert "waiting on the receive of gradient from rank 4 (n3)" in head
    assert rest == ["  waiting: receive gradient from rank 4 (n3) (2 in flight)",
                    "  pending: send activation to rank 4 (n3) (1 in flight)"]


def test_an_idle_rank_is_not_a_stalled_one():
    """Between the loops (a checkpoint, the end) no beats come, and none are expected."""
    rank = FakeRank()
    dog = Watchdog(0.2, "rank 0", rank.pending, out=rank.out, exit=rank.exit)
    dog.beat(0, "forward", 0)
    dog.idle()
    assert not rank.exited.wait(1.0)  # five limits of silence, idle
    dog.close()
    assert rank.out.getvalue() == ""


def test_auto_limit_follows_the_slowest_gap():
    rank = FakeRank()
    dog = Watchdog(None, "rank 0", rank.pending, out=rank.out, exit=rank.exit)
    assert dog.limit() == AUTO_FLOOR_S  # nothing measured yet
    dog.beat(0, "forward", 0)
    dog.last = (dog.last[0] - 30.0, *dog.last[1:])  # as if the next action came 30 s later
    dog.beat(1, "forward", 1)
    assert dog.limit() >= AUTO_TICKS * 30.0 == auto_limit(30.0)
    dog.idle()
    dog.close()


def test_a_collective_is_watched_with_its_grace_and_named_in_the_report():
    rank = FakeRank()
    dog = Watchdog(0.2, "rank 2 (n1, stage 2)", rank.pending, out=rank.out, exit=rank.exit)
    with dog.collective("checkpoint", grace_s=1.0):
        assert not rank.exited.wait(0.6)  # past the limit, within the grace
        assert rank.exited.wait(30), "the watchdog never fired"
    dog.close()
    assert rank.status == EXIT_STALLED
    assert rank.out.getvalue() == (
        "petra_mpi: watchdog: rank 2 (n1, stage 2): no progress for 1.2 s (run.watchdog_s + "
        "checkpoint grace) in the checkpoint, a collective of every rank: a rank or its node is "
        f"lost or stalled; exit status {EXIT_STALLED}\n")


def test_after_a_collective_the_rank_is_idle_and_its_length_is_no_gap():
    rank = FakeRank()
    dog = Watchdog(None, "rank 0", rank.pending, out=rank.out, exit=rank.exit)
    dog.beat(0, "forward", 0)
    with dog.collective("stop vote"):
        dog.last = (dog.last[0] - 500.0, *dog.last[1:])  # as if the vote had taken 500 s
    assert not dog.armed
    dog.beat(1, "forward", 1)
    assert dog.limit() == AUTO_FLOOR_S  # the vote's 500 s did not count as a gap
    dog.close()
    assert rank.out.getvalue() == ""


def test_a_steps_grace_lasts_until_the_next_agreement():
    """A rank that does not evaluate itself waits for replica 0's evaluation in the next stop
    vote: the step's grace covers that wait, and the vote completing ends it."""
    rank = FakeRank()
    dog = Watchdog(0.2, "rank 1 (n1, stage 0)", rank.pending, out=rank.out, exit=rank.exit)
    dog.allow("evaluation", 1.0)
    with dog.collective("stop vote"):
        assert not rank.exited.wait(0.6)  # past the limit, within the grace
    assert dog.grace == 0  # agreed: every rank is past the evaluation
    with dog.collective("stop vote"):
        assert rank.exited.wait(30), "the watchdog never fired"
    dog.close()
    assert rank.out.getvalue() == (
        "petra_mpi: watchdog: rank 1 (n1, stage 0): no progress for 0.2 s (run.watchdog_s) in "
        f"the stop vote, a collective of every rank: a rank or its node is lost or stalled; exit "
        f"status {EXIT_STALLED}\n")


def test_a_process_stopped_and_continued_restarts_its_beat():
    """A child process beats between pieces of work under a 1 s watchdog; stopped (SIGSTOP, as
    SLURM suspends a job) for 3 s and continued, it goes on and ends by itself with status 0.
    The work (hashing, which releases Python's lock as a computation or an MPI wait does) is
    most likely under way when the process is continued, so the watch loop runs before the
    next beat."""
    program = ("import hashlib\n"
               "from petra_mpi.run.watchdog import Watchdog\n"
               "dog = Watchdog(1.0, 'rank 0', lambda: [])\n"
               "blob = bytes(16 << 20)\n"
               "for i in range(60):\n"
               "    dog.beat(i, 'forward', i)\n"
               "    print(i, flush=True)\n"
               "    hashlib.sha256(blob).digest()\n")
    proc = subprocess.Popen([sys.executable, "-c", program], cwd=ROOT, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout.readline().strip() == "0"  # beating
    proc.send_signal(signal.SIGSTOP)
    time.sleep(3.0)  # the suspension: three times the limit
    proc.send_signal(signal.SIGCONT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0 and err == "", err
    assert out.split()[-1] == "59"
