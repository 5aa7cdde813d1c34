"""The batch scripts in slurm/: syntax and config checks, then real jobs on a throwaway one-node
SLURM cluster (tests/support/slurm_cluster.py): a smoke run, a failing run, preemption with
checkpoint, requeue and resume, a job array, and the ImageNet packing array with its dependent
merge."""
import glob
import itertools
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.support import slurm_cluster
from petra_mpi.config import load_config, num_replicas, num_stages, validate
from tests.support import paths
from tests.support.outputs import printed_rank_map
from petra_mpi.run.watchdog import startup_report

ROOT = str(paths.ROOT)
SCRIPTS = sorted(glob.glob(os.path.join(ROOT, "slurm", "*.sh")))
HELPERS = ("common.sh", "submit.sh")  # sourced or run by hand, not submitted
EXPERIMENTS = [s for s in SCRIPTS if os.path.basename(s) not in HELPERS + ("pack_imagenet.sh",)]
SMOKE = ("--set run.device=cpu --set model.stages=0 --set train.epochs=1 --set train.limit_batches=8 "
         "--set data.synthetic_train=1024 --set data.synthetic_val=128 --set model.width=4 "
         "--set run.progress=false")
# Fewer ranks than the scripts ask for, on one node, one CPU each: command-line options override
# #SBATCH lines.
SMALL = ("--nodes=1", "--ntasks=2", "--ntasks-per-node=2", "--gpus-per-node=2", "--cpus-per-task=1")
# srun with PMI-2: PyPI's MPICH cannot use the PMIx plugin (no libpmix), but PMI-2 works (the test
# cluster's MpiDefault is none, so the scripts' default, no --mpi, would start 2 singletons).
SRUN = {"LAUNCHER": "srun", "SRUN_MPI": "pmi2"}


def sbatch_option(script, name):
    m = re.search(rf"^#SBATCH --{name}=(\S+)", open(script).read(), re.M)
    return m.group(1) if m else None


def script_configs(script):
    """The configs a script runs: [CONFIG_DEFAULT], or CONFIGS (one per array task)."""
    lines = [ln for ln in open(script) if ln.startswith(("CONFIG_DEFAULT=", "CONFIGS="))]
    assert len(lines) == 1, f"{script}: expected one CONFIG_DEFAULT= or CONFIGS= line"
    code = lines[0] + '\nprintf "%s\\n" "${CONFIGS[@]:-$CONFIG_DEFAULT}"'
    return subprocess.run(["bash", "-c", code], capture_output=True, text=True, timeout=10,
                          cwd=ROOT, check=True).stdout.split()


RESOLVE = 'source slurm/common.sh && petra_resolve && echo "$CONFIG|$OUT_DIR"'


def resolve(env, before=""):
    """CONFIG and OUT_DIR as common.sh picks them for a job with this environment."""
    out = subprocess.run(["bash", "-c", before + RESOLVE], capture_output=True, text=True,
                         timeout=10, cwd=ROOT, env={"PATH": os.environ["PATH"], **env})
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout.strip().split("|")


# ---------------------------------------------------------------- no cluster needed

@pytest.mark.parametrize("script", SCRIPTS, ids=os.path.basename)
def test_script_syntax_and_contract(script):
    subprocess.run(["bash", "-n", script], check=True, timeout=10)
    if os.path.basename(script) in HELPERS:
        return
    text = open(script).read()
    assert '/slurm/common.sh"' in text and "#SBATCH --requeue" in text
    if script in EXPERIMENTS:
        assert "#SBATCH --signal=B:USR1@300" in text and text.rstrip().endswith("petra_train")
        # one GPU per rank, all the node's GPUs visible to each rank (CUDA IPC needs them):
        # --gpus-per-node, never --gpus-per-task; the layout is petra_layout's for 4 GPUs a node
        assert "--gpus-per-task" not in text
        layout = [f"--{name}={sbatch_option(script, name)}"
                  for name in ("nodes", "ntasks-per-node", "gpus-per-node")]
        assert layout == petra_layout(int(sbatch_option(script, "ntasks")), 4), layout
        hours = int(sbatch_option(script, "time").split(":")[0])
        assert hours <= 12, "--time above many partitions' maximum leaves the job pending"
    if "CONFIGS=(" in text:  # a job array: one task per config, a few at a time
        span, throttle = sbatch_option(script, "array").split("%")
        lo, hi = map(int, span.split("-"))
        assert (lo, hi) == (0, len(script_configs(script)) - 1), "--array must cover CONFIGS"
        assert int(throttle) <= 2


@pytest.mark.parametrize("script", EXPERIMENTS, ids=os.path.basename)
def test_configs_exist_and_match_ranks(script):
    """Every config a script runs loads, validates, and fills --ntasks with its replicas of its
    stages (one replica, one rank per stage, but for the replicas scripts)."""
    ntasks = int(sbatch_option(script, "ntasks"))
    for config in script_configs(script):
        cfg = load_config(os.path.join(ROOT, config), [])
        validate(cfg, ntasks)
        J, R = num_stages(cfg, ntasks), num_replicas(cfg, ntasks)
        assert J * R == ntasks and J == num_stages(cfg, 1), config
        assert R == cfg.train.replicas or (R == 1 and not cfg.train.replicas), config


@pytest.mark.extended
def test_dry_run_every_script():
    """DRY_RUN=1 runs the script's trainer command with --dry-run (narrow, to stay quick): the
    stages build and the shapes check out. Array scripts: their first task."""
    def dry(script):
        env = dict(os.environ, DRY_RUN="1", SLURM_ARRAY_TASK_ID="0",
                   EXTRA_ARGS="--set model.width=2 --set run.device=cpu")
        return script, subprocess.run(["bash", script], capture_output=True, text=True, timeout=120,
                                      cwd=ROOT, env=env)

    with ThreadPoolExecutor(2) as pool:
        for script, proc in pool.map(dry, EXPERIMENTS):
            assert proc.returncode == 0, f"{script}:\n{proc.stdout}\n{proc.stderr}"
            assert "stage" in proc.stdout and "--dry-run" in proc.stdout, proc.stdout


def test_config_and_out_dir_resolution():
    # the default: the script's config, run dir mirroring the config path (stable across requeues)
    assert resolve({"CONFIG_DEFAULT": "configs/quickstart.yaml"}) == ["configs/quickstart.yaml",
                                                                      "runs/quickstart"]
    # CONFIG and OUT_DIR override
    assert resolve({"CONFIG_DEFAULT": "x.yaml", "CONFIG": "configs/quickstart.yaml",
                    "OUT_DIR": "/tmp/r"}) == ["configs/quickstart.yaml", "/tmp/r"]
    # an array task picks its entry of CONFIGS
    script = os.path.join(ROOT, "slurm", "table4_revnet18.sh")
    configs = script_configs(script)
    line = next(ln for ln in open(script) if ln.startswith("CONFIGS="))
    name = configs[3][len("configs/"):-len(".yaml")]
    assert resolve({"SLURM_ARRAY_TASK_ID": "3"}, line) == [configs[3], f"runs/{name}"]
    # CONFIG given to an array: every task runs it, in its own run dir
    assert resolve({"CONFIG": "configs/quickstart.yaml", "SLURM_ARRAY_TASK_ID": "1",
                    "OUT_DIR": "/tmp/r"}) == ["configs/quickstart.yaml", "/tmp/r/task1"]


def petra_layout(ntasks, gpus_per_node):
    out = subprocess.run(["bash", "-c", f"source slurm/common.sh && petra_layout {ntasks} "
                          f"{gpus_per_node}"], capture_output=True, text=True, timeout=10,
                         cwd=ROOT, check=True)
    return out.stdout.split()


def test_layout_for_gpus_per_node():
    """The worked examples of docs/clusters.md: the fewest nodes, ranks spread evenly, one GPU
    per rank, never more ranks on a node than it has GPUs."""
    assert petra_layout(10, 4) == ["--nodes=3", "--ntasks-per-node=4", "--gpus-per-node=4"]
    assert petra_layout(10, 8) == ["--nodes=2", "--ntasks-per-node=5", "--gpus-per-node=5"]
    assert petra_layout(18, 4) == ["--nodes=5", "--ntasks-per-node=4", "--gpus-per-node=4"]
    assert petra_layout(18, 8) == ["--nodes=3", "--ntasks-per-node=6", "--gpus-per-node=6"]
    assert petra_layout(36, 8) == ["--nodes=5", "--ntasks-per-node=8", "--gpus-per-node=8"]
    for ntasks in range(1, 40):
        for per_node in (1, 2, 4, 6, 8):
            nodes, tasks, gpus = (int(o.split("=")[1]) for o in petra_layout(ntasks, per_node))
            assert tasks == gpus <= per_node and (nodes - 1) * tasks < ntasks <= nodes * tasks


def fake_commands(bin_dir, **bodies):
    """Executables named by the keywords, each a bash body, first on a PATH that is returned."""
    bin_dir.mkdir(exist_ok=True)
    for name, body in bodies.items():
        (bin_dir / name).write_text("#!/bin/bash\n" + body + "\n")
        (bin_dir / name).chmod(0o755)
    return f"{bin_dir}:{os.environ['PATH']}"


def test_submit_lays_out_by_gpus_per_node(tmp_path):
    """slurm/submit.sh passes sbatch the layout for GPUS_PER_NODE, then the user's options."""
    args = tmp_path / "args"
    path = fake_commands(tmp_path / "bin", sbatch=f'echo "$@" >{args}')
    env = {"PATH": path, "GPUS_PER_NODE": "8"}
    subprocess.run(["bash", "slurm/submit.sh", "slurm/revnet50_imagenet.sh", "--array=1"],
                   cwd=ROOT, env=env, check=True, timeout=20, capture_output=True)
    assert args.read_text().split() == ["--export=ALL", "--nodes=3", "--ntasks-per-node=6",
                                        "--gpus-per-node=6", "--array=1",
                                        "slurm/revnet50_imagenet.sh"]


