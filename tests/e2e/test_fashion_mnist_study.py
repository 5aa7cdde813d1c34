"""scripts/fashion_mnist_study.py end to end on a tiny packed IDX file: it trains each (method, J,
seed) in its own folder, keeps finished runs when started again, draws the curves and tabulates
the medians and PETRA minus backprop from the runs' own summaries."""
import json
import statistics
import subprocess
import sys

import pytest

from tests.support.outputs import check_png
from tests.support.paths import ROOT
from tests.support.idx_files import make_set, pack

TINY = ["model.width=4", "train.epochs=1", "train.limit_batches=3", "data.batch_size=16",
        "run.threads=1", "run.progress=false", "run.device=cpu"]


def study(data, out, *extra):
    args = ["--stages", "2", "--seeds", "0", "1", "--out", out, "--set", f"data.path={data}"]
    for setting in TINY:
        args += ["--set", setting]
    return subprocess.run([sys.executable, "scripts/fashion_mnist_study.py", *args, *extra],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)


@pytest.mark.extended
def test_study_runs_tabulates_and_keeps_finished_runs(tmp_path):
    make_set(tmp_path / "fashion-mnist", n_train=96, n_val=32)
    data = tmp_path / "fm.h5"
    assert pack("--source", tmp_path / "fashion-mnist", "--out", data)[0] == 0
    out = tmp_path / "study"
    proc = study(data, out)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    acc = {}
    for method in ("petra", "backprop"):
        acc[method] = []
        for seed in (0, 1):
            summary = json.loads((out / f"{method}_J2_mb16_s{seed}" / "summary.json").read_text())
            assert (summary["method"], summary["stages"]) == (method, 2)
            acc[method].append(summary["val_acc"])
    check_png(out / "J2" / "accuracy.png")
    rows = {line.split("|")[2].strip(): [c.strip() for c in line.split("|")[1:-1]]
            for line in (out / "table.md").read_text().splitlines()[2:]}
    petra, backprop = statistics.median(acc["petra"]), statistics.median(acc["backprop"])
    assert rows["petra"][:4] == ["2", "petra", "2", f"{petra:.4f}"]
    assert rows["backprop"][:4] == ["any", "backprop", "2", f"{backprop:.4f}"]
    assert rows["petra"][5] == f"{100 * (petra - backprop):+.2f}"
    again = study(data, out, "--methods", "petra")
    assert again.returncode == 0, again.stderr[-3000:]
    assert again.stdout.count("kept: ") == 2 and "run: " not in again.stdout
