"""`python -m petra_mpi.plot`: figures from real (short) training runs, overlays, and forgiving
reading of damaged metrics files."""
import json
import os
import subprocess
import sys

import pytest

from tests.support.launch import run_plot
from tests.support.outputs import check_png
from tests.support.paths import ROOT
from petra_mpi.perf import plot

BASIC = ["loss.png", "accuracy.png", "lr.png", "throughput.png"]
DIAG = ["grad_cosine.png", "grad_norm_ratio.png", "grad_by_stage.png", "rebuild_error.png"]


def train(out_dir, *extra):
    """A real run of the trainer, small: 2 epochs of 6 micro-batches, narrow RevNet18."""
    cmd = [sys.executable, "-m", "petra_mpi.train", "configs/quickstart.yaml",
           f"--set=run.out_dir={out_dir}", "--set=train.epochs=2", "--set=train.limit_batches=6",
           "--set=train.limit_eval_batches=2", "--set=data.synthetic_train=640",
           "--set=data.synthetic_val=128", "--set=model.width=4", "--set=run.progress=false",
           "--set=run.log_every=2", *extra]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return str(out_dir)


@pytest.fixture(scope="module")
def petra_run(tmp_path_factory):
    return train(tmp_path_factory.mktemp("petra"), "--set=train.diag_every=2")


@pytest.fixture(scope="module")
def backprop_run(tmp_path_factory):
    return train(tmp_path_factory.mktemp("backprop"), "--set=train.method=backprop",
                 "--set=train.epochs=1", "--set=train.limit_batches=4")


@pytest.mark.extended
def test_basic_figures_from_real_run(petra_run, tmp_path):
    proc = run_plot(petra_run, "--out", tmp_path)
    assert proc.returncode == 0, proc.stderr
    printed = proc.stdout.split()
    for name in BASIC:
        path = os.path.join(tmp_path, name)
        assert path in printed
        check_png(path)
    # Defaults to the run dir itself.
    proc = run_plot(petra_run)
    assert proc.returncode == 0, proc.stderr
    check_png(os.path.join(petra_run, "loss.png"))


@pytest.mark.extended
def test_diag_figures_from_real_run(petra_run, tmp_path):
    """Needs the trainer's "diag" events (train.diag_every): Fig. 5/6 style figures."""
    run = plot.load_run(petra_run)
    assert run.diag, "the trainer wrote no diag events with train.diag_every=2"
    J = plot.num_stages(run)
    curves = plot.diag_by_stage(run.diag, "cos_petra_e2e")
    assert sorted(curves) == list(range(J))  # one curve per stage
    for epochs, means in curves.values():
        assert epochs == [1, 2]  # points are epoch means, 1-indexed
        assert all(-1.0001 <= m <= 1.0001 for m in means)
    proc = run_plot(petra_run, "--out", tmp_path)
    assert proc.returncode == 0, proc.stderr
    for name in DIAG:
        assert os.path.join(tmp_path, name) in proc.stdout.split()
        check_png(os.path.join(tmp_path, name))


@pytest.mark.extended
def test_overlay_has_one_series_per_run(petra_run, backprop_run, tmp_path):
    runs = plot.load_runs([petra_run, backprop_run])
    labels = [r.label for r in runs]
    assert labels == ["petra/revnet18", "backprop/revnet18"]  # from the start lines
    data = plot.series(runs)
    for figure in ("loss", "lr", "throughput"):
        per_run = {c.run for c in data[figure] if c.style == "-"}
        assert per_run == {0, 1}, figure
    legend = [c.label for c in data["loss"]]
    assert "petra/revnet18 train" in legend and "backprop/revnet18 train" in legend
    assert "backprop/revnet18 val" in legend
    # --labels replace the defaults, and both runs' PNGs go to --out.
    runs = plot.load_runs([petra_run, backprop_run], ["A", "B"])
    assert {c.label for c in plot.series(runs)["lr"]} == {"A", "B"}
    proc = run_plot(petra_run, backprop_run, "--out", tmp_path, "--labels", "A,B")
    assert proc.returncode == 0, proc.stderr
    for name in BASIC:
        check_png(os.path.join(tmp_path, name))


