"""How a run finds its ranks (comm/world.py), in one process: the launchers' environments,
torchrun's included, and the one line a transport that cannot start says (exit status 2)."""
import signal
import sys

import pytest
import torch.distributed

from petra_mpi import train
from petra_mpi.comm.world import launcher_rank_and_size
from tests.support.paths import QUICK

TORCHRUN = {"TORCHELASTIC_RUN_ID": "none", "RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1"}


@pytest.mark.parametrize("env,want", [
    (TORCHRUN, (1, 2)),
    # a torchrun that an srun task started: torchrun's ranks, not srun's tasks
    ({**TORCHRUN, "SLURM_STEP_ID": "0", "SLURM_PROCID": "0", "SLURM_STEP_NUM_TASKS": "1"},
     (1, 2)),
    ({"RANK": "1", "WORLD_SIZE": "2"}, None),  # no launcher says so: one process
    ({"PMI_RANK": "3", "PMI_SIZE": "4"}, (3, 4)),
])
def test_launcher_rank_and_size(env, want):
    assert launcher_rank_and_size(env) == want


@pytest.fixture(autouse=True)
def signal_handlers_kept():
    """train.main installs its stop handlers: pytest's come back after each test."""
    handlers = {s: signal.getsignal(s) for s in (signal.SIGUSR1, signal.SIGTERM)}
    yield
    for s, handler in handlers.items():
        signal.signal(s, handler)


@pytest.fixture
def as_torchrun_rank(monkeypatch):
    """This process as rank 1 of 2 that torchrun started."""
    for name, value in TORCHRUN.items():
        monkeypatch.setenv(name, value)


def one_line(capsys, *sets):
    status = train.main(["configs/quickstart.yaml", "--dry-run", *QUICK, *sets])
    return status, capsys.readouterr().err.strip().splitlines()


def test_the_mpi_transport_under_torchrun_is_one_line(as_torchrun_rank, capsys):
    assert one_line(capsys) == (2, [
        "error: started by torchrun, which starts no MPI: set comm.transport: torch "
        "(--set comm.transport=torch), or launch with mpirun or srun"])


def test_a_torch_without_gloo_is_one_line(as_torchrun_rank, capsys, monkeypatch):
    monkeypatch.setattr(torch.distributed, "is_gloo_available", lambda: False)
    assert one_line(capsys, "--set", "comm.transport=torch") == (2, [
        "error: comm.transport torch needs torch.distributed with gloo, which this torch build "
        "lacks: run with comm.transport mpi, or install a torch built with distributed support"])


def test_an_mpi_launch_without_mpi4py_is_one_line(capsys, monkeypatch):
    monkeypatch.setenv("PMI_RANK", "0")
    monkeypatch.setenv("PMI_SIZE", "2")
    monkeypatch.setitem(sys.modules, "mpi4py", None)  # as where it is not installed
    status, said = one_line(capsys)
    assert status == 2 and len(said) == 1, said
    assert said[0].startswith("error: comm.transport mpi needs mpi4py, which cannot be imported "
                              "here (") and said[0].endswith(
        "): pip install mpi4py, or run with --set comm.transport=torch")
