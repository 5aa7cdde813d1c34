"""Real launches of the project's commands, each under a timeout, and a packer's command line
run in the test's own process."""
import contextlib
import importlib
import io
import os
import queue
import signal
import subprocess
import sys
import threading

from tests.support.paths import ROOT


def mpirun(n, args, timeout=180, env=None):
    """Launch for real; a hang fails the test through the timeout instead of freezing CI."""
    cmd = ["mpirun", "-n", str(n), sys.executable] + [str(a) for a in args]
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                          env=full_env)


def torchrun(n, args, timeout=180, env=None):
    """torchrun of n processes for real, under a timeout; --standalone: its rendezvous on a free
    port, so launches beside each other do not meet."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           str(n)] + [str(a) for a in args]
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                          env=full_env)


def run_plot(*args):
    return subprocess.run([sys.executable, "-m", "petra_mpi.plot", *map(str, args)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)


def children_of(pid):
    kids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as fh:
                    if int(fh.read().rsplit(")", 1)[1].split()[1]) == pid:
                        kids.append(int(entry))
            except (OSError, IndexError, ValueError):
                pass
    return kids


def start_and_interrupt(cmd, sig, group=False, sigint_ignored=False):
    """Start a packer, wait for its "started" line (its handlers are in place and its temporary
    output exists), then send `sig` to it (or, with group=True, to its whole process group, as
    Ctrl-C in a terminal does). sigint_ignored: start it with SIGINT ignored, as a shell without
    job control starts a background command."""
    def ignore_sigint():
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    proc = subprocess.Popen([sys.executable, "-m", *map(str, cmd)], cwd=ROOT, start_new_session=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=ignore_sigint if sigint_ignored else None)
    lines = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in proc.stdout] + [lines.put("")],
                     daemon=True).start()
    while True:
        line = lines.get(timeout=60)
        assert line, ("the packer ended before it started", proc.wait(), proc.stderr.read())
        if line.startswith("started: writing "):
            break
    kids = children_of(proc.pid)
    assert proc.poll() is None, "the packer finished before it could be interrupted"
    if group:
        os.killpg(proc.pid, sig)
    else:
        proc.send_signal(sig)
    try:  # (its stderr is a line or two: waiting first cannot fill the pipe)
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:  # a hang fails the test instead of stopping the suite
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        raise AssertionError(f"{cmd[0]} still ran 60 s after the signal") from None
    return proc.returncode, proc.stderr.read(), kids


def ended_process():
    """The number of a process that has ended: no running process has it (until the system
    hands it out again, which takes a full turn of its numbers)."""
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def run_packer(module, *args):
    """`python -m petra_mpi.prep.MODULE ARGS` in this process (no interpreter start-up per
    call): (exit status, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    from petra_mpi.prep.common import run_cli  # which puts pytest's signal handlers back
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            run_cli(importlib.import_module(f"petra_mpi.prep.{module}").main,
                    [str(a) for a in args])
    except SystemExit as e:
        status = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    return status, out.getvalue(), err.getvalue()
