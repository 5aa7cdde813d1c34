"""The hang watchdog in a real MPI run: one rank stalls, every rank reports and the job ends with
the watchdog's exit status instead of hanging."""
import glob
import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from tests.support.launch import mpirun
from tests.support.paths import PROGRAMS, QUICK, ROOT
from petra_mpi.run.watchdog import EXIT_STALLED, diagnose, read_rank_map, read_reports


# What mpirun passes on: EXIT_STALLED, or, when a rank's exit made it kill the others before they
# exited themselves, the SIGKILL's status of one of those (a race among ranks that stalled within
# the same second). Each rank's report carries EXIT_STALLED; the batch scripts read the reports.
ENDED_BY_WATCHDOG = (EXIT_STALLED, 9)


def stalled_run(fault, microbatch, tmp_path, transport="mpi"):
    """3 ranks of the quick start, rank 1 stalled (tests/programs/faulty_train.py), watchdog 3 s,
    messages over comm.transport `transport`: the finished process and its output."""
    proc = mpirun(3, [PROGRAMS / "faulty_train.py", fault, 1, microbatch,
                      "configs/quickstart.yaml", "--set", f"run.out_dir={tmp_path}",
                      "--set", "run.watchdog_s=3", "--set", f"comm.transport={transport}",
                      *QUICK], timeout=120)
    return proc, proc.stdout + proc.stderr


@pytest.mark.parametrize("transport", ["mpi", pytest.param("torch", marks=pytest.mark.extended)])
def test_a_stalled_rank_ends_the_job_and_every_rank_reports(tmp_path, transport):
    """Rank 1's forward of micro-batch 5 sleeps for an hour; with run.watchdog_s=3 each rank
    prints its last action and pending messages: rank 1 that its own work stalled, ranks 0 and 2
    that they wait on rank 1. The job ends (ENDED_BY_WATCHDOG) instead of hanging, over either
    transport."""
    proc, out = stalled_run("stall", 5, tmp_path, transport)
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
    # read back as the batch scripts do: the chain ends at rank 1, on its host in the rank map
    hosts = read_rank_map(out)
    waits, named = read_reports(out)
    assert sorted(hosts) == [0, 1, 2], out[-3000:]
    assert diagnose(waits, {**hosts, **named}, len(hosts)) == (
        [hosts[1]], f"rank 1 on {hosts[1]} stalled in its own work (it was not waiting on MPI)")


@pytest.mark.extended  # an MPI run each: the default selection has the stalls above
def test_a_rank_stuck_at_the_end_of_the_run_ends_the_job(tmp_path):
    """The writing rank (1) never gets through writing the summary (a stalled file system): the
    end of the run is watched as every collective is, so both ranks report and the job ends
    (ENDED_BY_WATCHDOG) instead of holding its nodes until the time limit. (The program gives
    the end no grace beyond run.watchdog_s=3.)"""
    proc = mpirun(2, [PROGRAMS / "faulty_train.py", "stall-end", 1, 0,
                      "configs/quickstart.yaml", "--set", f"run.out_dir={tmp_path}",
                      "--set", "run.watchdog_s=3", *QUICK], timeout=120)
    out = proc.stdout + proc.stderr
    assert proc.returncode in ENDED_BY_WATCHDOG, out[-3000:]
    heads = dict(re.findall(r"petra_mpi: watchdog: rank (\d) \(\S+, stage \d\): (.*)", out))
    assert sorted(heads) == ["0", "1"], out[-3000:]
    assert all("in the end of the run, a collective of every rank" in h for h in heads.values())


@pytest.mark.extended
def test_the_summary_is_written_before_any_rank_leaves(tmp_path):
    """The writing rank (1) writes summary.json 2 s late: no rank may exit before it is written
    (srun ends the others a minute after the first one leaves, and may end the writer with
    them)."""
    proc = mpirun(2, [PROGRAMS / "faulty_train.py", "late-summary", 1, 0,
                      "configs/quickstart.yaml", "--set", f"run.out_dir={tmp_path}", *QUICK],
                  timeout=120)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    assert [(tmp_path / f"summary_at_exit.{r}").read_text() for r in (0, 1)] == ["True"] * 2


# extended: the default selection covers the watchdog's stall report with the stalled rank above
@pytest.mark.extended
def test_a_rank_lost_before_a_stop_vote_ends_the_job(tmp_path):
    """Rank 1 never votes at the end of the first segment (it sleeps in the vote): ranks 0 and
    2 wait inside that collective, where no neighbour can be named. Every rank's watchdog says
    so, and that every rank's heartbeat goes on (rank 1's process lives: it stalled), and the
    job ends (ENDED_BY_WATCHDOG) instead of hanging."""
    proc, out = stalled_run("stall-vote", 0, tmp_path)
    assert proc.returncode in ENDED_BY_WATCHDOG, out[-3000:]
    heads = dict(re.findall(r"petra_mpi: watchdog: rank (\d) \(\S+, stage \d\): (.*)", out))
    assert sorted(heads) == ["0", "1", "2"], out[-3000:]
    for head in heads.values():
        assert head == (f"no progress for 3 s (run.watchdog_s) in the stop vote, a collective of "
                        f"every rank: every rank's heartbeat goes on: a rank is stalled, or cut "
                        f"off from the others; exit status {EXIT_STALLED}"), head
    assert sorted(os.listdir(tmp_path / "logs" / "heartbeats")) == ["rank-0", "rank-1", "rank-2"]


# ------------------------------------------------------------------ waits the watchdog allows for

