"""Reading the watchdog reports back after a stalled run (petra_mpi/run/watchdog.py: read_reports,
diagnose, and `python -m petra_mpi.watchdog --diagnose`): which rank the chain of waits ends at,
and its host. The reports are written by the real Watchdog, so a change of their wording that the
reader no longer understands fails here."""
import io
import json
import os
import signal
import subprocess
import sys
import time

from tests.support.outputs import printed_rank_map
from tests.support.paths import ROOT
from petra_mpi.run.heartbeats import Heartbeats
from petra_mpi.run.watchdog import (NO_RANK_MAP, OWN_WORK, Watchdog, diagnose, read_reports,
                                     startup_report)

HOSTS = ["n1", "n1", "n2", "n2", "n3", "n3"]  # 6 ranks, 2 a node


def report(rank, waits_on=None, collective=None, heartbeats=None):
    """The report of `rank` as its watchdog writes it: waiting on the receive from rank
    `waits_on`, inside `collective` ("stop vote"), or (neither) in its own work; with the
    `heartbeats` of its run directory, if any."""
    out = io.StringIO()
    pending = [] if waits_on is None else [
        (True, "receive", "rebuilt input", f"rank {waits_on} ({HOSTS[waits_on]})", 1),
        (False, "send", "activation", f"rank {waits_on} ({HOSTS[waits_on]})", 1)]
    dog = Watchdog(3600, f"rank {rank} ({HOSTS[rank]}, stage {rank})", lambda: pending, out=out,
                   heartbeats=heartbeats)
    try:
        last = (0.0, None, collective, None) if collective else (0.0, 41, "backward", 33)
        dog._report(5.0, last)
    finally:
        dog.close()
    return out.getvalue()


def test_the_chain_of_waits_ends_at_the_rank_that_did_not_report():
    """Ranks 0-3 each wait on the next; rank 4's node (n3, ranks 4-5) is gone."""
    log = "".join(report(r, r + 1) for r in (2, 0, 3, 1))  # in any order
    waits, hosts = read_reports(log)
    assert waits == {0: 1, 1: 2, 2: 3, 3: 4}
    assert hosts == {0: "n1", 1: "n1", 2: "n2", 3: "n2", 4: "n3"}
    assert diagnose(waits, {**dict(enumerate(HOSTS)), **hosts}, 6) == (
        ["n3"], "rank 4 on n3 is lost or stalled: ranks 4–5 did not report")


def test_the_silent_ranks_named_are_those_of_the_lost_rank_host():
    """Only rank 3 reported before the launcher ended every rank: ranks 0-2 never got to
    report, but their host is alive; the ranks of rank 4's host are the ones that went silent."""
    waits, hosts = read_reports(report(3, 4))
    assert diagnose(waits, {**dict(enumerate(HOSTS)), **hosts}, 6) == (
        ["n3"], "rank 4 on n3 is lost or stalled: ranks 4–5 did not report")


def test_chains_from_both_sides_end_at_the_same_rank():
    """The stages before rank 2 wait on its activations, the ones after it on its gradients."""
    log = report(0, 1) + report(1, 2) + report(3, 2) + report(4, 3) + report(5, 4)
    waits, hosts = read_reports(log)
    assert diagnose(waits, hosts, 6) == (
        ["n2"], "rank 2 on n2 is lost or stalled: rank 2 did not report")


def test_a_rank_whose_own_work_stalled_is_the_end_of_the_chain():
    log = report(0, 1) + report(1, None)
    waits, hosts = read_reports(log)
    assert waits == {0: 1, 1: OWN_WORK}
    assert diagnose(waits, hosts, 2) == (
        ["n1"], "rank 1 on n1 stalled in its own work (it was not waiting on MPI)")


def test_inside_a_collective_the_ranks_that_did_not_report_are_to_blame():
    log = "".join(report(r, collective="stop vote") for r in (0, 1, 2, 3))
    waits, hosts = read_reports(log)
    assert waits == {0: None, 1: None, 2: None, 3: None}
    assert diagnose(waits, {**dict(enumerate(HOSTS)), **hosts}, 6) == (
        ["n3"], "rank 4 on n3, rank 5 on n3: lost or stalled (no report; the others' reports "
                "name no rank they waited on)")