def run_batch_script(tmp_path, path, **env):
    """The CIFAR script as a job's batch shell would run it, with fake launchers on `path`."""
    env = {"PATH": path, "SLURM_JOB_ID": "7", "CONFIG": "configs/quickstart.yaml",
           "OUT_DIR": str(tmp_path / "run"), **env}
    return subprocess.run(["bash", "slurm/revnet18_cifar10.sh"], cwd=ROOT, env=env, timeout=30,
                          capture_output=True, text=True)


def test_srun_line(tmp_path):
    """srun gets the job's --cpus-per-task (srun 22.05-23.02 ignores SLURM_CPUS_PER_TASK),
    --gpu-bind=none, ends the step when a rank fails (whatever KillOnBadExit and WaitTime the site
    set), and --mpi only when SRUN_MPI names a plugin (else the site's MpiDefault)."""
    args = tmp_path / "args"
    path = fake_commands(tmp_path / "bin", srun=f'echo "$@" >{args}')
    always = ["--cpus-per-task=8", "--gpu-bind=none", "--kill-on-bad-exit=1", "--wait=60"]
    proc = run_batch_script(tmp_path, path, SLURM_CPUS_PER_TASK="8")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert args.read_text().split()[:5] == always + ["python"]
    proc = run_batch_script(tmp_path, path, SLURM_CPUS_PER_TASK="8", SRUN_MPI="pmi2")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert args.read_text().split()[:5] == always + ["--mpi=pmi2"]


def test_mpirun_refused_on_several_nodes(tmp_path):
    """mpirun cannot place ranks on SLURM's GPUs of other nodes: a multi-node job refuses it."""
    ran = tmp_path / "ran"
    path = fake_commands(tmp_path / "bin", mpirun=f"touch {ran}")
    proc = run_batch_script(tmp_path, path, LAUNCHER="mpirun", SLURM_JOB_NUM_NODES="2",
                            SLURM_NTASKS="10")
    assert proc.returncode == 2 and "one node only" in proc.stdout, proc.stdout + proc.stderr
    assert not ran.exists()
    proc = run_batch_script(tmp_path, path, LAUNCHER="mpirun", SLURM_JOB_NUM_NODES="1",
                            SLURM_NTASKS="2")
    assert proc.returncode == 0 and ran.exists(), proc.stdout + proc.stderr


def test_pack_merge_submission(tmp_path):
    """The first shard task queues the merge under the job's account, partition, QOS and
    reservation, with the job's environment, ended by SLURM if a shard fails (its dependency can
    then never be met); when that sbatch fails it warns and packs its shard anyway."""
    args = tmp_path / "args"
    env = {"SLURM_ARRAY_TASK_ID": "0", "SLURM_ARRAY_JOB_ID": "5", "SLURM_JOB_ACCOUNT": "proj",
           "SLURM_JOB_PARTITION": "cpu", "SLURM_JOB_QOS": "normal", "PYTHON": "true",
           "SLURM_JOB_RESERVATION": "maint",
           "OUT": str(tmp_path / "imagenet.h5"), "PARTS": str(tmp_path / "parts")}
    path = fake_commands(tmp_path / "bin", sbatch=f'echo "$@" >{args}; echo 6')
    proc = subprocess.run(["bash", "slurm/pack_imagenet.sh"], cwd=ROOT, timeout=30, text=True,
                          capture_output=True, env={**env, "PATH": path})
    assert proc.returncode == 0 and "submitted merge job 6" in proc.stdout, proc.stdout + proc.stderr
    given = args.read_text().split()
    assert {"--account=proj", "--partition=cpu", "--qos=normal", "--reservation=maint",
            "--dependency=afterok:5", "--kill-on-invalid-dep=yes",
            "--export=ALL"} <= set(given), given
    path = fake_commands(tmp_path / "bin", sbatch="echo 'sbatch: error: no account' >&2; exit 1")
    proc = subprocess.run(["bash", "slurm/pack_imagenet.sh"], cwd=ROOT, timeout=30, text=True,
                          capture_output=True, env={**env, "PATH": path})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "could not submit the merge job" in proc.stdout and "shard 0/16" in proc.stdout


# ---------------------------------------------------------------- on a real SLURM cluster

@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    yield from slurm_cluster.running_cluster(tmp_path_factory)


