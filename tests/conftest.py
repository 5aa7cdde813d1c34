"""Shared by every test: the repository's paths, the launcher for real `mpirun` jobs, the
shortened quick start, and the markers that sort tests by kind.

Tests live in three folders, each test marked with its folder's name: `unit` (in one process),
`mpi` (real `mpirun` jobs) and `e2e` (a SLURM cluster, learning curves, benchmarks, plots, GPU).
`python -m pytest -q` runs the default selection, a few minutes on two cores; tests marked
`extended` (and `slow`, which implies `extended`) run with `python -m pytest -q -m ""` (all) or
`-m extended` (only them)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).parent
ROOT = TESTS.parent
PROGRAMS = TESTS / "programs"  # the scripts that mpirun launches; their data helpers are imported
sys.path.insert(0, str(PROGRAMS))

# The quickstart shortened; model.stages=0: one stage per rank (or per block in one process).
QUICK = ["--set", "train.limit_batches=12", "--set", "train.epochs=1", "--set",
         "data.synthetic_train=1024", "--set", "data.synthetic_val=128", "--set", "model.width=4",
         "--set", "run.progress=false", "--set", "model.stages=0"]


def mpirun(n, args, timeout=180, env=None):
    """Launch for real; a hang fails the test through the timeout instead of freezing CI."""
    cmd = ["mpirun", "-n", str(n), sys.executable] + [str(a) for a in args]
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                          env=full_env)


def check_run_outputs(out_dir, epochs, stages):
    """The output contract of a finished run: metrics.jsonl lines and summary.json."""
    records = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["event"] == "train"]
    evals = [r for r in records if r["event"] == "eval"]
    assert train and len(evals) == epochs
    for r in train:
        assert {"step", "epoch", "loss", "lr", "images_per_s"} <= r.keys()
        assert r["loss"] > 0 and r["images_per_s"] > 0
    for r in evals:
        assert {"epoch", "step", "val_loss", "val_acc"} <= r.keys() and 0 <= r["val_acc"] <= 1
    summary = json.loads((out_dir / "summary.json").read_text())
    assert summary["epochs"] == epochs and summary["stages"] == stages
    assert summary["val_acc"] == evals[-1]["val_acc"]
    assert summary["best_val_acc"] == max(r["val_acc"] for r in evals)
    assert len(summary["memory"]) == stages
    assert all(m["param_bytes"] > 0 for m in summary["memory"])
    return summary


def run_plot(*args):
    return subprocess.run([sys.executable, "-m", "petra_mpi.plot", *map(str, args)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)


def check_png(path):
    """A real picture: PNG signature, more than a blank canvas's bytes, decodes, not one colour."""
    from PIL import Image

    assert os.path.isfile(path), f"{path} not written"
    with open(path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n", path
    assert os.path.getsize(path) > 5000, path
    with Image.open(path) as img:
        img.load()
        extrema = img.convert("RGB").getextrema()
    assert any(lo != hi for lo, hi in extrema), f"{path} is a single colour"


KINDS = ("unit", "mpi", "e2e")


@pytest.hookimpl(tryfirst=True)  # before -m deselects: `slow` must already imply `extended`
def pytest_collection_modifyitems(items):
    for item in items:
        kind = Path(item.fspath).parent.name
        if kind in KINDS:
            item.add_marker(kind)
        if item.get_closest_marker("slow"):
            item.add_marker(pytest.mark.extended)
