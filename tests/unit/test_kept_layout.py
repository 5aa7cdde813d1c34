"""The kept plan of a run (run/layout.py): made at start-up on the split the run trains, recorded
with model.memory_budget, trained again by a run resuming under the same budget and planned
afresh (and said) under another; on a fixed split (model.partition, one block per stage) in the
measured costs too. The whole commands: tests/e2e/test_kept_resume.py."""
import dataclasses
import json

import torch

from petra_mpi.config import load_config
from petra_mpi.core.blockcost import BlockCosts
from petra_mpi.core.planner import plan_layout
from petra_mpi.models import NetSpec
from petra_mpi.run.layout import choose_layout, layout_changes, resumed_layout
from tests.support.paths import ROOT

QUICKSTART = ROOT / "configs" / "quickstart.yaml"
SMALL = ["model.width=4", "data.batch_size=8", "run.seed=0"]


def layout_of(tmp_path, *sets, resume=None, J=3):
    """(split, kept plan) of the Layout a run of the quick start with `sets` chooses."""
    cfg = load_config(QUICKSTART, [*SMALL, *sets])
    layout = choose_layout(cfg, J, None, torch.device("cpu"), torch.float32, (3, 32, 32),
                           resume)
    return layout.split, layout.kept


def checkpoint(tmp_path, **manifest):
    path = tmp_path / "ckpt"
    path.mkdir(exist_ok=True)
    (path / "manifest.json").write_text(json.dumps(manifest))
    return str(path)


def test_a_resumed_run_trains_its_plan_only_under_the_same_budget(tmp_path):
    """The checkpoint's split and plan (here a plan no planner would make, to tell it apart)
    under the same model.memory_budget; under another, a fresh one: budget 0 keeps nothing."""
    estimate = "model.balance=estimate"
    split, kept = layout_of(tmp_path, estimate, "model.memory_budget=auto")
    assert sum(split) == 10 and any(map(any, kept)) and not any(kept[-1])
    marker = [[1] * n for n in split]
    ckpt = checkpoint(tmp_path, stages=3, partition=split, kept=marker, memory_budget="auto")
    assert layout_of(tmp_path, estimate, "model.memory_budget=auto", resume=ckpt) == (split,
                                                                                      marker)
    # the estimate's split, nothing kept
    assert layout_of(tmp_path, estimate, "model.memory_budget=0", resume=ckpt) == layout_of(
        tmp_path, estimate) == ([1, 2, 7], None)
    lower = layout_of(tmp_path, estimate, "model.memory_budget=300000", resume=ckpt)
    assert lower == layout_of(tmp_path, estimate, "model.memory_budget=300000")
    assert lower[1] != marker and sum(map(sum, lower[1])) < sum(map(sum, kept))
    # other stages: split afresh, whatever the budget
    assert resumed_layout({"stages": 4, "partition": split, "kept": marker,
                           "memory_budget": "auto"}, 3, "auto") is None
    # a fraction of the memory is not a number of bytes, though 1.0 == 1
    assert resumed_layout({"stages": 3, "partition": split, "kept": marker,
                           "memory_budget": 1.0}, 3, 1) is None
    # an earlier version's manifest records no budget: a plan in it stands for one
    for budget, plan, resumes in (("auto", marker, True), (0, marker, False),
                                  ("auto", None, False), (0, None, True)):
        got = resumed_layout({"stages": 3, "partition": split, "kept": plan}, 3, budget)
        assert ((got.split, got.kept) == (split, plan)) if resumes else got is None, (budget,
                                                                                     plan)


def test_layout_changes_say_a_changed_plan_and_budget():
    old = {"stages": 3, "partition": [2, 2, 6], "kept": [[0, 4], [1, 2], [0] * 6],
           "memory_budget": "auto", "replicas": 1, "microbatches_per_epoch": 12,
           "steps_per_epoch": 6, "peak_lr": 0.1, "device": "cpu", "dtype": "float32",
           "precision": "fp32"}
    assert layout_changes(old, dict(old)) == []
    new = {**old, "partition": [2, 1, 7], "kept": None, "memory_budget": 0}
    changes = layout_changes(old, new)
    assert len(changes) == 2 and changes[0].startswith("split [2, 2, 6] -> [2, 1, 7]")
    assert changes[1].startswith("kept blocks [[0, 4], [1, 2], [0, 0, 0, 0, 0, 0]] -> none "
                                 "(PETRA) (model.memory_budget auto -> 0, planned afresh")
    # a plan keeping nothing is PETRA too
    assert layout_changes({**old, "kept": None}, {**old, "kept": [[0, 0], [0, 0], [0] * 6]}) == []


def test_a_fixed_split_is_planned_in_measured_costs_and_recorded(tmp_path, capsys):
    """model.partition fixed, model.balance measure (the default), a budget: the blocks are
    timed (kept micro-batches too) and the plan made on that split in their times, to be
    recorded with the checkpoint like a measured split's; one block per stage alike."""
    fixed = [4, 4, 2]  # the last stage lightest: the others gain by keeping
    split, kept = layout_of(tmp_path, "model.memory_budget=auto", "model.stages=3",
                            f"model.partition={fixed}")
    assert split == fixed and [len(k) for k in kept] == fixed and not any(kept[-1])
    assert "blocks timed for the kept plan" in capsys.readouterr().err
    split, kept = layout_of(tmp_path, "model.memory_budget=auto", "model.stages=0", J=10)
    assert split == [1] * 10 and len(kept) == 10
    # the plan takes the measured kept times: a kept micro-batch no faster than a rebuild is
    # not kept, where the estimate (a quarter saved) keeps it
    net = NetSpec("revnet18", 4, 10)
    n = len(net.blocks())
    costs = BlockCosts([1.0] * n, [3.0] * n, [3.0] * n, [0.0] * n, [0] * n, 0, kept=[4.0] * n)
    for costs, keeps in ((None, True), (costs, False), (dataclasses.replace(costs, kept=[3.0] * n),
                                                         True)):
        layout = plan_layout(net, 3, partition=fixed, budget="auto", batch_size=8, costs=costs)
        assert layout.split == fixed and any(map(any, layout.kept)) == keeps