def read_jsonl(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def job_output(cluster, job):
    """The end of the job's SLURM output file, for assertion messages."""
    path = job.get("StdOut")
    if path and os.path.exists(path):
        tail = open(path, errors="replace").read()[-3000:]
        return f"{job['JobId']} {job['JobState']} {job['ExitCode']}:\n{tail}"
    return f"{job['JobId']} {job['JobState']} {job['ExitCode']} (no output file {path})"


def submit(cluster, tmp_path, script, *options, **env):
    env = {"EXTRA_ARGS": SMOKE, **SRUN, **env}
    return cluster.sbatch(os.path.join(ROOT, "slurm", script), *SMALL,
                          f"--output={tmp_path}/slurm-%j.out", *options, env=env, cwd=ROOT)


@pytest.mark.extended
@pytest.mark.parametrize("script", [s for s in SCRIPTS if os.path.basename(s) not in HELPERS],
                         ids=os.path.basename)
def test_sbatch_accepts_full_request(cluster, script):
    """sbatch --test-only: the #SBATCH lines parse and the full request (one node here, with
    enough CPUs and GPUs; multi-node requests squeezed onto it) could be scheduled."""
    options = []
    if sbatch_option(script, "nodes"):
        ntasks = sbatch_option(script, "ntasks")
        options = ["--nodes=1", f"--ntasks-per-node={ntasks}", f"--gpus-per-node={ntasks}"]
    proc = cluster.run("sbatch", "--test-only", *options, script, check=False, cwd=ROOT)
    assert proc.returncode == 0 and "to start at" in proc.stderr, proc.stderr


def test_smoke_job(cluster, tmp_path):
    """The CIFAR RevNet18 script, small: runs 2 ranks under srun and finishes."""
    out = tmp_path / "run"
    jobid = submit(cluster, tmp_path, "revnet18_cifar10.sh", CONFIG="configs/quickstart.yaml",
                   OUT_DIR=str(out))
    (job,) = cluster.wait(jobid, timeout=120)
    log = (out / "logs" / "train.log").read_text() if (out / "logs" / "train.log").exists() else ""
    assert (job["JobState"], job["ExitCode"]) == ("COMPLETED", "0:0"), \
        job_output(cluster, job) + log
    assert any(r["event"] == "train" for r in read_jsonl(out / "metrics.jsonl"))
    summary = json.loads((out / "summary.json").read_text())
    assert summary["stages"] == 2 and summary["epochs"] == 1
    assert "run.resume=auto" in log and ("srun --cpus-per-task=1 --gpu-bind=none "
                                         "--kill-on-bad-exit=1 --wait=60 --mpi=pmi2") in log


@pytest.mark.extended
def test_failing_job_reports_failure(cluster, tmp_path):
    """A trainer error (here an unknown config key) fails the job with the trainer's status."""
    jobid = submit(cluster, tmp_path, "revnet18_cifar10.sh", CONFIG="configs/quickstart.yaml",
                   OUT_DIR=str(tmp_path / "run"), EXTRA_ARGS=SMOKE + " --set model.no_such_key=1")
    (job,) = cluster.wait(jobid, timeout=60)
    assert job["JobState"] == "FAILED" and job["ExitCode"] == "2:0", job_output(cluster, job)
    assert "no_such_key" in (tmp_path / "run" / "logs" / "train.log").read_text()


@pytest.mark.extended
@pytest.mark.parametrize("launcher", ["srun", "mpirun"])
def test_a_stalled_run_ends_as_stalled_whatever_status_the_launcher_passes_on(cluster, tmp_path,
                                                                              launcher):
    """Rank 1 never comes to the first stop vote (tests/programs/faulty_train.py, run in place of
    the trainer through PYTHON): both ranks' watchdogs report, and the job ends as stalled (status
    5; with MAX_REQUEUES=0 it is not requeued), though the launcher may pass on the status of a
    rank it killed after the first exit (mpirun: 9, most times) rather than the watchdog's."""
    wrapper = tmp_path / "python"
    wrapper.write_text(f"""#!/bin/bash
if [[ $1 == -m && $2 == petra_mpi.train ]]; then
    exec {sys.executable} {paths.PROGRAMS / "faulty_train.py"} stall-vote 1 0 "${{@:3}}"
fi
exec {sys.executable} "$@"
""")
    wrapper.chmod(0o755)
    out = tmp_path / "run"
    jobid = submit(cluster, tmp_path, "revnet18_cifar10.sh", CONFIG="configs/quickstart.yaml",
                   OUT_DIR=str(out), EXTRA_ARGS=SMOKE + " --set run.watchdog_s=3",
                   PYTHON=str(wrapper), MAX_REQUEUES="0", LAUNCHER=launcher)
    (job,) = cluster.wait(jobid, timeout=120)
    log = (out / "logs" / "train.log").read_text()
    assert len(re.findall(r"^petra_mpi: watchdog: rank \d .* in the stop vote", log, re.M)) == 2, \
        log[-3000:]
    assert "a rank stopped making progress (exit 5" in log, log[-3000:]
    assert (job["JobState"], job["ExitCode"]) == ("FAILED", "5:0"), job_output(cluster, job)


# A run long enough to signal while it trains.
LONGER = SMOKE.replace("train.limit_batches=8", "train.limit_batches=0").replace(
    "train.epochs=1", "train.epochs=2").replace("synthetic_train=1024", "synthetic_train=6400")


def start_training(cluster, tmp_path):
    """Submit a run long enough to signal, and wait until it trains (a train line in metrics)."""
    out = tmp_path / "run"
    jobid = submit(cluster, tmp_path, "revnet18_cifar10.sh", CONFIG="configs/quickstart.yaml",
                   OUT_DIR=str(out), EXTRA_ARGS=LONGER)
    metrics = out / "metrics.jsonl"

    def training(jobs):
        if jobs[0]["JobState"] in slurm_cluster.TERMINAL:
            raise AssertionError(f"job ended before the signal: {job_output(cluster, jobs[0])}")
        return metrics.exists() and any(r["event"] == "train" for r in read_jsonl(metrics))

    cluster.wait(jobid, training, timeout=90, what="to start training")
    return jobid, out


@pytest.mark.extended
def test_preemption_checkpoints_requeues_and_resumes(cluster, tmp_path):
    """USR1 to the batch shell (as --signal=B:USR1@300 sends it before the time limit): the ranks
    checkpoint and exit 3, the job requeues itself and the requeued job resumes and finishes."""
    jobid, out = start_training(cluster, tmp_path)
    cluster.run("scancel", "--signal=USR1", "--batch", jobid)
    # requeued: pending again with one restart (REQUEUED is the brief state in between)
    cluster.wait(jobid, lambda jobs: (jobs[0]["Restarts"], jobs[0]["JobState"]) == ("1", "PENDING"),
                 timeout=120, what="back requeued")
    # Skip the requeue delay (~2 minutes), but not within the second of the requeue: slurmd
    # refuses a job credential created in the same second as the revocation of the old one.
    time.sleep(2)
    cluster.run("scontrol", "update", f"jobid={jobid}", "starttime=now")
    (job,) = cluster.wait(jobid, timeout=150)
    log = (out / "logs" / "train.log").read_text()
    assert (job["JobState"], job["ExitCode"]) == ("COMPLETED", "0:0"), \
        job_output(cluster, job) + log
    records = read_jsonl(out / "metrics.jsonl")
    resumes = [r for r in records if r["event"] == "resume"]
    assert len(resumes) == 1 and "checkpoints" in resumes[0]["from"], records
    assert "got SIGUSR1" in log and "requeued job" in log and "restart 1" in log, log
    assert (out / "summary.json").exists()


@pytest.mark.extended
def test_scancel_stays_cancelled(cluster, tmp_path):
    """A plain scancel (SIGTERM to every process of the job, SIGKILL KillWait later) cancels the
    job for good: it is never requeued, and the batch script, asking SLURM, says so. Whether the
    ranks finish a checkpoint first is a race with KillWait (docs/clusters.md says not to count
    on it), so only its outcome is checked: a resubmitted job resumes from a complete checkpoint
    or starts afresh, never from a partial one."""
    jobid, out = start_training(cluster, tmp_path)
    cluster.run("scancel", jobid)
    # JobState reads CANCELLED at once; the job is over once its last step (the batch) is gone.
    cluster.wait(jobid, lambda jobs: jobs[0]["JobState"] == "CANCELLED" and not cluster.run(
        "squeue", "-h", "-s", "-j", jobid, check=False).stdout.strip(), timeout=90,
        what="to end its steps")
    (job,) = cluster.jobs(jobid)
    log = (out / "logs" / "train.log").read_text()
    assert job["JobState"] == "CANCELLED" and job["Restarts"] == "0", job_output(cluster, job) + log
    assert "requeued job" not in log and "SLURM requeued" not in log, log
    assert "after SIGTERM (scancel or preemption), not requeueing" in log, log
    complete = [os.path.dirname(m) for m in glob.glob(str(out / "checkpoints" / "*" /
                                                          "manifest.json"))]
    rerun = submit(cluster, tmp_path, "revnet18_cifar10.sh", CONFIG="configs/quickstart.yaml",
                   OUT_DIR=str(out), EXTRA_ARGS=LONGER)
    (job,) = cluster.wait(rerun, timeout=240)
    log = (out / "logs" / "train.log").read_text()
    assert (job["JobState"], job["ExitCode"]) == ("COMPLETED", "0:0"), job_output(cluster, job) + log
    resumed = [os.path.normpath(r["from"]) for r in read_jsonl(out / "metrics.jsonl")
               if r["event"] == "resume"]
    assert set(resumed) <= {os.path.normpath(c) for c in complete}, (resumed, complete, log)


@pytest.mark.extended
def test_term_to_batch_shell_checkpoints_without_requeue(cluster, tmp_path):
    """SIGTERM to the batch shell alone (admin tooling, `scancel -s TERM -b`) while the job runs:
    the shell sends srun SIGUSR1, not the TERM (srun would kill every rank at once), so the ranks
    checkpoint; the job does not requeue and ends with status 4."""
    jobid, out = start_training(cluster, tmp_path)
    cluster.run("scancel", "--signal=TERM", "--batch", jobid)
    (job,) = cluster.wait(jobid, timeout=120)
    log = (out / "logs" / "train.log").read_text()
    assert (job["JobState"], job["ExitCode"], job["Restarts"]) == ("FAILED", "4:0", "0"), \
        job_output(cluster, job) + log
    assert "got SIGTERM: sending SIGUSR1" in log and "not requeueing" in log, log
    assert "received SIGUSR1" in log and "checkpoint complete" in log, log
    assert glob.glob(str(out / "checkpoints" / "*" / "manifest.json")), log


@pytest.mark.extended
def test_term_to_the_ranks_alone_checkpoints_without_requeue(cluster, tmp_path):
    """`scancel --signal=TERM JOB` (no --batch) signals the job's steps but not the batch shell,
    as a preemption's grace time without send_user_signal does: the ranks checkpoint and exit 4
    (not the requeue status), and the script, which got no signal itself, does not requeue the
    job; it ends with status 4."""
    jobid, out = start_training(cluster, tmp_path)
    cluster.run("scancel", "--signal=TERM", jobid)
    (job,) = cluster.wait(jobid, lambda jobs: jobs[0]["Restarts"] != "0"
                          or jobs[0]["JobState"] in slurm_cluster.TERMINAL, timeout=120)
    log = (out / "logs" / "train.log").read_text()
    assert (job["JobState"], job["ExitCode"], job["Restarts"]) == ("FAILED", "4:0", "0"), \
        job_output(cluster, job) + log
    assert "received SIGTERM" in log and "exit status 4" in log, log
    assert "checkpointed after a SIGTERM to the ranks" in log and "requeued job" not in log, log
    assert glob.glob(str(out / "checkpoints" / "*" / "manifest.json")), log


@pytest.mark.extended
def test_term_to_the_whole_job_is_a_stop_not_a_crash(cluster, tmp_path):
    """`scancel --full --signal=TERM JOB`: the batch shell, srun and the ranks get SIGTERM, and
    srun ends the ranks at once (nothing saved). The job stopped on a SIGTERM: status 4, not
    requeued, and no line calls it a crash."""
    jobid, out = start_training(cluster, tmp_path)
    cluster.run("scancel", "--full", "--signal=TERM", jobid)
    (job,) = cluster.wait(jobid, lambda jobs: jobs[0]["Restarts"] != "0"
                          or jobs[0]["JobState"] in slurm_cluster.TERMINAL, timeout=120)
    log = (out / "logs" / "train.log").read_text()
    assert (job["JobState"], job["ExitCode"], job["Restarts"]) == ("FAILED", "4:0", "0"), \
        job_output(cluster, job) + log
    assert "nothing saved after SIGTERM" in log and "crashed" not in log, log


@pytest.mark.extended
def test_launcher_ending_while_the_trap_runs(cluster, tmp_path):
    """The launcher exits (status 3, "checkpointed") while the batch shell's USR1 trap runs,
    i.e. between the interrupted `wait` and the check that it still runs: the script must still
    see status 3 (not 138, 128 + SIGUSR1). A fake trainer stands in for python; a `date` shim,
    which the trap's log line calls, ends it and returns only once srun has exited."""
    race = tmp_path / "race"
    race.mkdir()
    trainer = race / "trainer"
    trainer.write_text(f"#!/bin/bash\ntouch {race}/running.$SLURM_PROCID\n"
                       f"until [[ -e {race}/go ]]; do sleep 0.1; done\nexit 3\n")
    trainer.chmod(0o755)
    # While the batch shell has a live srun child (a zombie has exited), keep waiting. The shim
    # runs in the shell's command substitution: its parent is the shell, or a subshell of it.
    alive_srun = ("ps -o stat=,comm= --ppid $PPID,$(ps -o ppid= -p $PPID | tr -d ' ') | "
                  "awk '$1 !~ /^Z/ && $2 == \"srun\"' | grep -q .")
    path = fake_commands(race / "bin", date=(
        f'if rm {race}/armed 2>/dev/null; then\n  touch {race}/go\n'
        f'  while {alive_srun}; do sleep 0.1; done\nfi\nexec /bin/date "$@"'))
    out = tmp_path / "run"
    jobid = submit(cluster, tmp_path, "revnet18_cifar10.sh", CONFIG="configs/quickstart.yaml",
                   OUT_DIR=str(out), PYTHON=str(trainer), PATH=path, MAX_REQUEUES="0")
    cluster.wait(jobid, lambda jobs: (race / "running.0").exists()
                 or jobs[0]["JobState"] in slurm_cluster.TERMINAL, timeout=90, what="to start")
    (race / "armed").touch()
    cluster.run("scancel", "--signal=USR1", "--batch", jobid)
    (job,) = cluster.wait(jobid, timeout=60)
    log = (out / "logs" / "train.log").read_text()
    assert not (race / "armed").exists(), "the trap never ran: " + log
    assert (job["JobState"], job["ExitCode"]) == ("FAILED", "3:0"), job_output(cluster, job) + log
    assert "checkpointed, not requeueing" in log and "status 138" not in log, log


@pytest.fixture
def affinity_cluster(tmp_path_factory):
    """A cluster whose node claims only this machine's CPUs, so task/affinity binds tasks."""
    why = slurm_cluster.missing()
    if why:
        pytest.skip(why)
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("binding needs 2 CPUs to show a task's share")
    c = slurm_cluster.Cluster(tmp_path_factory.mktemp("slurm_affinity"),
                              cpus=len(os.sched_getaffinity(0)),
                              task_plugin="task/affinity").start()
    yield c
    c.stop()


@pytest.mark.extended
def test_ranks_get_their_cpus_per_task(affinity_cluster, tmp_path):
    """With CPU binding on (task/affinity), a rank sees the job's --cpus-per-task CPUs: srun
    22.05-23.02 ignores SLURM_CPUS_PER_TASK and would bind it to one."""
    trainer = tmp_path / "trainer"
    trainer.write_text(f"#!/bin/bash\nnproc >{tmp_path}/cpus.$SLURM_PROCID\n")
    trainer.chmod(0o755)
    jobid = affinity_cluster.sbatch(
        os.path.join(ROOT, "slurm", "revnet18_cifar10.sh"), "--nodes=1", "--ntasks=1",
        "--ntasks-per-node=1", "--gpus-per-node=1", "--cpus-per-task=2",
        f"--output={tmp_path}/slurm-%j.out", cwd=ROOT,
        env={"CONFIG": "configs/quickstart.yaml", "OUT_DIR": str(tmp_path / "run"),
             "PYTHON": str(trainer), **SRUN})
    (job,) = affinity_cluster.wait(jobid, timeout=90)
    assert job["JobState"] == "COMPLETED", job_output(affinity_cluster, job)
    assert (tmp_path / "cpus.0").read_text().strip() == "2"


@pytest.mark.extended
def test_replicas_job(cluster, tmp_path):
    """The replicas script, small: 2 tasks under srun as 2 replicas of a 1-stage net."""
    out = tmp_path / "run"
    jobid = submit(cluster, tmp_path, "revnet50_imagenet_2replicas.sh", "--nodes=1",
                   "--ntasks-per-node=2", CONFIG="configs/quickstart.yaml", OUT_DIR=str(out),
                   EXTRA_ARGS=SMOKE + " --set train.replicas=2")
    (job,) = cluster.wait(jobid, timeout=120)
    log = (out / "logs" / "train.log").read_text() if (out / "logs" / "train.log").exists() else ""
    assert (job["JobState"], job["ExitCode"]) == ("COMPLETED", "0:0"), \
        job_output(cluster, job) + log
    summary = json.loads((out / "summary.json").read_text())
    assert (summary["replicas"], summary["stages"]) == (2, 1)
    assert "2 replicas x 1 stages" in log


@pytest.mark.extended
def test_job_array(cluster, tmp_path):
    """Two tasks of the Table 4 array, both pointed at the small config, under mpirun."""
    out = tmp_path / "arr"
    jobid = submit(cluster, tmp_path, "table4_revnet18.sh", "--array=0-1",
                   f"--output={tmp_path}/slurm-%A_%a.out", CONFIG="configs/quickstart.yaml",
                   OUT_DIR=str(out), LAUNCHER="mpirun")
    jobs = cluster.wait(jobid, timeout=150)
    assert len(jobs) == 2 and all(j["JobState"] == "COMPLETED" for j in jobs), \
        "\n".join(job_output(cluster, j) for j in jobs)
    for task in (0, 1):
        summary = json.loads((out / f"task{task}" / "summary.json").read_text())
        assert summary["stages"] == 2
        assert "mpirun -n 2" in (out / f"task{task}" / "logs" / "train.log").read_text()


@pytest.mark.extended
def test_pack_imagenet_array_and_merge(cluster, tmp_path):
    """pack_imagenet.sh: two shard tasks, then the merge job that the first task queued."""
    from tests.support.upstream_formats import make_imagenet
    make_imagenet(tmp_path / "src", val_folders=True)
    merged = tmp_path / "imagenet.h5"
    env = {"SOURCE": str(tmp_path / "src"), "OUT": str(merged), "PARTS": str(tmp_path / "parts"),
           "SHARDS": "2", "PACK_ARGS": "--size 40", "PYTHON": sys.executable}
    jobid = cluster.sbatch(os.path.join(ROOT, "slurm", "pack_imagenet.sh"), "--array=0-1",
                           "--cpus-per-task=1", "--account=petra_project", "--partition=debug",
                           f"--output={tmp_path}/slurm-%A_%a.out", env=env, cwd=ROOT)
    jobs = cluster.wait(jobid, timeout=120)
    assert all(j["JobState"] == "COMPLETED" for j in jobs), \
        "\n".join(job_output(cluster, j) for j in jobs)
    merge = cluster.run("squeue", "-h", "-t", "all", "-n", "pack_imagenet_merge", "-o", "%i")
    merge = merge.stdout.split()
    assert len(merge) == 1
    (job,) = cluster.wait(merge[0], timeout=60)
    assert job["JobState"] == "COMPLETED", job_output(cluster, job)
    # queued under the array's account and partition (where -A is mandatory, it must be)
    assert (job["Account"], job["Partition"]) == ("petra_project", "debug"), job
    verify = subprocess.run([sys.executable, "-m", "petra_mpi.prep.verify", str(merged)], cwd=ROOT,
                            capture_output=True, text=True, timeout=60)
    assert verify.returncode == 0, verify.stdout + verify.stderr


def test_array_tasks_get_their_own_run_dir_under_out_dir():
    """OUT_DIR given to a job array of several configs: each task runs in OUT_DIR/<config name>,
    so tasks running at once never share checkpoints or metrics (nor resume each other's)."""
    script = os.path.join(ROOT, "slurm", "fig4_revnet18_imagenet.sh")
    line = next(ln for ln in open(script) if ln.startswith("CONFIGS="))
    dirs = []
    for task, config in enumerate(script_configs(script)):
        got = resolve({"SLURM_ARRAY_TASK_ID": str(task), "OUT_DIR": "/scratch/u/fig4"}, line)
        name = os.path.basename(config)[:-len(".yaml")]
        assert got == [config, f"/scratch/u/fig4/{name}"]
        dirs.append(got[1])
    assert len(set(dirs)) == len(dirs) > 1
    # every array script's configs have distinct names, hence distinct run dirs
    for path in EXPERIMENTS:
        names = [os.path.basename(c) for c in script_configs(path)]
        assert len(set(names)) == len(names), path


# Table 4's configs (CIFAR-100) on the synthetic set, small
TABLE4_SMALL = SMOKE + " --set data.path=synthetic --set model.num_classes=10"


@pytest.mark.extended
def test_array_under_one_out_dir_runs_and_resumes_each_config_apart(cluster, tmp_path):
    """Two tasks of the Table 4 array (two configs) with OUT_DIR set run at once, each in
    OUT_DIR/<config name>; submitted again for a second epoch, each resumes its own checkpoint."""
    out = tmp_path / "table4"
    configs = script_configs(os.path.join(ROOT, "slurm", "table4_revnet18.sh"))[:2]
    names = [os.path.basename(c)[:-len(".yaml")] for c in configs]
    for epochs in (1, 2):
        jobid = submit(cluster, tmp_path, "table4_revnet18.sh", "--array=0-1",
                       f"--output={tmp_path}/slurm-%A_%a.out", OUT_DIR=str(out),
                       EXTRA_ARGS=TABLE4_SMALL.replace("train.epochs=1", f"train.epochs={epochs}"))
        jobs = cluster.wait(jobid, timeout=240)
        assert all(j["JobState"] == "COMPLETED" for j in jobs), \
            "\n".join(job_output(cluster, j) for j in jobs)
    for config, name in zip(configs, names):
        run = out / name
        records = read_jsonl(run / "metrics.jsonl")
        starts = [r for r in records if r["event"] in ("start", "resume")]
        assert [r["event"] for r in starts] == ["start", "resume"], records
        assert starts[1]["from"].startswith(str(run / "checkpoints")), starts[1]
        assert json.loads((run / "summary.json").read_text())["epochs"] == 2
        assert config in (run / "logs" / "train.log").read_text()


@pytest.mark.extended
def test_a_site_exporting_nothing(cluster, tmp_path):
    """Where jobs are submitted with --export=NONE (SBATCH_EXPORT=NONE): slurm/submit.sh still
    passes CONFIG, EXTRA_ARGS and OUT_DIR on to the job; and srun starts the ranks with the batch
    shell's environment (the site block's modules and Python environment), which a rank here
    checks through a variable the script exports, as a site block would."""
    out = tmp_path / "submitted"
    env = {**cluster.env, **SRUN, "SBATCH_EXPORT": "NONE", "CONFIG": "configs/quickstart.yaml",
           "OUT_DIR": str(out), "EXTRA_ARGS": SMOKE, "PYTHON": sys.executable}
    proc = subprocess.run(["bash", "slurm/submit.sh", "slurm/revnet18_cifar10.sh", *SMALL,
                           "--parsable", f"--output={tmp_path}/slurm-%j.out"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    submitted = proc.stdout.split()[-1]

    python = tmp_path / "python"
    python.write_text("#!/bin/bash\n[[ $SITE_MODULE == loaded ]] || "
                      "{ echo 'a rank without the batch shell environment' >&2; exit 42; }\n"
                      f'exec {sys.executable} "$@"\n')
    python.chmod(0o755)
    site = tmp_path / "site_job.sh"
    site.write_text(f"""#!/bin/bash
#SBATCH --requeue
export SITE_MODULE=loaded CONFIG=configs/quickstart.yaml OUT_DIR={tmp_path}/site EXTRA_ARGS="{SMOKE}"
export PYTHON={python} LAUNCHER=srun SRUN_MPI=pmi2
source {ROOT}/slurm/common.sh
petra_train
""")
    exported_nothing = cluster.sbatch(str(site), *SMALL, "--export=NONE",
                                      f"--output={tmp_path}/slurm-%j.out", cwd=ROOT)
    runs = {submitted: out, exported_nothing: tmp_path / "site"}
    ended = {jobid: cluster.wait(jobid, timeout=150)[0] for jobid in runs}
    for jobid, run in runs.items():
        log = run / "logs" / "train.log"
        assert (ended[jobid]["JobState"], ended[jobid]["ExitCode"]) == ("COMPLETED", "0:0"), \
            "\n".join(job_output(cluster, job) for job in ended.values()) + \
            (log.read_text() if log.exists() else "")
        assert json.loads((run / "summary.json").read_text())["stages"] == 2
    assert "--export=NONE" in open(cluster.job(exported_nothing)["StdOut"]).read()


@pytest.mark.extended
def test_mpirun_starts_its_ranks_without_srun(cluster, tmp_path):
    """LAUNCHER=mpirun: Hydra forks the ranks in the batch step, never through an `srun -n1`
    proxy step (which SLURM 22.05-23.02 gives one CPU, for every rank). While both ranks run,
    the job has no step but the batch shell's."""
    trainer = tmp_path / "trainer"
    trainer.write_text(f"#!/bin/bash\ntouch {tmp_path}/running.$PMI_RANK\n"
                       f"until [[ -e {tmp_path}/go ]]; do sleep 0.1; done\n")
    trainer.chmod(0o755)
    jobid = submit(cluster, tmp_path, "revnet18_cifar10.sh", CONFIG="configs/quickstart.yaml",
                   OUT_DIR=str(tmp_path / "run"), PYTHON=str(trainer), LAUNCHER="mpirun")
    cluster.wait(jobid, lambda jobs: all((tmp_path / f"running.{r}").exists() for r in (0, 1))
                 or jobs[0]["JobState"] in slurm_cluster.TERMINAL, timeout=90, what="to start")
    steps = cluster.run("squeue", "-h", "-s", "-j", jobid, "-o", "%i").stdout.split()
    (tmp_path / "go").touch()
    (job,) = cluster.wait(jobid, timeout=60)
    assert (job["JobState"], job["ExitCode"]) == ("COMPLETED", "0:0"), job_output(cluster, job)
    assert [s for s in steps if not s.endswith((".batch", ".extern"))] == [], steps


def waiting_trainer(tmp_path):
    """A stand-in for the trainer (through PYTHON): each rank says it runs (a file named by job
    and rank), then waits for the file `go` and exits 0."""
    trainer = tmp_path / "trainer"
    trainer.write_text(f"#!/bin/bash\ntouch {tmp_path}/running.$SLURM_JOB_ID.$SLURM_PROCID\n"
                       f"until [[ -e {tmp_path}/go ]]; do sleep 0.1; done\n")
    trainer.chmod(0o755)
    return str(trainer)


def wait_running(cluster, jobid, tmp_path):
    cluster.wait(jobid, lambda jobs: all((tmp_path / f"running.{jobid}.{r}").exists()
                                         for r in (0, 1))
                 or jobs[0]["JobState"] in slurm_cluster.TERMINAL, timeout=90, what="to start")


@pytest.mark.extended
def test_one_job_per_run_directory(cluster, tmp_path):
    """A job given the run directory of a job still running refuses to start (status 2, naming
    that job) rather than train beside it on one set of checkpoints; once that job has ended,
    the next one runs."""
    env = {"CONFIG": "configs/quickstart.yaml", "OUT_DIR": str(tmp_path / "run"),
           "PYTHON": waiting_trainer(tmp_path)}
    first = submit(cluster, tmp_path, "revnet18_cifar10.sh", **env)
    wait_running(cluster, first, tmp_path)
    second = submit(cluster, tmp_path, "revnet18_cifar10.sh", **env)
    (job,) = cluster.wait(second, timeout=60)
    assert (job["JobState"], job["ExitCode"]) == ("FAILED", "2:0"), job_output(cluster, job)
    assert f"is the run directory of job {first} (RUNNING)" in open(job["StdOut"]).read()
    assert not list(tmp_path.glob(f"running.{second}.*"))
    (tmp_path / "go").touch()
    (job,) = cluster.wait(first, timeout=60)
    assert (job["JobState"], job["ExitCode"]) == ("COMPLETED", "0:0"), job_output(cluster, job)
    third = submit(cluster, tmp_path, "revnet18_cifar10.sh", **env)
    (job,) = cluster.wait(third, timeout=60)
    assert (job["JobState"], job["ExitCode"]) == ("COMPLETED", "0:0"), job_output(cluster, job)


def requeued(jobs):
    return (jobs[0]["Restarts"], jobs[0]["JobState"]) == ("1", "PENDING")


@pytest.mark.extended
def test_a_requeue_that_reports_failure_but_happened(cluster, tmp_path):
    """`scontrol requeue` requeues the job but exits 1 (as when it is killed before it answers):
    the script sees the job requeued, and does not tell the user to resubmit."""
    trainer = tmp_path / "trainer"
    trainer.write_text("#!/bin/bash\nexit 3\n")  # "checkpointed: requeue me"
    trainer.chmod(0o755)
    scontrol = shutil.which("scontrol")
    path = fake_commands(tmp_path / "bin", scontrol=(
        f'if [[ $1 == requeue ]]; then {scontrol} "$@"; exit 1; fi\nexec {scontrol} "$@"'))
    out = tmp_path / "run"
    jobid = submit(cluster, tmp_path, "revnet18_cifar10.sh", CONFIG="configs/quickstart.yaml",
                   OUT_DIR=str(out), PYTHON=str(trainer), PATH=path)
    cluster.wait(jobid, requeued, timeout=90, what="back requeued")
    cluster.run("scancel", jobid)
    log = (out / "logs" / "train.log").read_text()
    assert "requeued job" in log and "resubmit" not in log, log


@pytest.mark.extended
def test_usr1_before_the_ranks_handle_it_still_requeues(cluster, tmp_path):
    """A SIGUSR1 that reaches the ranks before they installed their handler (here: ranks with
    none) ends them; the job requeues all the same, and resumes from its last checkpoint."""
    out = tmp_path / "run"
    jobid = submit(cluster, tmp_path, "revnet18_cifar10.sh", CONFIG="configs/quickstart.yaml",
                   OUT_DIR=str(out), PYTHON=waiting_trainer(tmp_path))
    wait_running(cluster, jobid, tmp_path)
    cluster.run("scancel", "--signal=USR1", "--batch", jobid)
    cluster.wait(jobid, requeued, timeout=90, what="back requeued")
    cluster.run("scancel", jobid)
    log = (out / "logs" / "train.log").read_text()
    assert "after SIGUSR1, before it could checkpoint" in log and "requeued job" in log, log


@pytest.mark.extended
def test_ranks_of_a_cpus_per_gpu_job_get_their_cpus(affinity_cluster, tmp_path):
    """A script that asks --cpus-per-gpu in place of --cpus-per-task (the two exclude each other;
    the job then has no SLURM_CPUS_PER_TASK): each rank, one GPU each, gets that many CPUs, not
    one."""
    trainer = tmp_path / "trainer"
    trainer.write_text(f"#!/bin/bash\nnproc >{tmp_path}/cpus.$SLURM_PROCID\n")
    trainer.chmod(0o755)
    script = tmp_path / "per_gpu.sh"
    text = open(os.path.join(ROOT, "slurm", "revnet18_cifar10.sh")).read()
    script.write_text(re.sub(r"(?m)^#SBATCH --cpus-per-task=\d+$", "#SBATCH --cpus-per-gpu=2",
                             text))
    jobid = affinity_cluster.sbatch(
        str(script), "--nodes=1", "--ntasks=1", "--ntasks-per-node=1", "--gpus-per-node=1",
        f"--output={tmp_path}/slurm-%j.out", cwd=ROOT,
        env={"CONFIG": "configs/quickstart.yaml", "OUT_DIR": str(tmp_path / "run"),
             "PYTHON": str(trainer), **SRUN})
    (job,) = affinity_cluster.wait(jobid, timeout=90)
    assert job["JobState"] == "COMPLETED", job_output(affinity_cluster, job)
    assert (tmp_path / "cpus.0").read_text().strip() == "2"


# ---------------------------------------------------------------- how a launch's end is read
# The batch script as a job runs it, with a fake srun that prints what a real one prints at the
# end of a step (the ranks' lines, then its own "task N: ..." lines, first task first) and a fake
# scontrol that records what it is asked.

STALL_REPORT = ("petra_mpi: watchdog: rank 0 (n1, stage 0): no progress for 3 s (run.watchdog_s) "
                "after tick 5, forward of micro-batch 5; waiting on the receive of gradient from "
                "rank 1 (n2): that rank or its node is lost or stalled; exit status 5")
RANK_MAP = printed_rank_map(["n1", "n2"]).splitlines()  # the launch's own, printed at start-up


def end_of_step(tmp_path, lines, srun_status, SRUN_BODY="", JOB="JobState=COMPLETED",
                DOWN="", **env):
    """Run the batch script with an srun that prints `lines` (after running SRUN_BODY) and exits
    `srun_status`, SLURM's view of the job `JOB` (in `scontrol -o show job`) and the nodes that
    SLURM marks down `DOWN` (sinfo); returns (the script's result, the scontrol commands it ran,
    its log)."""
    calls = tmp_path / "scontrol.calls"
    calls.unlink(missing_ok=True)
    printed = tmp_path / "srun.out"
    printed.write_text("".join(line + "\n" for line in lines))
    path = fake_commands(
        tmp_path / "bin", srun=f"{SRUN_BODY}\ncat {printed} >&2; exit {srun_status}",
        scontrol=f'echo "$@" >>{calls}\n'
                 'if [[ $1 == -o ]]; then\n'
                 f'    echo "JobId=$4 {JOB} ExcNodeList=(null)"\nfi',
        sinfo=f'[[ $* == *down* ]] && printf "%s\\n" {DOWN}')
    proc = run_batch_script(tmp_path, path, PYTHON=sys.executable, **env)
    log = (tmp_path / "run" / "logs" / "train.log").read_text()
    return proc, calls.read_text().splitlines() if calls.exists() else [], log


def test_a_stall_is_read_from_the_first_rank_out_diagnosed_and_its_node_excluded(tmp_path):
    """srun passes on the status of a rank it killed (137): the first task's exit code, 5, says
    the run stalled. The reports name rank 1 on n2, which never reported: the job is requeued and
    kept off n2."""
    proc, calls, log = end_of_step(tmp_path, [
        *RANK_MAP, STALL_REPORT, "srun: error: n1: task 0: Exited with exit code 5",
        "srun: launch/slurm: _step_signal: Terminating StepId=7.0",
        "srun: error: n2: task 1: Killed"], 137)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "watchdog reports: rank 1 on n2 is lost or stalled: rank 1 did not report" in log, log
    assert calls == ["requeue 7", "-o show job 7", "update jobid=7 ExcNodeList=n2"], calls


def test_a_checkpointed_stop_is_read_from_the_first_rank_out(tmp_path):
    """Every rank exits 3 after a checkpoint, but srun ends the others once the first is out:
    srun's own status is theirs (143), and the job must still requeue."""
    proc, calls, log = end_of_step(tmp_path, [
        "stopped on request at epoch 1, micro-batch 8: checkpoint complete, exit status 3",
        "srun: error: n1: task 1: Exited with exit code 3",
        "srun: error: n1: task 0: Terminated"], 143)
    assert proc.returncode == 0 and calls == ["requeue 7"], proc.stdout + log


def test_a_crashed_rank_fails_the_job_though_a_watchdog_reported_after_it(tmp_path):
    """Rank 1 segfaults; rank 0, left waiting on it until srun's kill lands, reports through its
    watchdog: a crash, not a stall, so no requeue (it would crash again, MAX_REQUEUES times)."""
    proc, calls, log = end_of_step(tmp_path, [
        "srun: error: n2: task 1: Segmentation fault", STALL_REPORT,
        "srun: error: n1: task 0: Exited with exit code 5"], 143)
    assert proc.returncode == 143 and not asked_to_requeue(calls), proc.stdout + log
    assert "a rank crashed, n2: task 1: Segmentation fault" in log, log


# srun prints its lines (srun.out), then SLURM's SIGTERM reaches the batch shell while srun waits
# on a lost node, until the shell's SIGUSR1 ends it
SIGTERM_WHILE_SRUN_WAITS = 'cat "$(dirname "$0")/../srun.out" >&2; kill -TERM $PPID; exec sleep 60'
# rank 3's report in the stop vote, where the heartbeats of n3's ranks had stopped
VOTE_REPORT = ("petra_mpi: watchdog: rank 3 (n2, stage 3): no progress for 5 s (run.watchdog_s) "
               "in the stop vote, a collective of every rank: no heartbeat from ranks 4–5 (n3, all "
               "of its ranks) for 7 s and from rank 2 (n2) for 6 s: lost or stalled; exit "
               "status 5")


@pytest.mark.parametrize("slurm", ["node failure", "scancel"])
def test_after_slurms_sigterm_the_script_says_what_slurm_does_with_the_job(tmp_path, slurm):
    """SLURM sends the batch shell SIGTERM while srun still waits: a rank on n2 crashed after
    n3 was lost in the stop vote, and rank 3's watchdog named n3's ranks. On a node failure
    SLURM has requeued the job already (`scontrol show job`: its restart count grew; sinfo: n3
    down): the script says so, names n3, and neither requeues the job nor calls it cancelled.
    After a scancel (the count as it was) the job stays cancelled: status 4, resubmit."""
    requeued = slurm == "node failure"
    proc, calls, log = end_of_step(
        tmp_path, printed_rank_map(["n1", "n1", "n2", "n2", "n3", "n3"]).splitlines()
        + ["srun: error: n2: task 2: Segmentation fault", VOTE_REPORT], 139,
        SRUN_BODY=SIGTERM_WHILE_SRUN_WAITS,
        JOB=f"JobState=COMPLETING Reason=None Restarts={int(requeued)}",
        DOWN="n3" if requeued else "", SLURM_JOB_NODELIST="n[1-3]")
    said = [line.split("] ", 1)[1] for line in log.splitlines() if line.startswith("[petra ")]
    assert "watchdog reports: rank 4 on n3 is lost or stalled: ranks 4–5 did not report" in said
    assert not asked_to_requeue(calls), calls
    if requeued:
        assert proc.returncode == 0, proc.stdout + log
        assert ("SLURM requeued job 7 (node failure: n3 down): it resumes from its last complete "
                f"checkpoint in {tmp_path / 'run'}/checkpoints") in said, said
        assert said[-1] == "nothing saved; SLURM requeued the job itself", said
        assert not any("not requeueing" in line for line in said), said
    else:
        assert proc.returncode == 4, proc.stdout + log
        assert said[-1] == ("nothing saved after SIGTERM (scancel or preemption), not requeueing: "
                            "resubmit the same script to resume"), said
        assert not any("SLURM requeued" in line for line in said), said


def test_a_rank_killed_after_its_start_up_report_is_a_stall_not_a_crash(tmp_path):
    """Rank 1 hangs in its start-up holding the interpreter: its watcher reports, and has to
    SIGKILL it when even the exit it asked for cannot run. srun's first line says "Killed", but
    the report came first: the run stalled (requeued), it did not crash."""
    report = startup_report("rank 1 (n2)", 600, "opening the data (data/x.h5)")
    proc, calls, log = end_of_step(tmp_path, [
        *RANK_MAP, report, "srun: error: n2: task 1: Killed",
        "srun: launch/slurm: _step_signal: Terminating StepId=7.0",
        "srun: error: n1: task 0: Killed"], 137)
    assert proc.returncode == 0 and calls[0] == "requeue 7", proc.stdout + log
    assert "a rank stopped making progress (exit 5" in log and "crashed" not in log, log


def test_a_rank_killed_after_the_trainers_final_line_does_not_undo_it(tmp_path):
    """The ranks checkpointed and the writer printed its final line; then a rank that could not
    exit was killed (srun's first line: Killed). The checkpoint is complete: the job requeues as
    after any checkpointed stop, and a finished run ends as finished."""
    proc, calls, log = end_of_step(tmp_path, [
        "stopped on request at epoch 1, micro-batch 8: checkpoint complete, exit status 3 "
        "(requeue to resume with run.resume=auto)", "srun: error: n2: task 1: Killed"], 137)
    assert proc.returncode == 0 and calls == ["requeue 7"], proc.stdout + log
    proc, calls, log = end_of_step(tmp_path, [
        "done in 0:12: val acc 0.1000 (best 0.1000); outputs in runs/x",
        "srun: error: n2: task 1: Killed"], 137)
    assert proc.returncode == 0 and calls == [] and "finished: " in log, proc.stdout + log


def test_a_usr1_that_ended_the_ranks_before_they_listened_saves_nothing_and_says_so(tmp_path):
    """SIGUSR1 reaches the batch shell, whose srun ends with it (status 138) before any rank
    could checkpoint: the job requeues, and no line claims a checkpoint."""
    proc, calls, log = end_of_step(tmp_path, [], "138", SRUN_BODY="kill -USR1 $PPID; sleep 5")
    assert proc.returncode == 0 and calls == ["requeue 7"], proc.stdout + log
    said = [line for line in log.splitlines() if line.startswith("[petra ")]
    assert any("nothing saved; requeued job 7" in line for line in said), log
    assert not any("checkpointed" in line for line in said), log


def test_the_stall_budget_ends_a_job_that_stalls_again_without_progress(tmp_path):
    """STALL_RESTARTS=2: two requeues after stalls with no newer complete checkpoint, and the
    third stall ends the job (status 5); a new checkpoint, or another job, starts the count
    again."""
    stall = [STALL_REPORT, "srun: error: n1: task 0: Exited with exit code 5"]
    for _ in range(2):
        proc, calls, log = end_of_step(tmp_path, stall, 5)
        assert proc.returncode == 0 and calls[0] == "requeue 7", proc.stdout + log
    proc, calls, log = end_of_step(tmp_path, stall, 5)
    assert proc.returncode == 5 and not asked_to_requeue(calls), proc.stdout + log
    assert ("not requeueing: 3 stall(s) in a row with no newer complete checkpoint than none "
            "(STALL_RESTARTS=2)") in log, log
    checkpoint = tmp_path / "run" / "checkpoints" / "ckpt-e00001-b00000000"
    checkpoint.mkdir(parents=True)
    (checkpoint / "manifest.json").write_text("{}")
    proc, calls, log = end_of_step(tmp_path, stall, 5)
    assert proc.returncode == 0 and calls[0] == "requeue 7", proc.stdout + log
    proc, calls, log = end_of_step(tmp_path, stall, 5, STALL_RESTARTS="1")
    assert proc.returncode == 5 and not asked_to_requeue(calls), proc.stdout + log
    proc, calls, log = end_of_step(tmp_path, stall, 5, STALL_RESTARTS="1", SLURM_JOB_ID="8")
    assert proc.returncode == 0 and asked_to_requeue(calls), proc.stdout + log


def test_a_checkpoint_set_aside_as_unreadable_is_no_progress(tmp_path):
    """A checkpoint the trainer set aside (ckpt-...corrupt, complete by its manifest but
    unreadable) is not a newer checkpoint: with STALL_RESTARTS=1 the second stall in a row ends
    the job."""
    stall = [STALL_REPORT, "srun: error: n1: task 0: Exited with exit code 5"]
    proc, calls, log = end_of_step(tmp_path, stall, 5, STALL_RESTARTS="1")
    assert proc.returncode == 0 and calls[0] == "requeue 7", proc.stdout + log
    aside = tmp_path / "run" / "checkpoints" / "ckpt-e00002-b00000000.corrupt"
    aside.mkdir(parents=True)
    (aside / "manifest.json").write_text("{}")
    proc, calls, log = end_of_step(tmp_path, stall, 5, STALL_RESTARTS="1")
    assert proc.returncode == 5 and not asked_to_requeue(calls), proc.stdout + log
    assert "2 stall(s) in a row with no newer complete checkpoint than none" in log, log


def with_common(tmp_path, code, path, **env):
    """`code` run in bash after sourcing slurm/common.sh as job 7 with the run directory
    tmp_path/run, commands first looked up on `path`: the finished process."""
    env = {"PATH": path, "SLURM_JOB_ID": "7", "OUT_DIR": str(tmp_path / "run"), **env}
    return subprocess.run(["bash", "-c", f"source slurm/common.sh && mkdir -p $OUT_DIR/logs && "
                                         f"{code}"], cwd=ROOT, env=env, timeout=60,
                          capture_output=True, text=True)


def test_the_hosts_a_job_is_kept_off_are_capped(tmp_path):
    """Stall after stall, each blaming another host: the job is kept off at most EXCLUDE_MAX (2)
    of them, the newest blamed (a list that grows with each could leave too few nodes for a job
    of fixed size); the host it was submitted without (u9) stays excluded. A stand-in scontrol
    keeps the job's ExcNodeList."""
    listed = tmp_path / "ExcNodeList"
    listed.write_text("u9")
    path = fake_commands(tmp_path / "bin", scontrol=f"""
case $1 in
    -o) echo "JobId=7 JobState=PENDING ExcNodeList=$(cat {listed}) Partition=p" ;;
    show) tr , '\\n' <<<"$3" ;;
    update) echo "${{3#ExcNodeList=}}" >{listed} ;;
esac""")
    kept = []
    for host in ("n1", "n2", "n3", "n2", "n4"):
        proc = with_common(tmp_path, f"petra_exclude {host}", path)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        kept.append(set(listed.read_text().strip().split(",")))
    assert kept == [{"u9", "n1"}, {"u9", "n1", "n2"}, {"u9", "n2", "n3"}, {"u9", "n2", "n3"},
                    {"u9", "n2", "n4"}]
    assert "(allowed again: n3; EXCLUDE_MAX=2)" in proc.stdout, proc.stdout


def test_of_two_jobs_starting_on_one_run_directory_one_takes_it(tmp_path):
    """Jobs 8 and 9 start on one run directory at once, both finding it free, or both finding
    it held by job 5, which has ended: exactly one of them takes it, the other refuses to run
    beside it. A stand-in `mv` holds each job until both have got there, so that neither check
    can be over before the other has begun."""
    state = {"5": "COMPLETED", "8": "RUNNING", "9": "RUNNING"}
    arrived = tmp_path / "arrived"
    arrived.mkdir()
    path = fake_commands(tmp_path / "bin", scontrol=(
        'case $4 in ' + " ".join(f"{j}) echo \"JobId={j} JobState={s} \" ;;"
                                 for j, s in state.items()) + ' esac'),
        mv=(f'touch {arrived}/$$\nfor i in $(seq 50); do (($(ls {arrived} | wc -l) >= 2)) && '
            f'break; sleep 0.1; done\nexec /bin/mv "$@"'))
    lock = tmp_path / "run" / "logs" / "job"
    for before in (None, "5"):
        (tmp_path / "run" / "logs").mkdir(parents=True, exist_ok=True)
        lock.unlink(missing_ok=True)
        for f in arrived.iterdir():
            f.unlink()
        if before:
            lock.write_text(before + "\n")
        with ThreadPoolExecutor(2) as pool:
            done = list(pool.map(lambda job: with_common(tmp_path, "petra_lock", path,
                                                         SLURM_JOB_ID=job), ("8", "9")))
        statuses = sorted(p.returncode for p in done)
        assert statuses == [0, 2], [p.stdout + p.stderr for p in done]
        winner = ("8", "9")[[p.returncode for p in done].index(0)]
        assert lock.read_text().split() == [winner]
        loser = next(p for p in done if p.returncode)
        assert f"is the run directory of job {winner} (RUNNING)" in loser.stdout, loser.stdout


def tagged_processes(tag):
    """The pids of the processes whose environment holds `tag` (NAME=value)."""
    pids = []
    for environ in glob.glob("/proc/[0-9]*/environ"):
        try:
            with open(environ, "rb") as f:
                if tag.encode() in f.read().split(b"\0"):
                    pids.append(int(environ.split("/")[2]))
        except OSError:
            pass
    return pids


@pytest.mark.extended
@pytest.mark.parametrize("end", ["crash", "final line"])
def test_an_mpirun_that_cannot_end_is_ended_with_every_process_under_it(tmp_path, end):
    """LAUNCHER=mpirun with a stand-in trainer (through PYTHON) and no watchdog report; mpirun
    cannot end by itself. "crash": rank 0 dies of SIGKILL (an OOM kill), and a process in a
    session of its own holds rank 1's output, as one stuck in the kernel would. "final line":
    the writer prints its final line (a checkpointed stop) and no rank exits. Once a rank's
    process ended, or the final line is in the log, the script gives mpirun STUCK_GRACE_S, then
    ends mpirun and every process under it (its proxy and the ranks, each in a session of its
    own): the crash fails the job with mpirun's status, the stop requeues it. (Rank 0 lives 6 s:
    three looks of the script at the ranks' processes.)"""
    tag = f"PETRA_TEST_TAG={os.getpid()}.{tmp_path.name}"
    holder = tmp_path / "holder"
    trainer = tmp_path / "trainer"
    trainer.write_text(f"""#!/bin/bash
touch {tmp_path}/running.$PMI_RANK
until [[ -e {tmp_path}/running.0 && -e {tmp_path}/running.1 ]]; do sleep 0.1; done
if [[ {end!r} == crash && $PMI_RANK == 1 ]]; then setsid sleep 300 & echo $! >{holder}; fi
if [[ {end!r} == crash && $PMI_RANK == 0 ]]; then sleep 6; kill -KILL $$; fi
if [[ {end!r} != crash && $PMI_RANK == 1 ]]; then
    echo "stopped on request at epoch 1, micro-batch 8: checkpoint complete, exit status 3" >&2
fi
sleep 300
""")
    trainer.chmod(0o755)
    calls = tmp_path / "scontrol.calls"
    path = fake_commands(tmp_path / "bin", scontrol=f'echo "$@" >>{calls}')
    env = {"PATH": path, "SLURM_JOB_ID": "7", "SLURM_NTASKS": "2",
           "CONFIG": "configs/quickstart.yaml", "OUT_DIR": str(tmp_path / "run"),
           "LAUNCHER": "mpirun", "PYTHON": str(trainer),
           "STUCK_GRACE_S": "2", tag.split("=")[0]: tag.split("=")[1]}
    proc = subprocess.Popen(["bash", "slurm/revnet18_cifar10.sh"], cwd=ROOT, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=90)
        left = set(tagged_processes(tag)) - {int(holder.read_text())} if holder.exists() else \
            set(tagged_processes(tag))
    finally:
        for pid in tagged_processes(tag):
            os.kill(pid, signal.SIGKILL)
    log = (tmp_path / "run" / "logs" / "train.log").read_text()
    ended = "a rank's process ended" if end == "crash" else "the trainer's final line"
    assert f"mpirun has not ended 2 s after {ended}" in log, out + log
    assert not left, f"processes of the job left: {left}\n{log}"
    if end == "crash":
        assert proc.returncode == 137 and not calls.exists(), out + log
    else:
        assert proc.returncode == 0 and calls.read_text().split() == ["requeue", "7"], out + log


CLUSTERS_MD = os.path.join(ROOT, "docs", "clusters.md")
COMMON = [os.path.join(ROOT, "slurm", "common.sh"), os.path.join(ROOT, "slurm", "lib",
                                                                 "launch_end.sh")]


def doc_table(heading):
    """The first table after `heading` in docs/clusters.md: {first cell: the row's other cells
    joined}."""
    lines = open(CLUSTERS_MD).read().split(heading, 1)[1].splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("|"))
    table = itertools.takewhile(lambda line: line.startswith("|"), lines[start + 2:])
    cells = [[c.strip() for c in line.strip("|").split("|")] for line in table]
    return {c[0]: " | ".join(c[1:]) for c in cells}


# A launch's end (what srun printed, its status, the environment) and a word that the row of the
# exit status the job ends with must hold.
ENDINGS = [
    ([STALL_REPORT, "srun: error: n1: task 0: Exited with exit code 5"], 5, {}, "stall"),
    ([STALL_REPORT, "srun: error: n1: task 0: Exited with exit code 5"], 5,
     {"MAX_REQUEUES": "0"}, "MAX_REQUEUES"),
    (["srun: error: n1: task 1: Exited with exit code 3"], 143, {}, "SIGUSR1"),
    (["srun: error: n1: task 1: Exited with exit code 3"], 143, {"MAX_REQUEUES": "0"},
     "MAX_REQUEUES"),
    (["srun: error: n1: tasks 0-1: Exited with exit code 4"], 4, {}, "scancel -s TERM"),
    # SLURM's SIGTERM to the batch shell while srun waits on a stalled step: a node failure
    # (SLURM requeued the job first), or a scancel
    ([STALL_REPORT, "srun: error: n1: task 0: Exited with exit code 5"], 5,
     {"SRUN_BODY": SIGTERM_WHILE_SRUN_WAITS, "JOB": "JobState=COMPLETING Restarts=1",
      "DOWN": "n2", "SLURM_JOB_NODELIST": "n[1-2]"}, "node failure"),
    ([STALL_REPORT, "srun: error: n1: task 0: Exited with exit code 5"], 5,
     {"SRUN_BODY": SIGTERM_WHILE_SRUN_WAITS, "JOB": "JobState=COMPLETING Restarts=0"},
     "scancel"),
    (["srun: error: n2: task 1: Segmentation fault"], 139, {}, "crashed"),
    (["srun: error: n2: task 1: Segmentation fault"], 5, {}, "crashed"),
    (["srun: error: n1: task 0: Exited with exit code 1"], 1, {}, "error"),
    (["srun: error: n1: task 0: Exited with exit code 2"], 2, {}, "config error"),
]


def test_the_documented_exit_statuses_are_the_scripts(tmp_path):
    """docs/clusters.md's table of exit statuses against slurm/common.sh: each status the script
    names (EXIT_*) has its row and each numbered row but 0-2 its name; each way a launch ends
    ends the job with a status whose row (a number's, else "other") says so."""
    rows = doc_table("### Exit statuses")
    named = {int(v) for f in COMMON
             for v in re.findall(r"^EXIT_[A-Z_]+=(\d+)", open(f).read(), re.M)}
    assert named == {int(k) for k in rows if k.isdigit()} - {0, 1, 2}, (named, rows.keys())
    assert "other" in rows
    for lines, srun_status, env, word in ENDINGS:
        proc, _, log = end_of_step(tmp_path, lines, srun_status, **env)
        row = rows.get(str(proc.returncode), rows["other"])
        assert word in row, (lines, env, proc.returncode, row, proc.stdout)
        (tmp_path / "run" / "logs" / "stalls").unlink(missing_ok=True)


def test_every_override_the_script_reads_is_documented():
    """Each variable slurm/common.sh reads with a default, but SLURM's and the script's own
    state, is a row of the overrides table in docs/clusters.md."""
    own = {"PETRA_PID", "PETRA_LOG", "PETRA_SHRUNK", "CONFIG_DEFAULT"}
    read = {name for f in COMMON
            for name in re.findall(r"\$\{([A-Z][A-Z0-9_]*):[-=?]", open(f).read())}
    overrides = {name for key in doc_table("Environment overrides (sbatch passes")
                 for name in re.findall(r"`([A-Z][A-Z0-9_]*)", key)}
    missing = {n for n in read if not n.startswith("SLURM_")} - own - overrides
    assert not missing, f"not in docs/clusters.md's overrides table: {sorted(missing)}"


def asked_to_requeue(calls):
    return any(c.startswith("requeue ") for c in calls)


def wrapped_trainer(tmp_path, *faulty, holder=None):
    """A PYTHON for the batch script that runs the trainer (or tests/programs/faulty_train.py
    with `faulty` arguments) after writing its pid to tmp_path/pid.RANK. With `holder` (a path),
    rank 1 first starts a process in its own session that holds its output for an hour, and
    writes that process's pid there."""
    wrapper = tmp_path / "python"
    program = (f"{paths.PROGRAMS / 'faulty_train.py'} {' '.join(faulty)}" if faulty
               else "-m petra_mpi.train")
    wrapper.write_text(f"""#!/bin/bash
if [[ $1 == -m && $2 == petra_mpi.train ]]; then
    rank=${{PMI_RANK:-$SLURM_PROCID}}
    echo $$ >{tmp_path}/pid.$rank
    {f'if [[ $rank == 1 ]]; then setsid sleep 3600 & echo $! >{holder}; fi' if holder else ''}
    exec {sys.executable} {program} "${{@:3}}"
fi
exec {sys.executable} "$@"
""")
    wrapper.chmod(0o755)
    return wrapper



def stop_rank_1_once_training(cluster, jobid, tmp_path, out, starts):
    """Once this launch (the `starts`-th start record) trains, SIGSTOP rank 1: it can neither
    make progress nor exit, like a rank in a GPU or I/O hang."""
    pid = tmp_path / "pid.1"

    def training(jobs):
        assert jobs[0]["JobState"] not in slurm_cluster.TERMINAL, job_output(cluster, jobs[0])
        if not (pid.exists() and (out / "metrics.jsonl").exists()):
            return False
        events = [r["event"] for r in read_jsonl(out / "metrics.jsonl")]
        return events.count("start") == starts and events[-1] == "train"

    cluster.wait(jobid, training, timeout=120, what="to train")
    os.kill(int(pid.read_text()), signal.SIGSTOP)
    pid.unlink()


@pytest.mark.extended
def test_a_stopped_rank_ends_the_step_is_named_excluded_and_the_stall_budget_ends_the_job(
        cluster, tmp_path):
    """Rank 1 is stopped (SIGSTOP) mid-run. Rank 0's watchdog exits 5 and srun ends rank 1, so
    the job does not wait for its time limit; the batch script names rank 1 and its host from
    the reports, requeues the job and keeps it off that host. The requeued job (let back on the
    one node) stalls the same way with no newer checkpoint: with STALL_RESTARTS=1 it ends."""
    out = tmp_path / "run"
    jobid = submit(cluster, tmp_path, "revnet18_cifar10.sh", CONFIG="configs/quickstart.yaml",
                   OUT_DIR=str(out), EXTRA_ARGS=LONGER + " --set run.watchdog_s=3",
                   PYTHON=str(wrapped_trainer(tmp_path)), STALL_RESTARTS="1")
    stop_rank_1_once_training(cluster, jobid, tmp_path, out, starts=1)
    (job,) = cluster.wait(jobid, lambda jobs: (jobs[0]["Restarts"], jobs[0]["JobState"])
                          == ("1", "PENDING") or jobs[0]["JobState"] in slurm_cluster.TERMINAL,
                          timeout=120, what="to end its step")
    log = (out / "logs" / "train.log").read_text()
    assert (job["JobState"], job["Restarts"]) == ("PENDING", "1"), job_output(cluster, job) + log
    assert (f"watchdog reports: rank 1 on {cluster.host} is lost or stalled: rank 1 did not "
            "report") in log, log[-3000:]
    assert job["ExcNodeList"] == cluster.host, job

    # the one node is all there is: let the job back on it, now rather than after the requeue
    # delay (not within the second of the requeue: see the preemption test)
    time.sleep(2)
    cluster.run("scontrol", "update", f"jobid={jobid}", "ExcNodeList=", "starttime=now")
    stop_rank_1_once_training(cluster, jobid, tmp_path, out, starts=2)
    (job,) = cluster.wait(jobid, lambda jobs: jobs[0]["Restarts"] == "2"
                          or jobs[0]["JobState"] in slurm_cluster.TERMINAL, timeout=120)
    log = (out / "logs" / "train.log").read_text()
    assert (job["JobState"], job["ExitCode"], job["Restarts"]) == ("FAILED", "5:0", "1"), \
        job_output(cluster, job) + log[-3000:]
    assert "not requeueing: 2 stall(s) in a row with no newer complete checkpoint than none" \
        in log, log[-3000:]


@pytest.mark.extended
def test_a_rank_killed_by_a_signal_fails_the_job_without_requeue(cluster, tmp_path):
    """Rank 0 kills itself with SIGKILL (as the OOM killer would) mid-run: a crash, which would
    come back on every restart, so the job fails with a line naming it, not requeued though
    rank 1's watchdog may report after it."""
    out = tmp_path / "run"
    jobid = submit(cluster, tmp_path, "revnet18_cifar10.sh", CONFIG="configs/quickstart.yaml",
                   OUT_DIR=str(out), EXTRA_ARGS=SMOKE + " --set run.watchdog_s=3",
                   PYTHON=str(wrapped_trainer(tmp_path, "kill", "0", "5")))
    (job,) = cluster.wait(jobid, lambda jobs: jobs[0]["Restarts"] != "0"
                          or jobs[0]["JobState"] in slurm_cluster.TERMINAL, timeout=120)
    log = (out / "logs" / "train.log").read_text()
    assert (job["JobState"], job["Restarts"]) == ("FAILED", "0"), job_output(cluster, job) + log
    assert re.search(r"a rank crashed, \S+: task 0: Killed", log), log[-3000:]


@pytest.mark.extended
def test_a_rank_that_cannot_exit_under_mpirun_ends_the_job(cluster, tmp_path):
    """LAUNCHER=mpirun: rank 1 stopped (SIGSTOP) mid-run, and a process that no signal of mpirun
    reaches (in its own session, like one stuck in the kernel) holds rank 1's output, so mpirun
    never ends by itself. Once rank 0's watchdog has reported, the script gives mpirun
    STUCK_GRACE_S, kills it, and the job ends as stalled (MAX_REQUEUES=0: not requeued) with
    rank 1 named, instead of running until its time limit."""
    out = tmp_path / "run"
    holder = tmp_path / "holder.pid"
    jobid = submit(cluster, tmp_path, "revnet18_cifar10.sh", CONFIG="configs/quickstart.yaml",
                   OUT_DIR=str(out), EXTRA_ARGS=LONGER + " --set run.watchdog_s=3",
                   PYTHON=str(wrapped_trainer(tmp_path, holder=holder)), LAUNCHER="mpirun",
                   MAX_REQUEUES="0", STUCK_GRACE_S="5")
    try:
        stop_rank_1_once_training(cluster, jobid, tmp_path, out, starts=1)
        (job,) = cluster.wait(jobid, timeout=120, what="to end")
    finally:
        if holder.exists():
            subprocess.run(["kill", "-KILL", holder.read_text().strip()], check=False)
    log = (out / "logs" / "train.log").read_text()
    assert (job["JobState"], job["ExitCode"]) == ("FAILED", "5:0"), job_output(cluster, job) + log
    assert "mpirun has not ended 5 s after a watchdog report" in log, log[-3000:]
    assert (f"watchdog reports: rank 1 on {cluster.host} is lost or stalled: rank 1 did not "
            "report") in log, log[-3000:]