@pytest.mark.extended
def test_same_label_gets_dir_name(petra_run):
    runs = plot.load_runs([petra_run, petra_run])
    assert runs[0].label != "petra/revnet18" and runs[0].label.startswith("petra/revnet18 (")


def write_lines(path, lines, tail=""):
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "metrics.jsonl"), "w") as f:
        f.writelines(json.dumps(line) + "\n" for line in lines)
        f.write(tail)


def damaged_run(path):
    """A killed run: unknown events and keys, nan as a string, null, a truncated last line."""
    lines = [{"event": "start", "stages": 3, "method": "petra", "arch": "revnet18"},
             {"event": "checkpoint", "path": "x"}, "not an object"]
    for step in range(1, 9):
        epoch = (step - 1) // 4
        lines.append({"event": "train", "step": step, "epoch": epoch, "loss": 2.0 / step,
                      "acc": 0.1 * step, "lr": 0.1, "images_per_s": 100.0 + step, "new_key": 1})
        if step == 5:
            lines[-1]["loss"] = "nan"
        if step % 2 == 0:
            for stage in range(3):
                lines.append({"event": "diag", "step": step, "epoch": epoch, "stage": stage,
                              "cos_petra_delayed": 0.5 + 0.1 * stage + 0.01 * step,
                              "cos_petra_e2e": 0.4 + 0.1 * stage, "cos_delayed_e2e": "nan",
                              "norm_petra_delayed": 1.0, "norm_petra_e2e": 1.1,
                              "norm_delayed_e2e": 1.2,
                              "rebuild_error": None if stage == 0 else 1e-6 * step})
        if step % 4 == 0:
            lines.append({"event": "eval", "epoch": epoch, "step": step, "val_loss": 1.5,
                          "val_acc": 0.2 + 0.1 * epoch, "val_top5": 0.5, "val_count": 10})
    write_lines(path, lines, tail='{"event": "train", "step": 9, "epo')


def test_damaged_metrics_still_plot(tmp_path):
    run_dir = tmp_path / "killed"
    damaged_run(run_dir)
    run = plot.load_run(str(run_dir))
    assert len(run.train) == 8 and len(run.eval) == 2 and len(run.diag) == 12
    xs, ys = plot.xy(run.train, "step", "loss")
    assert xs == [1, 2, 3, 4, 6, 7, 8]  # the nan at step 5 is skipped
    # Epoch means of the diag values: epoch 1 = steps 2 and 4, epoch 2 = steps 6 and 8.
    epochs, means = plot.diag_by_stage(run.diag, "cos_petra_delayed")[2]
    assert epochs == [1, 2] and means == pytest.approx([0.73, 0.77])
    assert plot.diag_by_stage(run.diag, "cos_delayed_e2e") == {}
    # Rebuild errors against step; several measurements under one step are averaged.
    assert plot.step_means(run.diag, "rebuild_error") == ([2, 4, 6, 8], pytest.approx(
        [2e-6, 4e-6, 6e-6, 8e-6]))
    twice = [{"step": 3, "rebuild_error": 1.0}, {"step": 3, "rebuild_error": 3.0}]
    assert plot.step_means(twice, "rebuild_error") == ([3], [2.0])
    assert plot.by_stage_at_epoch(run, 2, "cos_petra_e2e") == ([0, 1, 2], pytest.approx(
        [0.4, 0.5, 0.6]))
    assert plot.main([str(run_dir)]) == 0
    for name in BASIC + DIAG:
        check_png(os.path.join(run_dir, name))


def test_bad_inputs_exit_2(tmp_path):
    proc = run_plot(tmp_path / "missing")
    assert proc.returncode == 2
    assert "no metrics.jsonl" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    write_lines(tmp_path / "empty", [{"event": "start", "method": "petra"}], tail='{"event": "tr')
    proc = run_plot(tmp_path / "empty")
    assert proc.returncode == 2 and "no usable lines" in proc.stderr
    damaged_run(tmp_path / "ok")
    assert plot.main([str(tmp_path / "ok"), "--labels", "A,B"]) == 2  # 2 labels for 1 run


def test_missing_matplotlib_exit_2(tmp_path, monkeypatch, capsys):
    damaged_run(tmp_path)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes `import matplotlib` fail
    assert plot.main([str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "matplotlib is not installed" in err and len(err.strip().splitlines()) == 1
