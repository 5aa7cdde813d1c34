"""The batch scripts on a several-node SLURM cluster (tests/support/netns_cluster.py: three nodes,
each its own network namespace, 2 CPUs and 2 "GPUs"): ranks placed on the nodes the script intends,
messages between nodes over the nodes' interfaces, the same result as one node, and a node lost
mid-run or in a stop vote survived (watchdog line, intact checkpoint, requeue, resume)."""
import json
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.support import netns_cluster, slurm_cluster
from tests.support.launch import mpirun
from tests.support.paths import ROOT
from tests.support.upstream_formats import make_cifar10

pytestmark = pytest.mark.extended  # each test runs a cluster job for a minute or more

SCRIPT = "slurm/revnet18_cifar10.sh"  # RevNet18, CIFAR-10: run as written, shrunk below
# 3 nodes x 2 ranks, each rank one CPU: the script's 10 ranks of 4 CPUs do not fit 2-CPU nodes
LAYOUT = ("--nodes=3", "--ntasks=6", "--ntasks-per-node=2", "--gpus-per-node=2",
          "--cpus-per-task=1")
BATCH = 4


def shrink(data, *more):
    """The trainer overrides: 6 stages at width 8 on the small packed set, on the CPU; the
    estimated split (a measured one may differ between runs, and the runs are compared)."""
    sets = ["run.device=cpu", "model.stages=6", "model.width=8", f"data.path={data}",
            f"data.batch_size={BATCH}", "run.progress=false", "model.balance=estimate", *more]
    return [a for s in sets for a in ("--set", s)]


@pytest.fixture(scope="module")
def nodes(tmp_path_factory):
    why = netns_cluster.missing()
    if why:
        pytest.skip(why)
    c = netns_cluster.NetnsCluster(tmp_path_factory.mktemp("netns"), slurmd_timeout=15).start()
    yield c
    c.stop()


def packed_cifar10(folder, per_batch):
    """A CIFAR-10 file packed by petra_mpi.prep.cifar from an upstream-format tarball: 5 x per_batch
    training and 16 validation images."""
    tarball, _ = make_cifar10(folder, n=per_batch, n_test=16)
    out = folder / "cifar10.h5"
    subprocess.run([sys.executable, "-m", "petra_mpi.prep.cifar", "--source", str(tarball), "--out",
                    str(out)], check=True, capture_output=True, cwd=ROOT)
    return out


@pytest.fixture(scope="module")
def cifar(tmp_path_factory):
    """120 training images."""
    return packed_cifar10(tmp_path_factory.mktemp("cifar"), 24)


@pytest.fixture(scope="module")
def cifar_long(tmp_path_factory):
    """600 training images: epochs of several seconds, long enough to land a node's death inside
    one."""
    return packed_cifar10(tmp_path_factory.mktemp("cifar_long"), 120)


def submit(cluster, tmp_path, out, trainer_args, **env):
    env = {**netns_cluster.MPI_OVER_NETWORK, "OUT_DIR": str(out), "SRUN_MPI": "pmi2",
           "EXTRA_ARGS": " ".join(trainer_args), **env}
    return cluster.sbatch(SCRIPT, *LAYOUT, f"--output={tmp_path}/slurm-%j.out", env=env, cwd=ROOT)


def records(out):
    path = Path(out) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def explain(job, out):
    """The job's state, the end of its SLURM output and of the run's log, for assertion messages."""
    output, log = Path(job.get("StdOut", "")), Path(out) / "logs" / "train.log"
    return (f"{job['JobId']} {job['JobState']} {job['ExitCode']}:\n"
            + (output.read_text(errors="replace")[-3000:] if output.is_file() else "(no output)")
            + "\n--- train.log:\n" + (log.read_text()[-4000:] if log.exists() else "(none)"))


def boundary_floats(J=6):
    """Floats per sample of the message each stage sends to the next (stage s -> s + 1), for the
    same net and split as the run."""
    from tests.support.nets import stages_of
    stages = stages_of("revnet18", 8, 10, J, seed=0)
    x = torch.zeros(1, 3, 32, 32)
    sizes = []
    with torch.no_grad():
        for stage in stages[:-1]:
            stage.eval()
            x = stage.evaluate(x)
            sizes.append(x.numel())
    return sizes


def final_files(out):
    """{name: loaded} of the newest complete checkpoint's stage files."""
    from petra_mpi.run.checkpoint import complete_checkpoints
    newest = Path(complete_checkpoints(str(out))[-1])
    return newest.name, {p.name: torch.load(p, weights_only=False)
                         for p in sorted(newest.glob("*.pt"))}


