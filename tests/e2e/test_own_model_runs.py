"""A network of one's own through the commands as a user runs them (extended: several starts of
the commands): the train command under mpirun -n 2 and in one process give the same weights
bitwise, with the start's check said once; a faulty network ends every rank with one line; the
checkpoint exported, evaluated (the run's own accuracy) and used by predict, each told the import
path to import."""
import json
import os
import subprocess
import sys

import pytest
import torch

from petra_mpi.export import exported_run
from tests.support.launch import mpirun
from tests.support.own_nets import PICTURES, write_package
from tests.support.paths import QUICK, ROOT
from tests.support.pictures import make_picture_folder

pytestmark = pytest.mark.extended

RUN = ["-m", "petra_mpi.train", "configs/quickstart.yaml", *QUICK, "--set", f"model.arch={PICTURES}",
       "--set", "model.stages=2", "--set", "model.balance=estimate", "--set", "run.threads=1"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """(the package's folder, its PYTHONPATH, the one-process run, the mpirun -n 2 run, the
    launch's stderr): the same network and data trained both ways."""
    root = tmp_path_factory.mktemp("runs")
    write_package(root)
    path = os.pathsep.join([str(root), str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
    env = {**os.environ, "PYTHONPATH": path}
    local = subprocess.run([sys.executable, *RUN, "--set", f"run.out_dir={root / 'local'}"],
                           cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert local.returncode == 0, local.stderr[-3000:]
    launched = mpirun(2, [*RUN, "--set", f"run.out_dir={root / 'mpi'}"], timeout=600,
                      env={"PYTHONPATH": path})
    assert launched.returncode == 0, launched.stderr[-3000:]
    return root, env, root / "local", root / "mpi", launched.stderr


def test_mpirun_and_one_process_train_it_alike(runs):
    _, _, local, launched, stderr = runs
    weights = [exported_run(str(run))[1]["state_dict"] for run in (local, launched)]
    assert weights[0].keys() == weights[1].keys() and len(weights[0]) > 10
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])
    assert stderr.count(f"petra_mpi: model.arch {PICTURES}: 6 blocks (3 reversible) checked") == 1


def test_its_model_file_is_exported_evaluated_and_predicts(runs):
    root, env, local, _, _ = runs

    def command(*args):
        return subprocess.run([sys.executable, "-m", *map(str, args)], cwd=root, env=env,
                              capture_output=True, text=True, timeout=300)
    refused = command("petra_mpi.export", local, "--out", "model.pt")
    assert refused.returncode == 2 and refused.stderr.count("\n") == 1
    assert f"name it with --arch {PICTURES}" in refused.stderr and not (root / "model.pt").exists()
    assert command("petra_mpi.export", local, "--out", "model.pt", "--arch",
                   PICTURES).returncode == 0
    evaluated = command("petra_mpi.evaluate", "model.pt", "--arch", PICTURES)
    assert evaluated.returncode == 0, evaluated.stderr[-2000:]
    summary = json.loads((local / "summary.json").read_text())
    assert json.loads(evaluated.stdout.splitlines()[-1])["val_acc"] == summary["val_acc"]
    make_picture_folder(root / "photos", per_class=2)
    predicted = command("petra_mpi.predict", "model.pt", "photos", "--arch", PICTURES, "--top", "2")
    assert predicted.returncode == 0, predicted.stderr[-2000:]
    assert len(predicted.stdout.splitlines()) == 6 and "class " in predicted.stdout


def test_a_faulty_network_ends_every_rank_with_one_line(tmp_path):
    proc = mpirun(2, ["-m", "petra_mpi.train", "examples/broken.yaml", "--set",
                      f"run.out_dir={tmp_path}", "--set", "model.options={fault: inverse}"],
                  timeout=300)
    assert proc.returncode == 2
    assert proc.stderr.count("error: model.arch examples.broken:build: block 2 (WrongInverse): "
                             "its inverse is wrong") == 1, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr and not (tmp_path / "metrics.jsonl").exists()