@pytest.mark.extended  # a stalled rank is the default selection's watchdog test
def test_replicas_wait_for_replica_0s_evaluation_within_its_grace(tmp_path):
    """Two replicas of one stage: replica 0 evaluates 200 batches in one piece while replica 1,
    which does not evaluate, waits for it in the next stop vote, far longer than
    run.watchdog_s=2 (a training action takes a few hundredths of that), but within the
    evaluation's grace. The run finishes."""
    proc = mpirun(2, ["-m", "petra_mpi.train", "configs/quickstart.yaml", "--set",
                      f"run.out_dir={tmp_path}", *QUICK, "--set", "train.limit_batches=4",
                      "--set", "model.stages=1", "--set", "train.replicas=2", "--set",
                      "data.synthetic_val=12800", "--set", "model.width=8", "--set",
                      "model.balance=estimate", "--set", "run.threads=1", "--set",
                      "run.watchdog_s=2"], timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "watchdog" not in out, out[-3000:]
    evals = [r for r in map(json.loads, (tmp_path / "metrics.jsonl").read_text().splitlines())
             if r["event"] == "eval"]
    assert len(evals) == 1


def launch(n, args, **kw):
    """mpirun, its stdout and stderr together."""
    cmd = ["mpirun", "-n", str(n), sys.executable, *map(str, args)]
    return subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            **kw)


def signal_job(pid, sig):
    """Send sig to the process `pid` and to every process below it (mpirun, its proxy and the
    ranks, each of which Hydra starts in a session of its own), as SLURM signals every process
    of a job."""
    children = {}
    for stat in glob.glob("/proc/[0-9]*/stat"):
        try:
            with open(stat) as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(stat.split("/")[2]))
    todo = [pid]
    while todo:
        p = todo.pop()
        todo += children.get(p, [])
        try:
            os.kill(p, sig)
        except ProcessLookupError:
            pass


def finish(proc, timeout):
    """(exit status, output) of a launch; the job is killed if it outlives timeout."""
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        signal_job(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        raise AssertionError(f"the job hung:\n{out[-3000:]}") from None
    return proc.returncode, out


# extended: tests/unit/test_watchdog.py stops and continues a watched process in the default
@pytest.mark.extended
def test_a_suspended_job_goes_on_when_resumed(tmp_path):
    """Every process of the job is stopped (SIGSTOP, as SLURM suspends a job) mid-training for
    three times run.watchdog_s, then continued: no watchdog fires and the run finishes."""
    metrics = tmp_path / "metrics.jsonl"
    proc = launch(2, ["-m", "petra_mpi.train", "configs/quickstart.yaml", "--set",
                      f"run.out_dir={tmp_path}", *QUICK, "--set", "train.limit_batches=28",
                      "--set", "data.synthetic_train=4096", "--set", "run.log_every=1",
                      "--set", "model.balance=estimate", "--set", "run.threads=1",
                      "--set", "run.watchdog_s=2"])
    try:
        # past the start-up: micro-batch 20 at least has been trained (k = 2)
        while proc.poll() is None and not any(
                r["event"] == "train" and r["step"] >= 10
                for r in map(json.loads, metrics.read_text().splitlines()
                             if metrics.exists() else [])):
            time.sleep(0.1)
        signal_job(proc.pid, signal.SIGSTOP)
        time.sleep(6.0)  # the suspension: three times run.watchdog_s
        signal_job(proc.pid, signal.SIGCONT)
    finally:
        status, out = finish(proc, timeout=300)
    assert status == 0 and "watchdog" not in out, out[-3000:]
    assert any(json.loads(r)["event"] == "eval" for r in metrics.read_text().splitlines())


START_UP = ["configs/quickstart.yaml", *QUICK, "--set", "data.synthetic_train=256", "--set",
            "data.synthetic_val=64", "--set", "model.balance=estimate", "--set", "run.threads=1"]


def test_a_rank_stuck_in_mpis_start_ends_the_job(tmp_path):
    """Rank 1 stops as it starts MPI: rank 0 hangs in MPI's start (holding Python's interpreter
    lock, so no thread of it could report). The start-up watchers report and the job ends with
    the watchdog's status instead of hanging."""
    proc = launch(2, [PROGRAMS / "stop_at_startup.py", "mpi", 1, *START_UP, "--set",
                      f"run.out_dir={tmp_path}", "--set", "run.startup_s=3"])
    status, out = finish(proc, timeout=120)
    assert status in ENDED_BY_WATCHDOG, out[-3000:]
    reports = re.findall(r"^petra_mpi: watchdog: rank (\d) \(\S+\): (.*)$", out, re.M)
    assert reports and all(
        line == f"no progress for 3 s (run.startup_s) in the start-up, at: starting MPI; exit "
                f"status {EXIT_STALLED}" for _, line in reports), out[-3000:]


@pytest.mark.extended
def test_a_rank_stopped_before_its_first_tick_ends_the_job(tmp_path):
    """Rank 1 stops just before it trains: rank 0 waits for it in its first ticks, where the
    watchdog does not watch yet (a neighbour may still be loading a checkpoint or warming up).
    The start-up deadline ends the job; the reports name the step. (run.startup_s=30: every
    earlier step of the start-up must fit in it on a crowded machine.)"""
    proc = launch(2, [PROGRAMS / "stop_at_startup.py", "first-tick", 1, *START_UP, "--set",
                      f"run.out_dir={tmp_path}", "--set", "run.startup_s=30"])
    status, out = finish(proc, timeout=240)
    assert status in ENDED_BY_WATCHDOG, out[-3000:]
    reports = re.findall(r"^petra_mpi: watchdog: rank (\d) \(\S+\): (.*)$", out, re.M)
    assert "0" in dict(reports), out[-3000:]
    assert all(line == f"no progress for 30 s (run.startup_s) in the start-up, at: training the "
                       f"first micro-batch; exit status {EXIT_STALLED}" for _, line in reports)
