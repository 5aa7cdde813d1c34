"""What a user sees when a command meets a run directory, a data file or a machine that is not
what it expects: one plain line (or a clear skip), never a traceback, a silent no-op or a run that
crowds the CPUs."""
import json
import os
import subprocess
import sys

import h5py
import numpy as np
import pytest

from tests.support.launch import run_plot
from tests.support.paths import ROOT

TINY = ["--set", "train.epochs=1", "--set", "train.limit_batches=2", "--set",
        "train.limit_eval_batches=1", "--set", "data.synthetic_train=256", "--set",
        "data.synthetic_val=64", "--set", "model.width=4", "--set", "run.progress=false",
        "--set", "model.balance=estimate"]


def train(out_dir, *extra, env=None):
    cmd = [sys.executable, "-m", "petra_mpi.train", "configs/quickstart.yaml", *TINY,
           "--set", f"run.out_dir={out_dir}", *extra]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, **(env or {})})


def error_lines(proc):
    """stderr less the warning a busy machine adds (the tests share their machine)."""
    return [line for line in proc.stderr.strip().splitlines()
            if "do not fit beside them" not in line]


@pytest.mark.extended  # slow: the default selection stays under 5 minutes
def test_finished_run_does_nothing_and_a_changed_recipe_is_told_where_to_go(tmp_path):
    out = tmp_path / "run"
    first = train(out, "--set", "run.trace=true")
    assert first.returncode == 0, first.stderr
    before = {p: (out / p).read_bytes() for p in ("metrics.jsonl", "summary.json", "trace.json")}
    again = train(out, "--set", "run.trace=true")
    assert again.returncode == 0, again.stderr
    assert "already finished, nothing to do (use another run.out_dir" in again.stderr
    assert "resumed from" not in again.stderr
    # nothing rewritten: the finished run's metrics, summary and trace stay as they were
    assert {p: (out / p).read_bytes() for p in before} == before
    other = train(out, "--set", "train.method=backprop")
    assert other.returncode == 1
    assert "method: checkpoint has 'petra'" in other.stderr
    assert "--set run.out_dir=" in other.stderr


def packed(path, labels, num_classes=10):
    """A small file in the dataset schema whose training labels are `labels`."""
    with h5py.File(path, "w") as f:
        f.attrs.update(schema_version=1, num_classes=num_classes, mean=[0.5] * 3, std=[0.25] * 3,
                       source="test")
        for split, y in (("train", np.asarray(labels, np.int64)),
                         ("val", np.arange(16, dtype=np.int64) % num_classes)):
            f.create_dataset(f"{split}/images", data=np.zeros((len(y), 32, 32, 3), np.uint8))
            f.create_dataset(f"{split}/labels", data=y)


def test_label_outside_num_classes_is_one_line_at_start(tmp_path):
    path = tmp_path / "bad.h5"
    labels = np.arange(128) % 10
    labels[77] = 42
    packed(path, labels)
    proc = train(tmp_path / "run", "--set", f"data.path={path}")
    assert proc.returncode == 1
    lines = error_lines(proc)
    assert len(lines) == 1, proc.stderr
    assert "/train/labels" in lines[0] and "42" in lines[0] and "[0, 10)" in lines[0]
    assert "Traceback" not in proc.stderr


def test_missing_data_names_the_path_once_and_the_packers(tmp_path):
    path = tmp_path / "cifar10.h5"
    proc = train(tmp_path / "run", "--set", f"data.path={path}")
    assert proc.returncode == 1
    lines = error_lines(proc)
    assert len(lines) == 1, proc.stderr
    assert lines[0].count(str(path)) == 1 and "petra_mpi.prep" in lines[0]