def test_inside_a_collective_the_report_names_the_ranks_whose_heartbeats_stopped(tmp_path):
    """Rank 3 waits in the stop vote. Ranks 0, 1 and 3 are alive (their heartbeats go on); n3 was
    lost a minute ago (rank 4's last beat; rank 5 never beat), and rank 2 on n2 crashed half a
    minute ago. The report names n3's ranks, which stopped first, then rank 2; read back, also
    after srun's line for the crashed rank, the chain of waits ends at rank 4 on n3, the line a
    loss mid-epoch gives. With every heartbeat going on, the report names no rank."""
    alive = [Heartbeats(tmp_path, r, HOSTS, period_s=1.0).start() for r in (0, 1)]
    try:
        for r, age in ((2, 30), (4, 60)):
            (tmp_path / "logs" / "heartbeats" / f"rank-{r}").write_text(
                f"{time.time() - age:.1f} {HOSTS[r]}\n")
        log = report(3, collective="stop vote",
                     heartbeats=Heartbeats(tmp_path, 3, HOSTS, period_s=1.0))
        assert ("in the stop vote, a collective of every rank: no heartbeat from ranks 4–5 (n3, "
                "all of its ranks) for 60 s and from rank 2 (n2) for 30 s: lost or stalled; exit "
                "status 5") in log, log
        for log in (log, "srun: error: n2: task 2: Segmentation fault\n" + log):
            waits, hosts = read_reports(log)
            assert waits == {3: 4}
            assert diagnose(waits, {**dict(enumerate(HOSTS)), **hosts}, 6) == (
                ["n3"], "rank 4 on n3 is lost or stalled: ranks 4–5 did not report")

        alive += [Heartbeats(tmp_path, r, HOSTS, period_s=1.0).start() for r in (2, 4, 5)]
        log = report(3, collective="stop vote",
                     heartbeats=Heartbeats(tmp_path, 3, HOSTS, period_s=1.0))
        assert ("a collective of every rank: every rank's heartbeat goes on: a rank is stalled, "
                "or cut off from the others; exit status 5") in log
        assert read_reports(log)[0] == {3: None}
    finally:
        for beat in alive:
            beat.close()


def test_reports_after_the_step_began_to_end_are_not_read():
    """A rank that was stopped (SIGSTOP) and resumed by the launcher's kill reports late, blaming
    a neighbour that already exited: only what came before srun's first task end counts."""
    log = (report(0, 1) + "srun: error: vm: task 0: Exited with exit code 5\n"
           + "srun: launch/slurm: _step_signal: Terminating StepId=7.0\n" + report(1, 0))
    waits, hosts = read_reports(log)
    assert waits == {0: 1}
    assert diagnose(waits, hosts, 2) == (
        ["n1"], "rank 1 on n1 is lost or stalled: rank 1 did not report")


def test_no_reports_no_diagnosis_and_a_cycle_blames_no_rank():
    assert diagnose(*read_reports("epoch 1/2: train loss 2.3\n"), 2) == ([], "")
    waits, hosts = read_reports(report(0, 1) + report(1, 0))
    assert diagnose(waits, hosts, 2) == (
        [], "every rank reported waiting on another: no rank stands out")


def diagnose_run(run_dir, earlier: str, launch: str, placement_hosts):
    """`python -m petra_mpi.watchdog --diagnose` on a run directory whose log holds an earlier
    launch's part, then this launch's, and whose metrics.jsonl has the earlier launch's start
    record (placement_hosts): its two output lines."""
    (run_dir / "logs").mkdir()
    (run_dir / "logs" / "train.log").write_text(earlier + launch)
    placement = [{"rank": r, "host": h, "stage": r, "replica": 0}
                 for r, h in enumerate(placement_hosts)]
    (run_dir / "metrics.jsonl").write_text(
        json.dumps({"event": "start", "placement": placement}) + "\n")
    out = subprocess.run([sys.executable, "-m", "petra_mpi.watchdog", "--diagnose",
                          str(run_dir), "--log-from", str(len(earlier.encode()))],
                         capture_output=True, text=True, cwd=ROOT, timeout=60, check=True)
    return out.stdout.splitlines()


