"""The language model through the train command under mpirun: the MPI engine equals one process
bit for bit (docs/design.md §1, invariant 3)."""
import json
import math
import subprocess
import sys

import pytest
import torch

from tests.support.launch import mpirun
from tests.support.paths import ROOT
from tests.support.token_runs import pack_token_file, tiny_lm_run


def final_stages(out):
    ckpt = sorted((out / "checkpoints").glob("ckpt-e00002-*"))[-1]
    return [torch.load(p, weights_only=True)["stage"] for p in sorted(ckpt.glob("stage*.pt"))]


@pytest.mark.extended  # two runs of the train command, one under mpirun: ~16 s on 2 cores
def test_train_command_mpi_equals_local_bitwise(tmp_path):
    """The train command on a token file, in one process and under mpirun -n 2: the same
    parameters bit for bit, the same metrics, and the evaluation in nats per token and bits per
    byte."""
    token_file = pack_token_file(tmp_path)
    local, mpi = tmp_path / "local", tmp_path / "mpi"
    r = subprocess.run([sys.executable, *tiny_lm_run(token_file, local)],
                       capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stderr.count(" tok/s") == 2 and " img/s" not in r.stderr  # the epoch lines
    r = mpirun(2, tiny_lm_run(token_file, mpi), timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    want, got = final_stages(local), final_stages(mpi)
    assert len(want) == len(got) == 2
    for w, g in zip(want, got):
        assert w.keys() == g.keys()
        assert all(torch.equal(w[k], g[k]) for k in w), "mpirun differs from one process"

    def records(out, event):
        lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
        return [{k: v for k, v in x.items() if "loss" in k or "bpb" in k}
                for x in lines if x["event"] == event]
    evals = records(local, "eval")
    assert records(mpi, "eval") == evals and records(mpi, "train") == records(local, "train")
    assert len(evals) == 2 and evals[1]["val_loss"] < evals[0]["val_loss"]  # it learns
    assert evals[1]["val_bpb"] == pytest.approx(evals[1]["val_loss"] / math.log(2))
    summary = json.loads((local / "summary.json").read_text())
    assert summary["tokens_per_s"] == summary["images_per_s"] > 0
