"""Elastic batch jobs: the layout that fits the ranks a job gets (petra_mpi.elastic), and the batch
scripts launching it with ELASTIC=1, so that a job given fewer ranks resumes on fewer stages."""
import pytest

from petra_mpi.config import load_config, validate
from petra_mpi.run.elastic import fit
from tests.support.paths import ROOT
from test_slurm import fake_commands, run_batch_script

QUICK = ROOT / "configs" / "quickstart.yaml"  # RevNet18: 10 blocks, model.stages 4


@pytest.mark.parametrize("sets,ranks,want", [
    (["model.stages=6"], 6, (6, [])),                        # fits as it is
    (["model.stages=6"], 4, (4, ["model.stages=4"])),        # a node fewer: fewer stages
    (["model.stages=0"], 12, (10, ["model.stages=10"])),     # one stage per block at most
    ([], 10, (8, ["model.stages=4"])),                       # 4 stages: 2 replicas on 8
    (["model.stages=2", "train.replicas=2"], 3, (2, ["model.stages=1"])),  # R kept
    (["model.stages=5", "model.partition=[2, 2, 2, 2, 2]"], 4,
     (4, ["model.stages=4", "model.partition=null"])),
])
def test_fit_keeps_replicas_and_cuts_stages(sets, ranks, want):
    cfg = load_config(QUICK, sets)
    used, overrides = fit(cfg, ranks)
    assert (used, overrides) == want
    validate(load_config(QUICK, [*sets, *overrides]), used)


