"""Real launches of the project's commands, each under a timeout."""
import os
import subprocess
import sys

from tests.support.paths import ROOT


def mpirun(n, args, timeout=180, env=None):
    """Launch for real; a hang fails the test through the timeout instead of freezing CI."""
    cmd = ["mpirun", "-n", str(n), sys.executable] + [str(a) for a in args]
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                          env=full_env)


def run_plot(*args):
    return subprocess.run([sys.executable, "-m", "petra_mpi.plot", *map(str, args)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
