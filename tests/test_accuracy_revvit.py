"""PETRA learns a reversible ViT like backprop (issue 13): the revvit quickstart (width 64, depth 4,
J = 4, k = 2, AdamW + cosine, 8 epochs on the synthetic set) trained with both methods, side by
side, reaches 0.8 validation accuracy and ends within 2 points."""
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parent.parent


def test_revvit_quickstart_learns_and_petra_within_two_points_of_backprop(tmp_path):
    procs = {}
    for method in ("petra", "backprop"):
        cmd = [sys.executable, "-m", "petra_mpi.train", "configs/quickstart_revvit.yaml", "--set",
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
    assert min(acc.values()) >= 0.8, acc  # both really learn (chance is 0.1)
    assert abs(acc["petra"] - acc["backprop"]) <= 0.02, acc