def assert_bitwise_equal(a, b, where="checkpoint"):
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            assert_bitwise_equal(a[k], b[k], f"{where}/{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_bitwise_equal(x, y, f"{where}[{i}]")
    else:
        assert a == b, (where, a, b)


def one_node_run(out, trainer_args):
    """The same trainer on this machine, 6 ranks under mpirun (shared memory, one host)."""
    proc = mpirun(6, ["-m", "petra_mpi.train", "configs/table2/cifar10/revnet18_petra.yaml",
                      "--set", f"run.out_dir={out}", *trainer_args], timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_script_on_three_nodes_places_stages_crosses_the_network_and_matches_one_node(
        nodes, cifar, tmp_path):
    """The CIFAR-10 script on 3 nodes x 2 ranks: rank r (stage r) runs on node n(r // 2 + 1),
    as the script's block layout intends (rank map in the log, placement in metrics.jsonl); the
    messages between nodes crossed their eth0 interfaces (each node received at least the
    payload its neighbour on another node had to send it); the parameters equal those of the
    same config run on one node, bitwise."""
    out = tmp_path / "run"
    args = shrink(cifar, "train.epochs=1")
    before = {n: nodes.eth0_bytes(n) for n in nodes.nodes}
    start = time.time()
    jobid = submit(nodes, tmp_path, out, args)
    (job,) = nodes.wait(jobid, timeout=240)
    seconds = time.time() - start
    assert (job["JobState"], job["ExitCode"]) == ("COMPLETED", "0:0"), explain(job, out)
    received = {n: nodes.eth0_bytes(n)[0] - before[n][0] for n in nodes.nodes}
    sent = {n: nodes.eth0_bytes(n)[1] - before[n][1] for n in nodes.nodes}

    # placement: consecutive ranks (stages) share a node, in node order
    intended = {r: f"n{r // 2 + 1}" for r in range(6)}
    (start_record,) = [r for r in records(out) if r["event"] == "start"]
    assert {p["rank"]: (p["host"], p["stage"]) for p in start_record["placement"]} == \
        {r: (host, r) for r, host in intended.items()}
    log = (out / "logs" / "train.log").read_text()
    for r, host in intended.items():
        assert re.search(rf"rank +{r}  host {host}  stage {r} ", log), log[:2000]

    # traffic: the activations of the training micro-batches alone that crossed into each node
    n = start_record["microbatches_per_epoch"]
    floats = boundary_floats()
    must = {"n2": n * BATCH * floats[1] * 4,   # stage 1 (n1) -> stage 2 (n2)
            "n3": n * BATCH * floats[3] * 4,   # stage 3 (n2) -> stage 4 (n3)
            "n1": n * BATCH * floats[1] * 4}   # gradient stage 2 (n2) -> stage 1 (n1)
    for node, least in must.items():
        assert received[node] >= least, (node, received, least)
    print(f"\ncross-node traffic in {seconds:.0f} s of job: received {received}, sent {sent} "
          f"(bytes); {n} micro-batches")

    reference = tmp_path / "one_node"
    one_node_run(reference, args)
    name, files = final_files(out)
    ref_name, ref_files = final_files(reference)
    assert name == ref_name
    assert_bitwise_equal(files, ref_files)


@pytest.mark.parametrize("how", ["killed", "unplugged"])
def test_a_lost_node_ends_with_one_clear_line_requeues_and_resumes(nodes, cifar_long, tmp_path,
                                                                    how):
    """Mid-epoch, node n3 (ranks 4 and 5) dies (every process of it killed) or loses its link.
    Rank 3, on n2, ends through its watchdog with a line naming rank 4 on n3; the last complete
    checkpoint stays intact; SLURM requeues the job (a node failure of a --requeue job); once the
    node is back the job resumes from that checkpoint (after the kill: and finishes, with the
    same parameters as an uninterrupted run from that checkpoint)."""
    out = tmp_path / "run"
    # a progress line at every update (in a log file the bar is otherwise time-based, and a short
    # epoch prints only its last line): the node is lost at the start of epoch 3, not at its end
    args = shrink(cifar_long, "train.epochs=4", "run.watchdog_s=5", "run.keep_checkpoints=20",
                  "run.progress=true", "run.progress_interval_s=0")
    jobid = submit(nodes, tmp_path, out, args)

    def inside_epoch_3(jobs):
        """Epochs 1 and 2 checkpointed and the last rank's first progress line of epoch 3 out
        (its first micro-batch's update): the ranks are inside the training loop."""
        assert jobs[0]["JobState"] not in slurm_cluster.TERMINAL, explain(jobs[0], out)
        log = out / "logs" / "train.log"
        return (sum(r["event"] == "checkpoint" for r in records(out)) >= 2 and log.exists()
                and re.search(r"^epoch 3/4 \[", log.read_text(), re.M) is not None)

    nodes.wait(jobid, inside_epoch_3, timeout=240, what="to be inside epoch 3")
    died = time.time()
    if how == "killed":
        nodes.kill_node("n3")
    else:
        nodes.link("n3", up=False)
    try:
        (job,) = nodes.wait(jobid, lambda jobs: int(jobs[0].get("Restarts", 0)) >= 1,
                            timeout=180, what="to be requeued")
        ended = time.time() - died
        from petra_mpi.run.checkpoint import complete_checkpoints, is_complete
        last = complete_checkpoints(str(out))[-1]
        kept = tmp_path / "kept"
        shutil.copytree(last, kept / Path(last).name)  # the reference resumes from this copy
    finally:  # the node comes back
        if how == "killed":
            nodes.start_node("n3")
        else:
            nodes.link("n3", up=True)
    print(f"\nnode {how}: the job left its nodes {ended:.1f} s later")
    # SLURM counts the restart while the batch script still writes its last lines
    nodes.wait(jobid, lambda jobs: "watchdog reports: " in (out / "logs" / "train.log").read_text(),
               timeout=60, what="to name the lost rank")
    log = (out / "logs" / "train.log").read_text()
    lost = re.findall(r"petra_mpi: watchdog: rank 3 \(n2, stage 3\): .*", log)
    assert len(lost) == 1 and re.search(r"waiting on the \w+ of [\w ]+ (from|to) rank 4 \(n3\): "
                                        r"that rank or its node is lost or stalled", lost[0]), \
        log[-4000:]
    assert "Segmentation fault" not in log
    # the batch script followed the reports' chain of waits to the lost node
    assert "watchdog reports: rank 4 on n3 is lost or stalled: ranks 4–5 did not report" in log, \
        log[-4000:]

    if how == "unplugged":  # what follows the resume does not depend on how the node was lost:
        # the resumed run is run to its end and compared once, after the kill
        nodes.wait(jobid, lambda jobs: any(r["event"] == "resume" for r in records(out)),
                   timeout=180, what="to resume")
        nodes.run("scancel", jobid)
        nodes.wait(jobid, timeout=120)
    else:
        (job,) = nodes.wait(jobid, timeout=300)
        assert (job["JobState"], job["ExitCode"]) == ("COMPLETED", "0:0"), explain(job, out)
    assert is_complete(last)
    (resume,) = [r for r in records(out) if r["event"] == "resume"]
    assert resume["from"] == last and resume["layout_changes"] == []
    if how == "unplugged":
        return

    name, files = final_files(out)
    assert name == "ckpt-e00004-b00000000"
    reference = tmp_path / "uninterrupted"
    one_node_run(reference, args + ["--set", f"run.resume={kept / Path(last).name}"])
    ref_name, ref_files = final_files(reference)
    assert ref_name == name
    assert_bitwise_equal(files, ref_files)


def test_a_node_lost_in_the_stop_vote_is_named_and_slurm_requeues_the_job(nodes, cifar,
                                                                          tmp_path):
    """Node n3 (ranks 4 and 5) dies while the other ranks wait in the stop vote that ends epoch
    2's training (rank 5 holds before it: tests/programs/faulty_train.py hold-vote, in the job's
    first run only). Inside that collective no neighbour is waited on, yet the
    watchdogs that report name n3's ranks from their heartbeats, and the batch script names rank
    4 on n3; SLURM's SIGTERM comes from the node failure and SLURM requeues the job, which the
    script says (never "not requeueing"). Once n3 is back, the job resumes from epoch 1's
    checkpoint and finishes."""
    out = tmp_path / "run"
    args = shrink(cifar, "train.epochs=3", "run.watchdog_s=10")
    wrapper = tmp_path / "python"
    wrapper.write_text(f"""#!/bin/bash
if [[ $1 == -m && $2 == petra_mpi.train && ${{SLURM_RESTART_COUNT:-0}} == 0 ]]; then
    exec {sys.executable} {ROOT / 'tests' / 'programs' / 'faulty_train.py'} hold-vote 5 2 "${{@:3}}"
fi
exec {sys.executable} "$@"
""")
    wrapper.chmod(0o755)
    jobid = submit(nodes, tmp_path, out, args, PYTHON=str(wrapper))

    def at_the_vote(jobs):
        assert jobs[0]["JobState"] not in slurm_cluster.TERMINAL, explain(jobs[0], out)
        return (out / "at_the_vote").exists()

    nodes.wait(jobid, at_the_vote, timeout=240, what="to reach the stop vote of epoch 2")
    nodes.kill_node("n3")
    try:
        (job,) = nodes.wait(jobid, lambda jobs: int(jobs[0].get("Restarts", 0)) >= 1,
                            timeout=180, what="to be requeued")
        # the batch script writes its lines as SLURM's SIGTERM reaches it, while n3 is down
        nodes.wait(jobid, lambda jobs: "SLURM requeued" in (out / "logs" / "train.log")
                   .read_text(), timeout=60, what="to say that SLURM requeued it")
    finally:
        nodes.start_node("n3")
    log = (out / "logs" / "train.log").read_text()
    reports = re.findall(r"petra_mpi: watchdog: rank \d \((n[12]), stage \d\): no progress for "
                         r"10 s \(run.watchdog_s\) in the stop vote, a collective of every "
                         r"rank: (.*)", log)
    assert reports and all(r.startswith("no heartbeat from ranks 4–5 (n3, all of its ranks)")
                           for _, r in reports), log[-4000:]
    assert "watchdog reports: rank 4 on n3 is lost or stalled: ranks 4–5 did not report" in log, \
        log[-4000:]
    assert re.search(rf"SLURM requeued job {jobid} \(node failure: n3 down\)", log), log[-4000:]
    assert "not requeueing" not in log, log[-4000:]

    (job,) = nodes.wait(jobid, timeout=300)
    assert (job["JobState"], job["ExitCode"]) == ("COMPLETED", "0:0"), explain(job, out)
    (resume,) = [r for r in records(out) if r["event"] == "resume"]
    assert Path(resume["from"]).name == "ckpt-e00001-b00000000", resume
    nodes.wait_nodes(["idle"] * 3)  # n3 back for the next test


def test_elastic_job_losing_a_node_goes_on_with_the_layout_that_fits(nodes, cifar, tmp_path):
    """ELASTIC_NODES=2-3 slurm/submit.sh (2 ranks per node, --no-kill): the run starts on 3 nodes
    (6 stages); n3 is killed mid-run; SLURM takes it out of the allocation and the job keeps
    running on n1 and n2, where the script launches the run again on 4 stages: it resumes from
    the last complete checkpoint ("stages 6 -> 4") and finishes, in the same job."""
    out = tmp_path / "run"
    args = shrink(cifar, "train.epochs=6", "run.watchdog_s=5")
    env = {**netns_cluster.MPI_OVER_NETWORK, "OUT_DIR": str(out), "SRUN_MPI": "pmi2",
           "EXTRA_ARGS": " ".join(args), "ELASTIC_NODES": "2-3", "GPUS_PER_NODE": "2"}
    proc = nodes.run("bash", "slurm/submit.sh", SCRIPT, "--parsable", "--cpus-per-task=1",
                     f"--output={tmp_path}/slurm-%j.out", env=env, cwd=ROOT)
    jobid = proc.stdout.strip().splitlines()[-1].split(";")[0]

    def two_checkpoints(jobs):
        assert jobs[0]["JobState"] not in slurm_cluster.TERMINAL, explain(jobs[0], out)
        return sum(r["event"] == "checkpoint" for r in records(out)) >= 2

    (job,) = nodes.wait(jobid, two_checkpoints, timeout=240, what="to write two checkpoints")
    assert job["NumNodes"] == "3" and records(out)[0]["stages"] == 6, job
    nodes.kill_node("n3")
    try:
        (job,) = nodes.wait(jobid, timeout=300)
    finally:
        nodes.start_node("n3")
    log = (out / "logs" / "train.log").read_text()
    assert (job["JobState"], job["ExitCode"], job["Restarts"]) == ("COMPLETED", "0:0", "0"), \
        explain(job, out)
    assert re.search(r"lost 1 node\(s\) of n\[1-3\]: going on with n\[1-2\]", log), log[-3000:]
    assert "elastic: 4 ranks on 2 node(s): launching 4 with --set model.stages=4" in log
    (resume,) = [r for r in records(out) if r["event"] == "resume"]
    assert resume["stages"] == 4 and any("stages 6 -> 4" in c for c in resume["layout_changes"])
    assert {p["host"] for p in resume["placement"]} == {"n1", "n2"}
    assert json.loads((out / "summary.json").read_text())["stages"] == 4
    nodes.wait_nodes(["idle"] * 3)  # n3 back for the next test
