"""Every command that reads an HDF5 data file, fed the crafted files of tests/support/crafted_h5.py,
each run in a process of its own as a user runs it: `petra_mpi.prep.verify FILE`, the trainer
with `data.path=FILE`, and `petra_mpi.evaluate MODEL --data FILE`. Each ends at once (a timeout
catches a hang), without a traceback or a crash, with its status for bad data and one line
naming the file and what is wrong; nothing is written, and the file is unchanged."""
import hashlib
import subprocess
import sys

import pytest
import torch

from tests.support.crafted_h5 import CASES, CLASSES, WHOLE_FILES, jpeg_file, make, write_h5
from tests.support.paths import ROOT
from petra_mpi.export import MODEL_FORMAT
from petra_mpi.models import build_network

# The status of each command for a bad data file: verify's INVALID (2 for a file it cannot
# open), the trainer's and evaluate's one-line error (docs/clusters.md, "Exit statuses").
STATUS = {"verify": 1, "train": 1, "evaluate": 2}  # evaluate: a file it cannot use
TINY = ["--set", "model.width=4", "--set", "model.balance=estimate", "--set", "run.progress=false",
        "--set", "data.batch_size=4", "--set", "train.limit_batches=2", "--set",
        "train.limit_eval_batches=1"]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """An exported model of CLASSES classes, untrained: evaluate reads it before the data."""
    path = tmp_path_factory.mktemp("model") / "model.pt"
    network = {"arch": "revnet18", "width": 4, "num_classes": CLASSES}
    data = {"path": "synthetic", "batch_size": 4, "synthetic_train": 64, "synthetic_val": 16,
            "synthetic_seed": 0, "crop": 0}
    torch.save({"format": MODEL_FORMAT, "network": network, "data": data, "dtype": "float32",
                "state_dict": build_network(**network).state_dict(), "seed": 0}, path)
    return path


def command(name, path, model, run_dir):
    return {"verify": ["-m", "petra_mpi.prep.verify", str(path)],
            "train": ["-m", "petra_mpi.train", "configs/quickstart.yaml", "--set",
                      f"data.path={path}", "--set", f"run.out_dir={run_dir}", *TINY],
            "evaluate": ["-m", "petra_mpi.evaluate", str(model), "--data", str(path)]}[name]


def run(name, path, model, run_dir):
    proc = subprocess.run([sys.executable, *command(name, path, model, run_dir)], cwd=ROOT,
                          capture_output=True, text=True, timeout=180)
    assert "Traceback" not in proc.stderr and "Fatal Python error" not in proc.stderr, proc.stderr
    return proc


def digests(folder):
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in folder.iterdir()}


def the_line(name, proc, path):
    """The one line that says what is wrong with the file at `path`."""
    lines = proc.stderr.strip().splitlines()
    if name == "verify" and proc.returncode == 1:  # a heading, then one line per problem
        assert lines[0].startswith(f"{path}: INVALID"), proc.stderr
        return lines[1:]
    errors = [line for line in lines if line.startswith(("error", "petra_mpi.prep.verify: error"))]
    assert errors == lines[-1:], proc.stderr  # the last line, and the only error
    assert str(path) in errors[0], errors
    return errors


@pytest.mark.extended  # 3 commands x 17 files, each a process loading torch: about 2 minutes
@pytest.mark.parametrize("case", CASES)
def test_each_reader_refuses_a_crafted_file_in_one_line(case, tmp_path, model):
    folder = tmp_path / "data"
    folder.mkdir()
    path = make(case, folder)
    before = digests(folder)
    words = CASES[case][1]
    for name in STATUS:
        proc = run(name, path, model, tmp_path / "run")
        status = 2 if name == "verify" and case in WHOLE_FILES else STATUS[name]
        assert proc.returncode == status, (name, proc.returncode, proc.stderr)
        lines = the_line(name, proc, path)
        assert any(all(word in line for word in words) for line in lines), (name, lines)
    assert digests(folder) == before  # unchanged, and nothing written beside it
    assert not (tmp_path / "run").exists()


@pytest.mark.extended
def test_a_picture_that_does_not_decode_stops_training_in_one_line(tmp_path, model):
    """Found mid-run, where the picture is read: the trainer and evaluate stop with one line
    naming the file and the picture."""
    path = tmp_path / "j.h5"
    write_h5(path, jpeg_file)
    import h5py
    with h5py.File(path, "r+") as f:
        for split in ("train", "val"):
            f[f"{split}/jpeg"][:] = 0
    for name in ("train", "evaluate"):
        proc = run(name, path, model, tmp_path / "run")
        assert proc.returncode == STATUS[name], proc.stderr
        line, = the_line(name, proc, path)
        assert "/jpeg image" in line and "does not decode (not a picture)" in line, line