def test_the_command_reads_the_launch_part_of_the_log_and_its_rank_map(tmp_path):
    """Hosts of silent ranks come from this launch's rank map; --log-from skips an earlier
    launch's reports and its map."""
    earlier = printed_rank_map(["old0", "old1"]) + report(2, 3)
    launch = printed_rank_map(["n0", "n1"]) + report(0, 1)
    assert diagnose_run(tmp_path, earlier, launch, ["old0", "old1"]) == [
        "n1", "rank 1 on n1 is lost or stalled: rank 1 did not report"]


def test_a_hang_before_this_launch_printed_its_rank_map_blames_no_host(tmp_path):
    """The job was requeued onto other nodes and hangs in MPI's start, before rank 0 prints the
    rank map: ranks 0 and 1 (on n5) report, rank 2 does not. The only map in the run directory
    is the previous job's (metrics.jsonl, the earlier part of the log): its host of rank 2 is
    not where rank 2 ran now, so no host is blamed, and the diagnosis says why."""
    earlier = printed_rank_map(["old0", "old1", "old2"]) + "epoch 1/2: train loss 2.3\n"
    launch = "".join(startup_report(f"rank {r} (n5)", 600, "starting MPI") + "\n"
                     for r in (0, 1))
    avoid, line = diagnose_run(tmp_path, earlier, launch, ["old0", "old1", "old2"])
    assert avoid == "" and line.endswith(NO_RANK_MAP), line
    assert "old2" not in line


def test_a_start_up_hang_after_the_rank_map_blames_the_silent_rank_on_its_host(tmp_path):
    """The same hang later in the start-up, after this launch's rank map: rank 2 is on n6."""
    earlier = printed_rank_map(["old0", "old1", "old2"])
    launch = printed_rank_map(["n5", "n5", "n6"]) + "".join(
        startup_report(f"rank {r} (n5)", 600, "opening the data (data/x.h5)") + "\n"
        for r in (0, 1))
    assert diagnose_run(tmp_path, earlier, launch, ["old0", "old1", "old2"]) == [
        "n6", "rank 2 on n6: lost or stalled (no report; the others' reports name no rank they "
              "waited on)"]


NAME_STALL = """
source slurm/common.sh
PETRA_LOG=$OUT_DIR/logs/train.log PETRA_LOGGED=0
trap 'echo "batch shell got SIGTERM"' TERM  # as petra_train's trap
petra_name_stall
echo "avoid: $PETRA_STALL_AVOID"
"""


def test_slurms_sigterm_to_the_whole_job_does_not_stop_the_batch_shell_naming_the_lost_rank(
        tmp_path):
    """At a node failure SLURM sends SIGTERM to every process of the job, while the batch shell
    reads the watchdog reports (slurm/lib/launch_end.sh: petra_name_stall). Here the SIGTERM
    comes to the shell's whole process group while its diagnosis runs (PYTHON is a wrapper that
    waits for it): the diagnosis still ends, and the shell names rank 4 on n3."""
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "train.log").write_text(printed_rank_map(HOSTS) + report(3, 4))
    wrapper = tmp_path / "python"
    wrapper.write_text(f'#!/bin/bash\ntouch "{tmp_path}/started"\n'
                       f'while [ ! -e "{tmp_path}/go" ]; do sleep 0.05; done\n'
                       f'exec "{sys.executable}" "$@"\n')
    wrapper.chmod(0o755)
    shell = subprocess.Popen(["bash", "-c", NAME_STALL], cwd=ROOT, start_new_session=True,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             env={"PATH": os.environ["PATH"], "PETRA_ROOT": str(ROOT),
                                  "OUT_DIR": str(tmp_path), "PYTHON": str(wrapper)})
    try:
        deadline = time.monotonic() + 60
        while not (tmp_path / "started").exists():  # the diagnosis has begun
            assert shell.poll() is None and time.monotonic() < deadline, shell.stdout.read()
            time.sleep(0.02)
        os.killpg(shell.pid, signal.SIGTERM)
        (tmp_path / "go").touch()
        out, _ = shell.communicate(timeout=60)
    finally:
        if shell.poll() is None:
            os.killpg(shell.pid, signal.SIGKILL)
    assert "batch shell got SIGTERM" in out, out
    assert "watchdog reports: rank 4 on n3 is lost or stalled: ranks 4–5 did not report" in out, out
    assert "avoid: n3" in out, out
