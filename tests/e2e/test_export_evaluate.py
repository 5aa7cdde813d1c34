"""The trained model out of the pipeline: `petra_mpi.export` writes a plain state_dict (or a
torch.export program) that loads in one process without MPI, and `petra_mpi.evaluate` gives
exactly the run's final evaluation, on the quickstart (under mpirun) and on a CIFAR-10 file packed
by petra_mpi.prep.cifar."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from petra_mpi.run.checkpoint import complete_checkpoints
from tests.support.launch import mpirun
from tests.support.paths import ROOT

ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def python(*args, timeout=180):
    return subprocess.run([sys.executable, *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT, env=ENV)


def final_eval(run_dir):
    records = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text()
               .splitlines()]
    return [r for r in records if r["event"] == "eval"][-1]


def evaluated(*args):
    proc = python("-m", "petra_mpi.evaluate", *args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    assert "top-1" in lines[-2] and "top-5" in lines[-2]
    return json.loads(lines[-1])


def assert_same_evaluation(got, want):
    for key in ("val_acc", "val_top5", "val_count", "val_loss"):
        assert got[key] == want[key], (key, got, want)


def export(run_dir, out, *args):
    proc = python("-m", "petra_mpi.export", run_dir, "--out", out, *args)
    assert proc.returncode == 0, proc.stderr[-3000:]


@pytest.fixture(scope="module")
def quickstart(tmp_path_factory):
    """The quickstart under mpirun -n 4, shrunk: 16 micro-batches, 200 validation images (the
    last evaluation batch is short)."""
    out = tmp_path_factory.mktemp("quickstart")
    sets = ["model.width=4", "data.synthetic_train=1024", "data.synthetic_val=200",
            "train.epochs=1", "run.progress=false", "model.balance=estimate",
            f"run.out_dir={out}"]
    proc = mpirun(4, ["-m", "petra_mpi.train", "configs/quickstart.yaml",
                      *[a for s in sets for a in ("--set", s)]])
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


# extended: the default selection checks the same with tests/unit/test_export_as_evaluated.py (a
# bf16, int8-forward run) and the documented export of tests/e2e/test_docs.py
@pytest.mark.extended
def test_exported_quickstart_model_evaluates_to_the_runs_final_evaluation(quickstart, tmp_path):
    export(quickstart, tmp_path / "model.pt")
    want = final_eval(quickstart)
    got = evaluated(tmp_path / "model.pt")
    assert_same_evaluation(got, want)
    assert got["val_count"] == 200 and got["val_acc"] > 0
    assert_same_evaluation(evaluated(quickstart), want)  # straight from the run directory


LOAD = """
import sys, torch, petra_mpi.models
saved = torch.load(sys.argv[1])
model = petra_mpi.models.build_network(**saved["network"])
model.load_state_dict(saved["state_dict"])
assert type(model).__name__ == "Network" and "mpi4py" not in sys.modules
assert not any(name.startswith(("petra_mpi.engines", "petra_mpi.core.stages")) for name in sys.modules)
x = torch.load(sys.argv[2])
torch.save(model.eval()(x), sys.argv[3])
"""

LOAD_PROGRAM = """
import sys, torch
program = torch.export.load(sys.argv[1]).module()
torch.save(program(torch.load(sys.argv[2])), sys.argv[3])
"""


@pytest.mark.extended
def test_the_documented_three_lines_load_the_checkpoints_weights(quickstart, tmp_path):
    """The three lines of docs/running.md in a fresh process: a plain module, no MPI and no
    pipeline code, whose state is the final checkpoint's, bitwise; the torch.export program
    loads with torch alone and computes the same logits."""
    export(quickstart, tmp_path / "model.pt")
    export(quickstart, tmp_path / "model.pt2", "--format", "torch.export")
    x = torch.randn(3, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    torch.save(x, tmp_path / "x.pt")
    proc = python("-c", LOAD, tmp_path / "model.pt", tmp_path / "x.pt", tmp_path / "plain.pt")
    assert proc.returncode == 0, proc.stderr[-3000:]
    proc = python("-c", LOAD_PROGRAM, tmp_path / "model.pt2", tmp_path / "x.pt",
                  tmp_path / "program.pt")
    assert proc.returncode == 0, proc.stderr[-3000:]
    plain, program = torch.load(tmp_path / "plain.pt"), torch.load(tmp_path / "program.pt")
    assert plain.shape == (3, 10) and torch.equal(plain, program)

    saved = torch.load(tmp_path / "model.pt")
    final = Path(complete_checkpoints(str(quickstart))[-1])
    stored = {}
    for f in final.glob("stage*.pt"):
        stored.update(torch.load(f, weights_only=True)["stage"])
    assert saved["state_dict"].keys() == stored.keys()
    for name, value in stored.items():
        assert torch.equal(saved["state_dict"][name], value), name


@pytest.mark.extended
def test_exported_model_on_a_packed_cifar_file_evaluates_to_the_runs_final_evaluation(tmp_path):
    from tests.support.upstream_formats import make_cifar10
    make_cifar10(tmp_path / "src", n=40, n_test=70)  # 200 train, 70 val images of 10 classes
    data = tmp_path / "cifar10.h5"
    proc = python("-m", "petra_mpi.prep.cifar", "--variant", "cifar10", "--source", tmp_path / "src",
                  "--out", data)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = tmp_path / "run"
    sets = [f"data.path={data}", f"run.out_dir={out}", "run.device=cpu", "run.progress=false",
            "run.threads=1", "model.width=4", "model.stages=3", "model.balance=estimate",
            "data.batch_size=32", "train.epochs=1", "train.limit_batches=4"]
    proc = python("-m", "petra_mpi.train", "configs/cifar10.yaml",
                  *[a for s in sets for a in ("--set", s)], timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    export(out, tmp_path / "model.pt")
    got = evaluated(tmp_path / "model.pt", "--data", data, "--split", "val")
    assert got["val_count"] == 70  # batches of 32, 32 and 6
    assert_same_evaluation(got, final_eval(out))


@pytest.mark.extended
def test_evaluate_refuses_a_data_set_with_other_classes(quickstart, tmp_path):
    from tests.support.upstream_formats import make_cifar100
    make_cifar100(tmp_path / "src")
    data = tmp_path / "cifar100.h5"
    proc = python("-m", "petra_mpi.prep.cifar", "--variant", "cifar100", "--source", tmp_path / "src",
                  "--out", data)
    assert proc.returncode == 0, proc.stderr[-3000:]
    proc = python("-m", "petra_mpi.evaluate", quickstart, "--data", data)
    assert proc.returncode == 2 and "100 classes, the model 10" in proc.stderr
