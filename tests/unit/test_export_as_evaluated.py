"""An exported run evaluates as the run did when its blocks computed in bf16 and its forward
messages were compressed: the export records run.precision, comm.forward and the stage split,
and petra_mpi.evaluate applies them (in one process; the e2e tests cover float32 runs under
mpirun and packed files)."""
import json
from pathlib import Path

import pytest
import torch

from tests.support.paths import QUICK
from petra_mpi import evaluate
from petra_mpi import export
from petra_mpi import train


def final_eval(run_dir):
    lines = (Path(run_dir) / "metrics.jsonl").read_text().splitlines()
    return [e for e in map(json.loads, lines) if e["event"] == "eval"][-1]


@pytest.fixture(scope="module")
def bf16_compressed_run(tmp_path_factory):
    """The quick start in one process, one stage per block (9 stage boundaries), blocks in bf16,
    forward messages in int8 with one scale per channel."""
    out = tmp_path_factory.mktemp("run")
    threads = torch.get_num_threads()
    try:
        code = train.main(["configs/quickstart.yaml", *QUICK, "--set", f"run.out_dir={out}",
                           "--set", "train.limit_batches=4", "--set", "run.threads=1",
                           "--set", "data.batch_size=32", "--set", "data.synthetic_val=64",
                           "--set", "run.precision=bf16", "--set", "comm.forward=int8_channel",
                           "--set", "model.balance=estimate"])
    finally:
        torch.set_num_threads(threads)
    assert code == 0
    return out


def test_evaluate_reproduces_a_bf16_forward_compressed_run(bf16_compressed_run, tmp_path):
    want = final_eval(bf16_compressed_run)
    export.export(str(bf16_compressed_run), str(tmp_path / "model.pt"))
    saved = evaluate.load_saved(str(tmp_path / "model.pt"))
    assert saved["evaluation"]["precision"] == "bf16"
    assert saved["evaluation"]["forward"] == "int8_channel"
    assert len(saved["evaluation"]["partition"]) == 10
    got = evaluate.evaluate(saved)
    for key in ("val_loss", "val_acc", "val_top5", "val_count"):
        assert got[key] == want[key], (key, got, want)
    # The run's precision and rounding change the figures: the plain float32 module differs.
    assert evaluate.evaluate(saved, plain=True)["val_loss"] != want["val_loss"]


def test_plain_module_is_unchanged_by_the_recorded_evaluation(bf16_compressed_run):
    """The three documented lines still give a float32 module without rounding: the recorded
    evaluation is applied only by as_evaluated."""
    saved = export.exported_model(export.find_checkpoint(str(bf16_compressed_run)))
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        plain = export.load_model(saved)(x)
        rounded = export.as_evaluated(saved)(x)
    assert plain.dtype == torch.float32 and not torch.equal(plain, rounded)
