"""Checkpoints by wall time (run.checkpoint_every_minutes) and an evaluation that a stop request
interrupts: the vote value, the one-process trainer with a stand-in clock, and under mpirun,
where rank 0's clock must make every rank drain and checkpoint at the same point."""
import itertools
import json
import signal
from pathlib import Path

import pytest
import torch

from petra_mpi.engines import stopping
from petra_mpi import train
from petra_mpi.run import loaders, trainer
from petra_mpi.config import load_config, validate
from petra_mpi.engines.local import LocalEngine
from petra_mpi.engines.evaluation import EvalTotals
from petra_mpi.engines.stopping import (CHECKPOINT_DUE, EXIT_REQUEUE, EXIT_STOPPED, STOP,
                                        STOP_TERM, Interrupts, StopRequest, agree)
from tests.support.launch import mpirun
from tests.support.paths import QUICK

SMALL = QUICK + ["--set", "train.epochs=2", "--set", "train.limit_batches=16",
                 "--set", "train.limit_eval_batches=6", "--set", "data.batch_size=16",
                 "--set", "model.balance=estimate", "--set", "run.keep_checkpoints=20"]


class Clock:
    def __init__(self, step):
        self.now, self.step = 0.0, step

    def __call__(self):
        self.now += self.step
        return self.now


def test_vote_value():
    clock, stop = Clock(0.0), StopRequest()
    ticking = Interrupts(stop, every_minutes=2, clock=clock)
    silent = Interrupts(stop, every_minutes=2, keeps_clock=False, clock=clock)
    assert ticking.requested == silent.requested == 0
    clock.now = 119.0
    assert ticking.requested == 0
    clock.now = 120.0
    assert ticking.requested == CHECKPOINT_DUE and silent.requested == 0  # only rank 0's clock
    ticking.restart()
    assert ticking.requested == 0
    stop.requested = True
    assert ticking.requested == silent.requested == STOP  # a stop outranks a due checkpoint
    assert Interrupts(StopRequest(), every_minutes=0, clock=Clock(1e9)).requested == 0
    stop.term = True  # a SIGTERM: its vote outranks another rank's SIGUSR1 (the maximum)
    assert ticking.requested == STOP_TERM > STOP


def signalled(sig):
    """A StopRequest that got `sig` through its real handler (the test process's handlers are
    put back afterwards)."""
    saved = {s: signal.getsignal(s) for s in (signal.SIGUSR1, signal.SIGTERM)}
    stop = StopRequest().install()
    try:
        signal.raise_signal(sig)
    finally:
        for s, handler in saved.items():
            signal.signal(s, handler)
    return stop


def config(out_dir, *extra):
    args = SMALL + ["--set", f"run.out_dir={out_dir}", *extra]
    overrides = [a for a in args if a != "--set"]
    cfg = load_config("configs/quickstart.yaml", overrides)
    validate(cfg, 1)
    return cfg


def events(out_dir, kind):
    lines = (Path(out_dir) / "metrics.jsonl").read_text().splitlines()
    return [e for e in map(json.loads, lines) if e["event"] == kind]


@pytest.fixture
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_wall_time_checkpoints_in_one_process(tmp_path, monkeypatch, one_thread):
    """A clock that passes 10 seconds at every reading (the engine reads it at each stop vote
    it posts, every 8 ticks) and a 6-second cadence: a checkpoint is due at every vote, so the
    first segment of each epoch is shortened, checkpoints fall inside each epoch, and the run
    still finishes."""
    monkeypatch.setattr(stopping, "_now", Clock(10.0))
    cfg = config(tmp_path, "--set", "run.checkpoint_every_minutes=0.1")
    assert train.run(cfg, None, stop=StopRequest()) == 0
    mid_epoch = [e for e in events(tmp_path, "checkpoint") if 0 < e["position"] < 16]
    assert len(mid_epoch) >= 2, events(tmp_path, "checkpoint")
    assert json.loads((tmp_path / "summary.json").read_text())["epochs"] == 2


