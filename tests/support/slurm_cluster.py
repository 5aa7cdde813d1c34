"""A throwaway one-node SLURM cluster for the batch-script tests: munged, slurmctld and slurmd run
from a temporary directory with a generated slurm.conf. The node claims 320 CPUs and 40 "GPUs"
(plain files named in gres.conf), so scripts with --gpus-per-task run on a CPU machine. Needs root
and the slurm-wlm and munge packages (apt-get install slurm-wlm munge)."""
import os
import pwd
import random
import re
import shutil
import socket
import subprocess
import time

DAEMONS = ("slurmctld", "slurmd", "munged")
TERMINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY",
            "BOOT_FAIL", "DEADLINE", "PREEMPTED"}
# What the one node claims (SlurmdParameters=config_overrides lets it claim more than it has):
# enough for any script's full request on one node, so `sbatch --test-only` can check them all.
CPUS, GPUS = 320, 40  # the 36-rank replicas script at 8 CPUs each
MUNGE_SOCKET_DIR = "/run/munge"
MUNGE_KEY = "/etc/munge/munge.key"


def running_cluster(tmp_path_factory):
    """The body of a test module's `cluster` fixture: a started cluster for the module's tests,
    stopped after them; the tests skip, saying why, where one cannot run here."""
    why = missing()
    if why:
        import pytest
        pytest.skip(why)
    cluster = Cluster(tmp_path_factory.mktemp("slurm")).start()
    yield cluster
    cluster.stop()


def missing() -> str | None:
    """Why the cluster cannot start here, or None."""
    absent = [d for d in DAEMONS if not _sbin(d)]
    if absent:
        return (f"SLURM/munge not installed ({', '.join(absent)} not found): "
                "apt-get install slurm-wlm munge")
    if os.geteuid() != 0:
        return "the test SLURM cluster needs root (slurmd runs jobs as their user)"
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _sbin(name):
    return shutil.which(name, path=os.environ.get("PATH", "") + ":/usr/sbin:/sbin")


