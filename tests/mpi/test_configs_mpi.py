"""A shipped config as the mission states it, under mpirun: `mpirun -n 10 python -m
petra_mpi.train configs/cifar10.yaml` (the configs' checks without MPI are unit/test_configs.py)."""
import json
import subprocess
import sys

import pytest

from tests.support.launch import mpirun
from tests.support.paths import ROOT
from tests.support.upstream_formats import make_cifar10


@pytest.mark.extended
def test_mission_command_cifar10_under_mpirun_10(tmp_path):
    """`mpirun -n 10 python -m petra_mpi.train configs/cifar10.yaml` for real, on a CIFAR-10 file
    packed by petra_mpi.prep.cifar from a small tarball in the upstream format, shrunk only by --set."""
    make_cifar10(tmp_path / "src", n=80, n_test=64)  # 400 train, 64 val images of 10 classes
    data = tmp_path / "cifar10.h5"
    subprocess.run([sys.executable, "-m", "petra_mpi.prep.cifar", "--variant", "cifar10", "--source",
                    str(tmp_path / "src"), "--out", str(data)], check=True, capture_output=True,
                   timeout=120, cwd=ROOT)
    out = tmp_path / "run"
    sets = [f"data.path={data}", f"run.out_dir={out}", "run.device=cpu", "run.progress=false",
            "model.width=4", "train.epochs=1", "train.limit_batches=6", "train.limit_eval_batches=1"]
    proc = mpirun(10, ["-m", "petra_mpi.train", "configs/cifar10.yaml"]
                  + [a for s in sets for a in ("--set", s)], timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r for r in records if r["event"] == "train"]
    assert len([r for r in records if r["event"] == "eval"]) == 1
    summary = json.loads((out / "summary.json").read_text())
    assert summary["stages"] == 10 and summary["epochs"] == 1 and summary["method"] == "petra"
    assert len(summary["memory"]) == 10 and 0 <= summary["val_acc"] <= 1
