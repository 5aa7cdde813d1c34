"""Invariant 6 under mpirun with a real signal: stopping after a drain, checkpointing and
resuming gives the same parameters as running on."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from petra_mpi.run.checkpoint import complete_checkpoints
from petra_mpi.engines.stopping import EXIT_REQUEUE, EXIT_STOPPED
from tests.support.launch import mpirun
from tests.support.paths import QUICK, ROOT

# The estimated split: the interrupted and the uninterrupted runs are separate starts, and a
# measured split could differ between them (a resumed run keeps its checkpoint's split).
LONGER = [*QUICK, "--set", "train.limit_batches=24", "--set", "train.epochs=2",
          "--set", "run.log_every=1", "--set", "run.keep_checkpoints=10",
          "--set", "model.balance=estimate"]


def launch(n, out_dir, *extra):
    cmd = ["mpirun", "-n", str(n), sys.executable, "-m", "petra_mpi.train",
           "configs/quickstart.yaml", "--set", f"run.out_dir={out_dir}", *LONGER, *extra]
    return subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})


def finish(proc, timeout=180):
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
    return proc.returncode, out + err


def signal_once_training(proc, out_dir, sig=signal.SIGUSR1, timeout=120):
    """Send `sig` to the launcher (mpirun forwards it to every rank) once training has begun."""
    metrics = Path(out_dir) / "metrics.jsonl"
    deadline = time.time() + timeout
    while time.time() < deadline:
        if metrics.exists() and '"event": "train"' in metrics.read_text():
            proc.send_signal(sig)
            return
        if proc.poll() is not None:
            break
        time.sleep(0.05)
    raise AssertionError("training never started: " + (proc.communicate()[1] or "")[-2000:])


def final_state(out_dir, stages):
    path = Path(complete_checkpoints(str(out_dir))[-1])
    assert path.name == "ckpt-e00002-b00000000"
    return [torch.load(path / f"stage{s}.pt", weights_only=True) for s in range(stages)]


def assert_same_states(a, b):
    for sa, sb in zip(a, b):
        for key, value in sa["stage"].items():
            assert torch.equal(value, sb["stage"][key]), key
        ma = sa["optimizer"]["sgd"]["state"]
        mb = sb["optimizer"]["sgd"]["state"]
        assert ma.keys() == mb.keys()
        for k in ma:
            assert torch.equal(ma[k]["momentum_buffer"], mb[k]["momentum_buffer"])
        assert sa["optimizer"]["steps"] == sb["optimizer"]["steps"]


def stop_mid_epoch(n, out_dir, *extra):
    """Launch on n ranks, SIGUSR1 once training has begun: the run must checkpoint and exit for
    requeue before the end of its first epoch."""
    proc = launch(n, out_dir, *extra)
    signal_once_training(proc, out_dir)
    code, log = finish(proc)
    assert code == EXIT_REQUEUE, log[-3000:]
    stop = [e for e in events(out_dir) if e["event"] == "stop"]
    assert stop and (stop[0]["epoch"], stop[0]["position"]) < (2, 0)


def events(out_dir):
    return [json.loads(line) for line in (Path(out_dir) / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("transport", ["mpi", pytest.param("torch", marks=pytest.mark.extended)])
def test_signal_checkpoint_resume_equals_running_on(tmp_path, transport):
    """Over either transport (comm.transport): its stop votes, checkpoint and resume."""
    cadence = ["--set", "run.checkpoint_every_microbatches=8",
               "--set", f"comm.transport={transport}"]
    stopped, straight = tmp_path / "stopped", tmp_path / "straight"
    stop_mid_epoch(3, stopped, *cadence)

    code, log = finish(launch(3, stopped, *cadence, "--set", "run.resume=auto"))
    assert code == 0, log[-3000:]
    assert "resumed from" in log
    code, log = finish(launch(3, straight, *cadence))
    assert code == 0, log[-3000:]
    assert_same_states(final_state(stopped, 3), final_state(straight, 3))
    summary = json.loads((stopped / "summary.json").read_text())
    assert summary["epochs"] == 2 and len(summary["history"]) == 2


@pytest.mark.extended  # invariant 6 is the test above; this one the SIGTERM path on 4 ranks
def test_sigterm_mid_segment_stops_drains_and_resumes(tmp_path):
    proc = launch(4, tmp_path)
    signal_once_training(proc, tmp_path, signal.SIGTERM)
    code, log = finish(proc)
    assert code == EXIT_STOPPED, log[-3000:]  # checkpointed, not for a requeue
    assert len(complete_checkpoints(str(tmp_path))) >= 1
    code, log = finish(launch(4, tmp_path, "--set", "run.resume=auto"))
    assert code == 0, log[-3000:]
    kinds = [e["event"] for e in events(tmp_path)]
    assert kinds.count("resume") == 1 and kinds[-1] == "checkpoint"
    assert (tmp_path / "summary.json").exists()


@pytest.mark.extended  # two runs under mpirun; tests/unit/test_checkpoint_durability.py in one
def test_a_damaged_file_of_one_rank_sends_every_rank_back_to_the_previous_checkpoint(tmp_path):
    """Rank 1 cannot read its file of the newest checkpoint (zero-filled by a crash), rank 0
    can: both resume from the previous complete checkpoint, and rank 0 says so once."""
    every_4 = ["--set", f"run.out_dir={tmp_path}", *QUICK, "--set", "run.threads=1",
               "--set", "run.checkpoint_every_microbatches=4"]
    train = ["-m", "petra_mpi.train", "configs/quickstart.yaml", *every_4]
    first = mpirun(2, train, timeout=120)
    assert first.returncode == 0, first.stderr[-3000:]
    older, newest = complete_checkpoints(str(tmp_path))
    damaged = Path(newest) / "stage1.pt"
    damaged.write_bytes(bytes(damaged.stat().st_size))
    again = mpirun(2, train, timeout=120)
    assert again.returncode == 0, again.stderr[-3000:]
    said = [line for line in again.stderr.splitlines() if newest in line]
    assert len(said) == 1 and "stage1.pt" in said[0] and older in said[0], again.stderr[-3000:]
    (resumed,) = [e for e in events(tmp_path) if e["event"] == "resume"]
    assert resumed["from"] == older


# ---------------------------------------------------------------- CUDA random state, without CUDA

class FakeCuda:
    """The random-state calls of torch.cuda, for `visible` GPUs that each hold their own state
    (a device index past the visible ones is an IndexError, as in torch)."""

    def __init__(self, visible):
        self.states = [torch.full((4,), 10 + i, dtype=torch.uint8) for i in range(visible)]

    def _index(self, device):
        index = torch.device(device).index if not isinstance(device, int) else device
        index = 0 if index is None else index
        if index >= len(self.states):
            raise IndexError(f"device {index} of {len(self.states)} visible")
        return index

    def is_available(self):
        return True

    def device_count(self):
        return len(self.states)

    def get_rng_state(self, device="cuda"):
        return self.states[self._index(device)].clone()

    def set_rng_state(self, state, device="cuda"):
        self.states[self._index(device)] = state.clone()

    def get_rng_state_all(self):
        return [s.clone() for s in self.states]

    def set_rng_state_all(self, states):
        for i, state in enumerate(states):
            self.set_rng_state(state, i)


def fake_cuda(monkeypatch, visible):
    fake = FakeCuda(visible)
    for name in ("is_available", "device_count", "get_rng_state", "set_rng_state",
                 "get_rng_state_all", "set_rng_state_all"):
        monkeypatch.setattr(torch.cuda, name, getattr(fake, name))
    return fake


def test_cuda_rng_state_is_the_ranks_own_gpu_and_restores_with_fewer_visible():
    from petra_mpi.run.checkpoint import cuda_rng_state, restore_cuda_rng
    four, one = FakeCuda(4), FakeCuda(1)
    saved = cuda_rng_state(torch.device("cuda", 2), four)  # a rank that used GPU 2 of 4
    assert torch.equal(saved, four.states[2])
    restore_cuda_rng(saved, torch.device("cuda", 0), one)  # requeued seeing its GPU alone
    assert torch.equal(one.states[0], four.states[2])
    assert cuda_rng_state(torch.device("cpu"), four) is None
    restore_cuda_rng(None, torch.device("cuda", 0), one)  # a CPU run's checkpoint
    restore_cuda_rng(saved, torch.device("cpu"), one)  # resumed on the CPU
    assert torch.equal(one.states[0], four.states[2])


@pytest.mark.extended  # invariant 8's resume: the test above with every delay compensation on
def test_resume_with_delay_compensation_equals_running_on(tmp_path):
    rules = ["--set", "run.checkpoint_every_microbatches=8", "--set", "optim.delay_momentum=1",
             "--set", "optim.delay_prediction=1", "--set", "optim.delay_spike=true",
             "--set", "optim.delay_lr_epochs=2", "--set", "optim.delay_free_momentum=0"]
    stopped, straight, plain = tmp_path / "stopped", tmp_path / "straight", tmp_path / "plain"
    stop_mid_epoch(3, stopped, *rules)
    code, log = finish(launch(3, stopped, *rules, "--set", "run.resume=auto"))
    assert code == 0 and "resumed from" in log, log[-3000:]
    for out, extra in ((straight, rules), (plain, rules[:2])):
        code, log = finish(launch(3, out, *extra))
        assert code == 0, log[-3000:]
    assert_same_states(final_state(stopped, 3), final_state(straight, 3))
    # the rules changed the training (the comparison has teeth)
    first = final_state(straight, 3)[0]["stage"]
    assert any(not torch.equal(v, final_state(plain, 3)[0]["stage"][k]) for k, v in first.items())
