"""A job suspended and resumed on the one-node SLURM test cluster (tests/support/slurm_cluster.py):
`scontrol suspend` stops every process of the job (SIGSTOP), `scontrol resume` continues them,
as PreemptMode=SUSPEND does. The watchdogs must take the stop for what it is, not a hang."""
import json
import os
import time

import pytest

from tests.support import slurm_cluster
from tests.support.paths import ROOT

pytestmark = pytest.mark.extended

# The quick start made small, its two ranks on one node (command-line options override the
# script's #SBATCH lines); srun with PMI-2, which PyPI's MPICH can use.
EXTRA_ARGS = ("--set run.device=cpu --set model.stages=0 --set train.epochs=1 "
              "--set train.limit_batches=40 --set data.synthetic_train=4096 "
              "--set data.synthetic_val=128 --set model.width=4 --set run.progress=false "
              "--set run.threads=1 --set model.balance=estimate --set run.log_every=1 "
              "--set run.watchdog_s=3")
SMALL = ("--nodes=1", "--ntasks=2", "--ntasks-per-node=2", "--gpus-per-node=2", "--cpus-per-task=1")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    yield from slurm_cluster.running_cluster(tmp_path_factory)


def trained_steps(metrics):
    if not metrics.exists():
        return 0
    records = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    return max((r["step"] for r in records if r["event"] == "train"), default=0)


def test_a_suspended_job_completes_when_resumed(cluster, tmp_path):
    """Suspended past its start-up (10 optimizer steps trained) for three times run.watchdog_s,
    then resumed: no watchdog fires and the job completes."""
    out = tmp_path / "run"
    jobid = cluster.sbatch(os.path.join(ROOT, "slurm", "revnet18_cifar10.sh"), *SMALL,
                           f"--output={tmp_path}/slurm-%j.out", cwd=ROOT,
                           env={"CONFIG": "configs/quickstart.yaml", "OUT_DIR": str(out),
                                "EXTRA_ARGS": EXTRA_ARGS, "LAUNCHER": "srun",
                                "SRUN_MPI": "pmi2"})

    def training(jobs):
        assert jobs[0]["JobState"] not in slurm_cluster.TERMINAL, jobs[0]
        return trained_steps(out / "metrics.jsonl") >= 10

    cluster.wait(jobid, training, timeout=180, what="to train 10 steps")
    cluster.run("scontrol", "suspend", jobid)
    cluster.wait(jobid, lambda jobs: jobs[0]["JobState"] == "SUSPENDED", timeout=30,
                 what="to be suspended")
    time.sleep(9.0)  # the suspension: three times run.watchdog_s
    cluster.run("scontrol", "resume", jobid)
    (job,) = cluster.wait(jobid, timeout=300)
    log = (out / "logs" / "train.log").read_text()
    assert (job["JobState"], job["ExitCode"]) == ("COMPLETED", "0:0"), log[-3000:]
    assert "petra_mpi: watchdog:" not in log, log[-3000:]
    assert (out / "summary.json").exists()