def test_verify_says_an_attribute_is_missing(tmp_path):
    path = tmp_path / "nomean.h5"
    packed(path, np.arange(64) % 10)
    with h5py.File(path, "a") as f:
        del f.attrs["mean"]
    proc = subprocess.run([sys.executable, "-m", "petra_mpi.prep.verify", str(path)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert "attr mean is missing" in out and "float64(0,)" not in out


def test_packed_data_folder_is_ignored_by_git():
    def ignored(path):
        return subprocess.run(["git", "check-ignore", "-q", path], cwd=ROOT).returncode == 0
    assert ignored("data/cifar10.h5")
    assert not ignored("petra_mpi/data/new_module.py")


def write_run_with_empty_trace(run_dir):
    os.makedirs(run_dir)
    lines = [{"event": "start", "stages": 2, "method": "petra", "arch": "revnet18"}]
    for step in range(1, 5):
        lines.append({"event": "train", "step": step, "epoch": 0, "loss": 2.0 / step,
                      "lr": 0.1, "images_per_s": 100.0})
    lines.append({"event": "eval", "epoch": 0, "step": 4, "val_loss": 1.5, "val_acc": 0.3,
                  "val_top5": 0.5})
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    (run_dir / "trace.json").write_text(json.dumps({"traceEvents": []}))


def test_plot_skips_an_empty_trace_and_prints_what_it_wrote(tmp_path):
    pytest.importorskip("matplotlib")
    run_dir = tmp_path / "run"
    write_run_with_empty_trace(run_dir)
    proc = run_plot(run_dir)
    assert proc.returncode == 0, proc.stderr
    printed = proc.stdout.split()
    assert str(run_dir / "loss.png") in printed and str(run_dir / "accuracy.png") in printed
    assert all(os.path.isfile(p) for p in printed)
    assert "skipped: timeline.png not drawn" in proc.stderr and "no spans" in proc.stderr
    alone = run_plot(run_dir / "trace.json", "--out", tmp_path / "figs")
    assert alone.returncode == 2 and "no spans" in alone.stderr and not alone.stdout.strip()


@pytest.fixture
def burner():
    """One other busy program beside the test: a CPU-bound loop that says when it runs."""
    proc = subprocess.Popen([sys.executable, "-c", "print('busy', flush=True)\nwhile 1: pass"],
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "busy"
    yield proc
    proc.kill()
    proc.wait()


@pytest.mark.extended  # slow: the default selection stays under 5 minutes
def test_threads_leave_room_for_a_busy_program_and_warn_when_they_cannot(tmp_path, burner):
    cpus = len(os.sched_getaffinity(0))
    if cpus < 2:
        pytest.skip("needs 2 CPUs: with one, one thread is all there is")
    env = {"OMP_NUM_THREADS": str(cpus)}  # torch's own default may not be lower than the set
    proc = train(tmp_path / "auto", env=env)
    assert proc.returncode == 0, proc.stderr
    start = json.loads((tmp_path / "auto" / "metrics.jsonl").read_text().splitlines()[0])
    assert start["event"] == "start" and 1 <= start["threads"] <= cpus - 1
    # the warning comes at start-up, before any work: a dry run shows it without the slow steps
    crowded = train(tmp_path / "all", "--set", f"run.threads={cpus}", "--dry-run", env=env)
    assert crowded.returncode == 0, crowded.stderr
    assert "do not fit beside them" in crowded.stderr and "run.threads" in crowded.stderr


def test_cpu_share_counts_what_other_programs_keep_busy():
    from petra_mpi.comm.world import cpu_share, oversubscribed
    assert cpu_share({0, 1}, [{0, 1}]) == 2
    assert cpu_share({0, 1}, [{0, 1}], busy=1.0) == 1
    assert cpu_share({0, 1}, [{0, 1}], busy=2.0) == 1            # never below one thread
    assert cpu_share(set(range(8)), [set(range(8))] * 2, busy=2.2) == 3  # 6 free, 2 ranks
    assert oversubscribed({0, 1}, [{0, 1}], threads=1, busy=1.0) is None
    assert "do not fit" in oversubscribed({0, 1}, [{0, 1}], threads=2, busy=1.0)
    assert oversubscribed({0, 1}, [{0, 1}] * 4, threads=1, busy=0.1) is None  # the run's own
