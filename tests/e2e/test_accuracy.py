"""PETRA learns like backprop: a quickstart trained with both methods, side by side, ends within 2
points of accuracy. The CNN quickstart (RevNet18 width 8, J = 4, k = 2, 8 epochs on the synthetic
set) and the reversible-ViT one (width 64, depth 4, J = 4, micro-batch 8, k = 8, AdamW + cosine,
6 epochs; issue 13)."""
import json
import os
import subprocess
import sys

from conftest import ROOT


def accuracies_side_by_side(tmp_path, config) -> dict:
    """Validation accuracy of PETRA and of backprop, trained at once with one thread each."""
    procs = {}
    for method in ("petra", "backprop"):
        cmd = [sys.executable, "-m", "petra_mpi.train", config, "--set",
               f"run.out_dir={tmp_path / method}", "--set", f"train.method={method}", "--set",
               "run.threads=1", "--set", "run.progress=false"]
        procs[method] = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE,
                                         stderr=subprocess.STDOUT, text=True,
                                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    acc = {}
    for method, proc in procs.items():
        out, _ = proc.communicate(timeout=900)
        assert proc.returncode == 0, out[-3000:]
        summary = json.loads((tmp_path / method / "summary.json").read_text())
        assert summary["stages"] == 4 and summary["method"] == method
        acc[method] = summary["val_acc"]
    return acc


def test_petra_within_two_points_of_backprop(tmp_path):
    acc = accuracies_side_by_side(tmp_path, "configs/quickstart.yaml")
    assert acc["backprop"] > 0.9, acc  # both really learn (chance is 0.1)
    assert abs(acc["petra"] - acc["backprop"]) <= 0.02, acc


def test_revvit_quickstart_learns_and_petra_within_two_points_of_backprop(tmp_path):
    acc = accuracies_side_by_side(tmp_path, "configs/quickstart_revvit.yaml")
    assert min(acc.values()) >= 0.8, acc  # both really learn (chance is 0.1)
    assert abs(acc["petra"] - acc["backprop"]) <= 0.02, acc