def test_batch_script_launches_the_layout_that_fits_its_ranks(tmp_path):
    """A 6-stage run whose requeued job got 4 ranks runs 4 stages on them; 4 stages on 10 ranks
    are 2 replicas on 8 of them (srun --ntasks=8); a job whose ranks fit gets nothing added."""
    args = tmp_path / "args"
    path = fake_commands(tmp_path / "bin", srun=f'echo "$@" >{args}')
    six = {"EXTRA_ARGS": "--set model.stages=6 --set run.device=cpu", "ELASTIC": "1"}
    proc = run_batch_script(tmp_path, path, SLURM_NTASKS="4", SLURM_JOB_NUM_NODES="2", **six)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    given = args.read_text().split()
    assert given[-2:] == ["--set", "model.stages=4"] and "--ntasks=4" not in given, given
    assert "elastic: 4 ranks on 2 node(s): launching 4 with --set model.stages=4" in proc.stdout
    proc = run_batch_script(tmp_path, path, SLURM_NTASKS="10", EXTRA_ARGS="--set run.device=cpu",
                            ELASTIC="1")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    given = args.read_text().split()
    assert "--ntasks=8" in given and given[-2:] == ["--set", "model.stages=4"], given
    proc = run_batch_script(tmp_path, path, SLURM_NTASKS="6", **six)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    given = args.read_text().split()
    assert not [a for a in given if a.startswith("--ntasks")] and given[-1] == "run.device=cpu"
    proc = run_batch_script(tmp_path, path, SLURM_NTASKS="4", **{**six, "ELASTIC": "0"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert args.read_text().split()[-1] == "run.device=cpu"  # not elastic: launched as asked


# ---------------------------------------------------------------- on a 3-node SLURM cluster

import json  # noqa: E402
import os  # noqa: E402
import time  # noqa: E402

from tests.support import slurm_cluster  # noqa: E402


class ThreeNodes(slurm_cluster.Cluster):
    """The test cluster with three nodes of 2 CPUs and 2 "GPUs", each its own slurmd on this
    machine (slurmd -N), so that a node can be drained between a job and its requeue."""
    NODES = ("n1", "n2", "n3")

    def _write_conf(self):
        super()._write_conf()
        r = self.root
        with open(os.path.join(r, "gres.conf"), "w") as f:
            f.write(f"NodeName=n[1-3] Name=gpu File={r}/gpu/gpu[0-1]\n")
        conf = open(self.conf).read()
        keep = [line for line in conf.splitlines()
                if not line.startswith(("NodeName=", "PartitionName=", "SlurmdSpoolDir=",
                                        "SlurmdPidFile=", "SlurmdLogFile=", "SlurmdPort="))]
        ports = [slurm_cluster._free_port() for _ in self.NODES]
        keep += [f"SlurmdSpoolDir={r}/spool/%n", f"SlurmdPidFile={r}/slurmd-%n.pid",
                 f"SlurmdLogFile={r}/log/slurmd-%n.log"]
        keep += [f"NodeName={n} NodeHostname={self.host} NodeAddr=127.0.0.1 Port={p} CPUs=2 "
                 f"Gres=gpu:2 State=UNKNOWN" for n, p in zip(self.NODES, ports)]
        keep.append("PartitionName=debug Nodes=n[1-3] Default=YES MaxTime=INFINITE State=UP")
        with open(self.conf, "w") as f:
            f.write("\n".join(keep) + "\n")
        for n in self.NODES:
            os.makedirs(os.path.join(r, "spool", n), exist_ok=True)

    def start(self, timeout=60):
        try:
            self._start_munge()
            self._write_conf()
            log = os.path.join(self.root, "log")
            daemons = [("slurmctld", ["-D", "-c"])] + [("slurmd", ["-D", "-N", n])
                                                        for n in self.NODES]
            for name, args in daemons:
                out = open(os.path.join(log, f"{name}{args[-1]}.out"), "w")
                self.procs.append(slurm_cluster.subprocess.Popen(
                    [slurm_cluster._sbin(name), *args, "-f", self.conf], stdout=out,
                    stderr=slurm_cluster.subprocess.STDOUT, env=self.env))
            deadline = time.time() + timeout
            while self.run("sinfo", "-h", "-N", "-o", "%T", check=False).stdout.split() != \
                    ["idle"] * 3:
                if time.time() > deadline:
                    raise RuntimeError("the 3 test nodes never became idle: "
                                       + self._tail("log/slurmctld.log"))
                time.sleep(0.5)
        except BaseException:
            self.stop()
            raise
        return self


@pytest.fixture(scope="module")
def three_nodes(tmp_path_factory):
    why = slurm_cluster.missing()
    if why:
        pytest.skip(why)
    c = ThreeNodes(tmp_path_factory.mktemp("slurm3")).start()
    yield c
    c.stop()


def records(out):
    path = out / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


@pytest.mark.extended
def test_resubmitted_on_one_node_fewer_the_run_resumes_on_the_layout_that_fits(three_nodes,
                                                                              tmp_path):
    """ELASTIC_NODES=2-3: the job starts on 3 nodes x 2 ranks (6 stages); a node is drained and
    the job cancelled (it checkpoints); the same submission then gets 2 nodes, and the run resumes
    on 4 stages from its checkpoint and finishes."""
    out = tmp_path / "run"
    extra = ("--set run.device=cpu --set model.stages=6 --set train.epochs=2 "
             "--set data.synthetic_train=3200 --set data.synthetic_val=128 --set model.width=4 "
             "--set run.progress=false --set model.balance=estimate")
    env = {"ELASTIC_NODES": "2-3", "GPUS_PER_NODE": "2", "CONFIG": "configs/quickstart.yaml",
           "OUT_DIR": str(out), "EXTRA_ARGS": extra, "LAUNCHER": "srun", "SRUN_MPI": "pmi2"}

    def submit():
        proc = three_nodes.run("bash", "slurm/submit.sh", "slurm/revnet18_cifar10.sh",
                               "--parsable", "--cpus-per-task=1",
                               f"--output={tmp_path}/slurm-%j.out", env=env, cwd=ROOT)
        return proc.stdout.strip().splitlines()[-1].split(";")[0]

    def training(jobs):
        assert jobs[0]["JobState"] not in slurm_cluster.TERMINAL, jobs[0]
        return any(r["event"] == "train" for r in records(out))

    jobid = submit()
    (job,) = three_nodes.wait(jobid, training, timeout=120, what="to start training")
    assert job["NumNodes"] == "3" and records(out)[0]["stages"] == 6
    three_nodes.run("scontrol", "update", "nodename=n3", "state=drain", "reason=test")
    three_nodes.run("scancel", jobid)  # SIGTERM: the ranks checkpoint, the job is not requeued
    (job,) = three_nodes.wait(jobid, timeout=120)
    assert [r["event"] for r in records(out)][-1] == "stop", records(out)[-3:]
    jobid = submit()
    (job,) = three_nodes.wait(jobid, timeout=240)
    log = (out / "logs" / "train.log").read_text()
    assert (job["JobState"], job["ExitCode"]) == ("COMPLETED", "0:0"), log[-3000:]
    assert job["NumNodes"] == "2"
    resume = [r for r in records(out) if r["event"] == "resume"]
    assert len(resume) == 1 and resume[0]["stages"] == 4, resume
    assert any("stages 6 -> 4" in c for c in resume[0]["layout_changes"])
    assert "elastic: 4 ranks on 2 node(s): launching 4 with --set model.stages=4" in log
    assert json.loads((out / "summary.json").read_text())["stages"] == 4
