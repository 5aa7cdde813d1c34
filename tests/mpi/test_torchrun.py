"""The trainer over torch.distributed (comm.transport: torch) started by torchrun: the run ends with
the parameters of the one-process engine, bitwise (gloo on the CPU). tests/mpi/test_mpi.py,
test_replicas.py, test_resume.py and test_hang_watchdog.py run the same transport under mpirun;
tests/unit/test_world.py its errors."""
import subprocess
import sys

import pytest
import torch

from petra_mpi.run.checkpoint import complete_checkpoints
from tests.support.launch import mpirun, torchrun
from tests.support.paths import QUICK, ROOT

# the estimated split and one thread: the same blocks per stage, the same arithmetic, in both runs
SAME = [*QUICK, "--set", "model.balance=estimate", "--set", "run.threads=1"]


def last_checkpoint(out_dir, stages):
    path = complete_checkpoints(str(out_dir))[-1]
    return [torch.load(f"{path}/stage{s}.pt", weights_only=False) for s in range(stages)]


@pytest.mark.extended  # two trainings; the default selection runs the transport under mpirun
def test_torchrun_trains_as_the_one_process_engine_bitwise(tmp_path):
    proc = torchrun(2, ["-m", "petra_mpi.train", "configs/quickstart.yaml", *SAME,
                        "--set", "comm.transport=torch", "--set", f"run.out_dir={tmp_path / 'tr'}"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "2 ranks, transport torch.distributed gloo" in proc.stderr
    local = subprocess.run([sys.executable, "-m", "petra_mpi.train", "configs/quickstart.yaml",
                            *SAME, "--set", "model.stages=2",
                            "--set", f"run.out_dir={tmp_path / 'one'}"],
                           cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert local.returncode == 0, local.stderr[-3000:]
    for got, want in zip(last_checkpoint(tmp_path / "tr", 2), last_checkpoint(tmp_path / "one", 2)):
        assert got["stage"].keys() == want["stage"].keys()
        for key, value in got["stage"].items():
            assert torch.equal(value, want["stage"][key]), key
        assert got["optimizer"]["steps"] == want["optimizer"]["steps"] > 0


# train.main in a script that then counts the threads gloo's process groups left running
MAIN_THEN_COUNT = ("import os, sys; from petra_mpi.train import main; status = main(sys.argv[1:]); "
                   "names = [open(f'/proc/self/task/{t}/comm').read() for t in os.listdir("
                   "'/proc/self/task')]; print('gloo threads left:', "
                   "sum(n.startswith(('pt_gloo', 'gloo')) for n in names)); sys.exit(status)")


def test_the_trainer_ends_its_process_groups_before_the_interpreter_ends(tmp_path):
    """A gloo thread that drops its last work's tensors once the interpreter is ending aborts
    the rank after a finished run (SIGABRT, "terminate called without an active exception"),
    about 1 run in 20 on a loaded machine: every group's threads are joined before main
    returns."""
    proc = mpirun(2, ["-c", MAIN_THEN_COUNT, "configs/quickstart.yaml", *SAME,
                      "--set", "comm.transport=torch", "--set", f"run.out_dir={tmp_path}"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("gloo threads left: 0") == 2, proc.stdout
