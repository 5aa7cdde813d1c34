"""scripts/gap_vs_epochs.py: PETRA minus backprop from the runs' own summaries, one point per pair
at the epochs trained, lines by label in order of epochs, and a pair of unequal lengths refused."""
import json
import subprocess
import sys

from tests.support.outputs import check_png
from tests.support.paths import ROOT


def finished(folder, epochs, acc):
    folder.mkdir()
    (folder / "summary.json").write_text(json.dumps({"epochs": epochs, "val_acc": acc}))
    return str(folder)


def gap_script(*args):
    return subprocess.run([sys.executable, "scripts/gap_vs_epochs.py", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)


def test_gap_against_epochs_from_the_summaries(tmp_path):
    runs = {name: finished(tmp_path / name, epochs, acc) for name, epochs, acc in [
        ("p18", 18, 0.91), ("b18", 18, 0.925), ("p9", 9, 0.89), ("b9", 9, 0.92)]}
    out = tmp_path / "gap.png"
    proc = gap_script("--out", str(out), "--pair", "plain", runs["p18"], runs["b18"],
                      "--pair", "plain", runs["p9"], runs["b9"], "--point", "paper", "300", "0")
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = [line.split("|")[1:-1] for line in proc.stdout.splitlines()[2:]]
    assert [[c.strip() for c in r] for r in rows] == [
        ["plain", "9", "0.8900", "0.9200", "-3.00"],
        ["plain", "18", "0.9100", "0.9250", "-1.50"],
        ["paper", "300", "", "", "+0.00"]]
    check_png(out)
    unequal = gap_script("--out", str(out), "--pair", "x", runs["p9"], runs["b18"])
    assert unequal.returncode != 0 and "not a pair" in unequal.stderr