@pytest.mark.extended  # a resume under mpirun is tests/mpi/test_resume.py's default test
def test_stop_during_evaluation_resumes_into_it(tmp_path, monkeypatch, one_thread):
    """A stop request during the first evaluation ends it after its first piece; the resumed run
    evaluates that epoch and goes on, ending where an uninterrupted run ends."""
    monkeypatch.setattr(trainer, "EVAL_CHECK_BATCHES", 2)
    stop = StopRequest()
    evaluate = LocalEngine.evaluate

    def evaluate_then_stop(self, batches, m=None):
        totals = evaluate(self, batches, m)
        stop.requested = True
        return totals

    monkeypatch.setattr(LocalEngine, "evaluate", evaluate_then_stop)
    stopped = tmp_path / "stopped"
    assert train.run(config(stopped), None, stop=stop) == EXIT_REQUEUE
    assert events(stopped, "eval") == []
    (checkpoint,) = events(stopped, "checkpoint")
    assert (checkpoint["epoch"], checkpoint["position"]) == (0, 16)  # the epoch trained, not evaluated
    monkeypatch.setattr(LocalEngine, "evaluate", evaluate)
    assert train.run(config(stopped), None, stop=StopRequest()) == 0

    straight = tmp_path / "straight"
    assert train.run(config(straight), None, stop=StopRequest()) == 0
    a = json.loads((stopped / "summary.json").read_text())["history"]
    b = json.loads((straight / "summary.json").read_text())["history"]
    keys = ("epoch", "val_loss", "val_acc", "val_count", "train_loss", "train_acc", "images")
    assert [[h[k] for k in keys] for h in a] == [[h[k] for k in keys] for h in b]
    assert b[0]["val_count"] == 6 * 16


def test_a_sigterm_stops_at_a_checkpoint_with_its_own_status(tmp_path, capsys, one_thread):
    """SIGTERM (scancel -s TERM without -b, a preemption's grace time without a user signal)
    drains and checkpoints as SIGUSR1 does, but ends with EXIT_STOPPED, not the requeue status:
    a batch script must not requeue a cancelled job. SIGUSR1 still ends with EXIT_REQUEUE."""
    assert train.run(config(tmp_path / "term"), None, stop=signalled(signal.SIGTERM)) == \
        EXIT_STOPPED == 4
    (stopped,) = events(tmp_path / "term", "stop")
    assert stopped["exit_status"] == EXIT_STOPPED and events(tmp_path / "term", "checkpoint")
    err = capsys.readouterr().err
    assert "received SIGTERM" in err and "exit status 4 (not for a requeue" in err, err[-2000:]
    assert train.run(config(tmp_path / "usr1"), None, stop=signalled(signal.SIGUSR1)) == \
        EXIT_REQUEUE


def test_evaluation_pieces_add_up():
    """Pieces of EVAL_CHECK_BATCHES batches sum to one whole evaluation."""
    calls = []

    class Engine:
        def evaluate(self, batches, m):
            calls.append(m)
            totals = EvalTotals()
            for logits, labels in itertools.islice(batches, m):
                totals.add(logits, labels)
            return totals

    torch.manual_seed(0)
    data = [(torch.randn(4, 10), torch.randint(0, 10, (4,))) for _ in range(600)]
    whole = EvalTotals()
    for logits, labels in data:
        whole.add(logits, labels)
    interrupts = Interrupts(StopRequest())
    totals, stopped = trainer.evaluate_in_pieces(Engine(), iter(data), 600,
                                               lambda: agree(None, interrupts))
    assert calls == [256, 256, 88] and not stopped
    assert (totals.top1, totals.top5, totals.count) == (whole.top1, whole.top5, whole.count)
    assert totals.loss_sum == pytest.approx(whole.loss_sum, rel=1e-12)


@pytest.mark.extended  # the default selection checks cadence in one process
def test_ranks_agree_on_rank0_clock(tmp_path):
    """Under mpirun with a cadence of 60 ns (every vote finds a checkpoint due): only rank 0 keeps
    the clock, and every rank drains and checkpoints at the same points (else they would hang
    or fail); the run finishes."""
    cmd = ["-m", "petra_mpi.train", "configs/quickstart.yaml", *SMALL,
           "--set", f"run.out_dir={tmp_path}", "--set", "run.checkpoint_every_minutes=1e-9"]
    proc = mpirun(3, cmd, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    mid_epoch = [e for e in events(tmp_path, "checkpoint") if 0 < e["position"] < 16]
    assert mid_epoch, events(tmp_path, "checkpoint")
    assert (tmp_path / "summary.json").exists()


def test_decode_cpu_warning():
    cfg = config("/tmp/unused")
    assert "fewer than the 8" in loaders.decode_cpu_warning(cfg, 1, gpu_decode=False)
    assert loaders.decode_cpu_warning(cfg, 8, gpu_decode=False) is None
    assert loaders.decode_cpu_warning(cfg, 1, gpu_decode=True) is None  # nvJPEG decodes
    cfg.data.decode_workers = 2
    assert loaders.decode_cpu_warning(cfg, 2, gpu_decode=False) is None
    assert "--cpus-per-task=3" in loaders.decode_cpu_warning(
        config("/tmp/unused", "--set", "data.decode_workers=3"), 2, gpu_decode=False)