class Cluster:
    def __init__(self, root, cpus=CPUS, task_plugin="task/none"):
        """cpus: what the node claims; task/affinity binds tasks to CPUs only when that is no
        more than the machine has (else slurmd logs "more resources configured than exist")."""
        self.root = str(root)
        self.cpus, self.task_plugin = cpus, task_plugin
        self.procs = []          # daemons we started (Popen), stopped in reverse order
        self.host = socket.gethostname().split(".")[0]
        self.conf = os.path.join(self.root, "slurm.conf")
        self.env = dict(os.environ, SLURM_CONF=self.conf)
        for k in list(self.env):  # a cluster job running these tests must not leak into ours
            if k.startswith(("SLURM_", "SBATCH_", "SRUN_", "SALLOC_")) and k != "SLURM_CONF":
                del self.env[k]

    # ---- start and stop ----
    def start(self, timeout=60):
        try:
            self._start_munge()
            self._write_conf()
            log = os.path.join(self.root, "log")
            for name, args in (("slurmctld", ["-D", "-c"]), ("slurmd", ["-D"])):
                out = open(os.path.join(log, f"{name}.out"), "w")
                self.procs.append(subprocess.Popen([_sbin(name), *args, "-f", self.conf],
                                                   stdout=out, stderr=subprocess.STDOUT,
                                                   env=self.env))
            self._wait_idle(timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def _start_munge(self):
        if self._munge_works():
            return  # a munged is already serving /run/munge: use it, leave it running
        user = pwd.getpwnam("munge")
        os.makedirs(MUNGE_SOCKET_DIR, exist_ok=True)
        os.chown(MUNGE_SOCKET_DIR, user.pw_uid, user.pw_gid)
        os.chmod(MUNGE_SOCKET_DIR, 0o755)
        if not os.path.exists(MUNGE_KEY):
            os.makedirs(os.path.dirname(MUNGE_KEY), exist_ok=True)
            with open(MUNGE_KEY, "wb") as f:
                f.write(os.urandom(1024))
        os.chown(MUNGE_KEY, user.pw_uid, user.pw_gid)
        os.chmod(MUNGE_KEY, 0o400)
        out = open(os.path.join(self.root, "munged.out"), "w")
        self.procs.append(subprocess.Popen([_sbin("munged"), "-F", "--force"], user="munge",
                                           group="munge", stdout=out, stderr=subprocess.STDOUT))
        deadline = time.time() + 20
        while not self._munge_works():
            if time.time() > deadline or self.procs[-1].poll() is not None:
                raise RuntimeError(f"munged did not start: {self._tail('munged.out')}")
            time.sleep(0.2)

    def _munge_works(self):
        try:
            cred = subprocess.run(["munge", "-n"], capture_output=True, timeout=5)
            if cred.returncode != 0:
                return False
            return subprocess.run(["unmunge"], input=cred.stdout, capture_output=True,
                                  timeout=5).returncode == 0
        except (OSError, subprocess.TimeoutExpired):
            return False

    def _write_conf(self):
        r = self.root
        for d in ("state", "spool", "log", "gpu"):
            os.makedirs(os.path.join(r, d), exist_ok=True)
        # The "GPUs" are plain files: slurmd logs that they are not devices, and schedules them.
        for i in range(GPUS):
            open(os.path.join(r, "gpu", f"gpu{i}"), "w").close()
        with open(os.path.join(r, "gres.conf"), "w") as f:
            f.write(f"NodeName={self.host} Name=gpu File={r}/gpu/gpu[0-{GPUS - 1}]\n")
        conf = f"""\
ClusterName=petratest
SlurmctldHost={self.host}(127.0.0.1)
SlurmctldPort={_free_port()}
SlurmdPort={_free_port()}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
StateSaveLocation={r}/state
SlurmdSpoolDir={r}/spool
SlurmctldPidFile={r}/slurmctld.pid
SlurmdPidFile={r}/slurmd.pid
SlurmctldLogFile={r}/log/slurmctld.log
SlurmdLogFile={r}/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin={self.task_plugin}
{self._task_params()}JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/filetxt
JobCompLoc={r}/log/jobcomp.txt
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SlurmdParameters=config_overrides
GresTypes=gpu
MpiDefault=none
JobRequeue=1
# finished jobs stay visible to `scontrol show job` for the whole test session
MinJobAge=600
# Job ids from a random start: MPI libraries name a job step's shared-memory segments after its
# job id, so two test clusters on one machine that both ran job 1 would mix their ranks.
FirstJobId={random.randrange(1000, 60000000)}
ReturnToService=2
KillWait=10
SchedulerParameters=sched_interval=2
NodeName={self.host} NodeAddr=127.0.0.1 CPUs={self.cpus} Gres=gpu:{GPUS} State=UNKNOWN
PartitionName=debug Nodes={self.host} Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO
"""
        with open(self.conf, "w") as f:
            f.write(conf)

    def _task_params(self):
        # task/affinity binds nothing unless a step asks for it; bind each task to its CPUs
        # (cores here) by default, as production sites configure it
        return "TaskPluginParam=autobind=cores\n" if self.task_plugin == "task/affinity" else ""

    def _wait_idle(self, timeout):
        deadline = time.time() + timeout
        while time.time() < deadline:
            for p in self.procs:
                if p.poll() is not None:
                    raise RuntimeError(f"a SLURM daemon exited ({p.args[0]}, status "
                                       f"{p.returncode}): {self._tail('log/slurmctld.log')}\n"
                                       f"{self._tail('log/slurmd.log')}")
            states = self.run("sinfo", "-h", "-o", "%T", check=False).stdout.split()
            if "idle" in states:
                return
            time.sleep(0.5)
        raise RuntimeError(f"the test node never became idle: {self._tail('log/slurmctld.log')}")

    def stop(self):
        """Cancel what is left of our jobs, stop the daemons we started."""
        if self.procs and os.path.exists(self.conf):
            self.run("scancel", "--user=root", check=False)
            deadline = time.time() + 20
            while time.time() < deadline and self.run("squeue", "-h", check=False).stdout.strip():
                time.sleep(0.5)
        for p in reversed(self.procs):
            if p.poll() is None:
                p.terminate()
                try:
                    p.wait(15)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait(5)
        self.procs = []

    def _tail(self, name, n=2000):
        try:
            with open(os.path.join(self.root, name), errors="replace") as f:
                return f.read()[-n:]
        except OSError:
            return f"({name} unreadable)"

    # ---- client commands ----
    def run(self, *cmd, check=True, timeout=30, env=None, cwd=None):
        cmd = [str(c) for c in cmd]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                              env=dict(self.env, **(env or {})), cwd=cwd)
        if check and proc.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}): {proc.stderr}")
        return proc

    def sbatch(self, script, *options, env=None, cwd=None) -> str:
        """Submit; returns the job id (for an array, the array's id)."""
        out = self.run("sbatch", "--parsable", *options, script, env=env, cwd=cwd).stdout
        return out.strip().split(";")[0]

    def job(self, jobid) -> dict:
        """`scontrol show job` as a dict; an array id gives the first task."""
        return self.jobs(jobid)[0]

    def jobs(self, jobid) -> list[dict]:
        out = self.run("scontrol", "-o", "show", "job", jobid).stdout
        return [dict(re.findall(r"(\S+?)=(\S*)", line)) for line in out.splitlines()
                if line.strip()]

    def wait(self, jobid, until=lambda jobs: all(j["JobState"] in TERMINAL for j in jobs),
             timeout=180, what="to finish"):
        """Poll `scontrol show job` until until(jobs) is true; returns the jobs."""
        deadline = time.time() + timeout
        while True:
            jobs = self.jobs(jobid)
            if until(jobs):
                return jobs
            if time.time() > deadline:
                raise TimeoutError(f"job {jobid} did not come {what} in {timeout} s: "
                                   + "; ".join(f"{j['JobId']} {j['JobState']} {j.get('Reason')}"
                                               for j in jobs))
            time.sleep(0.5)
