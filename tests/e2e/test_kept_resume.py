"""Kept blocks across a resume, through the train command in one process: the plan is recorded
with model.memory_budget in every checkpoint, a run resumed under the same budget trains it
again, and one resumed under another budget plans afresh and says so (run/layout.py)."""
import json
import subprocess
import sys

import pytest

from petra_mpi.run.checkpoint import complete_checkpoints
from tests.support.paths import QUICK, ROOT


def train(out, *sets):
    args = [*QUICK, "--set", "data.batch_size=16", "--set", f"run.out_dir={out}",
            "--set", "run.threads=1", *(a for s in sets for a in ("--set", s))]
    proc = subprocess.run([sys.executable, "-m", "petra_mpi.train", "configs/quickstart.yaml",
                           *args], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    last = complete_checkpoints(str(out))[-1]
    with open(f"{last}/manifest.json") as f:
        manifest = json.load(f)
    with open(out / "summary.json") as f:
        kept_bytes = [m["kept_peak_bytes"] for m in json.load(f)["memory"]]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return proc.stderr, manifest, kept_bytes, records


@pytest.mark.extended  # four short runs of the train command
def test_a_lowered_budget_plans_afresh_and_the_same_budget_resumes_the_plan(tmp_path):
    # 3 stages split and planned by the cost estimate (timings would make the plan depend on the
    # machine's load) under no limit, resumed under budget 0: PETRA, said in the resume line and
    # its record
    out = tmp_path / "lowered"
    _, first, kept_bytes, _ = train(out, "model.stages=3", "model.balance=estimate",
                                    "model.memory_budget=auto")
    assert first["memory_budget"] == "auto" and any(map(any, first["kept"]))
    assert any(kept_bytes)
    err, resumed, kept_bytes, records = train(out, "model.stages=3", "model.balance=estimate",
                                              "model.memory_budget=0", "train.epochs=2")
    assert resumed["memory_budget"] == 0 and resumed["kept"] is None
    assert kept_bytes == [0, 0, 0]  # what the resumed run's stages kept: nothing
    said = (f"kept blocks {first['kept']} -> none (PETRA) (model.memory_budget auto -> 0, "
            f"planned afresh")
    assert said in err
    (resume,) = [r for r in records if r["event"] == "resume"]
    assert any(c.startswith(said) for c in resume["layout_changes"])
    # one block per stage (a fixed split): its plan is made in the blocks' measured times (on a
    # loaded machine keeping may not pay, and the plan keeps nothing: what it keeps is the
    # timings' business) and recorded; resumed under the same budget, trained again without
    # timing the blocks again
    out = tmp_path / "fixed"
    err, first, kept_bytes, _ = train(out, "model.memory_budget=auto")
    assert "blocks timed for the kept plan" in err
    assert first["partition"] == [1] * 10 and first["memory_budget"] == "auto"
    assert len(first["kept"]) == 10
    assert any(kept_bytes) == any(map(any, first["kept"]))  # the run trained its plan
    err, resumed, _, records = train(out, "model.memory_budget=auto", "train.epochs=2")
    assert "blocks timed" not in err and resumed["kept"] == first["kept"]
    (resume,) = [r for r in records if r["event"] == "resume"]
    assert resume["layout_changes"] == []


@pytest.mark.extended  # two short runs of the train command
def test_rebuild_last_stage_is_recorded_and_may_change_on_resume(tmp_path):
    """model.rebuild_last_stage goes with the layout: recorded in every checkpoint, and a run
    resumed with it switched on follows its own config (its last stage buffers its inputs) and
    says so; the split is the checkpoint's."""
    out = tmp_path / "rebuild"
    _, first, _, _ = train(out, "model.stages=3", "model.balance=estimate")
    assert first["rebuild_last_stage"] is False
    err, resumed, _, records = train(out, "model.stages=3", "model.balance=estimate",
                                     "model.rebuild_last_stage=true", "train.epochs=2")
    assert resumed["rebuild_last_stage"] is True and resumed["partition"] == first["partition"]
    with open(out / "summary.json") as f:
        fifo = [m["input_fifo_peak_bytes"] for m in json.load(f)["memory"]]
    assert fifo[-1] > 0  # the last stage rebuilt (quickstart's revnet18 ends in a head)
    said = "model.rebuild_last_stage false -> true (the last stage's memory and time change"
    assert said in err
    (resume,) = [r for r in records if r["event"] == "resume"]
    assert any(c.startswith(said) for c in resume["layout_changes"])
