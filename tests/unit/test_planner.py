"""The planner (core/planner.py): its one entry, plan_layout, returns the Layout (split, kept plan,
the costs it used, why) for every way a split is chosen, and a run's start-up enters it once.
The splits and plans themselves: test_kept_blocks.py, test_kept_layout.py, test_performance.py."""
import sys

import torch

from petra_mpi.config import load_config
from petra_mpi.core import planner
from petra_mpi.core.blockcost import BlockCosts
from petra_mpi.core.planner import plan_layout
from petra_mpi.models import NetSpec
from tests.support.paths import QUICK, ROOT

NET = NetSpec("revnet18", 4, 10, image_size=8)  # (small images: the probes stay cheap)


def test_the_entry_says_how_each_split_was_chosen():
    estimate = plan_layout(NET, 4)
    assert (estimate.split, estimate.kept, estimate.why) == ([1, 1, 2, 6], None,
                                                             "balanced by estimated cost")
    assert len(estimate.costs) == 10 and estimate.petra_split == estimate.split
    fixed = plan_layout(NET, 3, partition=[3, 3, 4])
    assert (fixed.split, fixed.why, fixed.costs) == ([3, 3, 4], "model.partition", None)
    assert plan_layout(NET, 10).why == "one block per stage"
    n = 10
    costs = BlockCosts([1.0] * n, [3.0] * n, [3.0] * n, [0.0] * n, [1] * n)
    measured = plan_layout(NET, 2, costs=costs)
    assert (measured.split, measured.why, measured.costs) == ([4, 6], "balanced by measured cost",
                                                              costs)


def test_a_budget_plans_on_the_split_and_rebalances_it():
    """Under a budget the Layout carries the plan it made; where the split is the planner's to
    choose, it may move (here from PETRA's [2, 8] to [3, 7]) and says so."""
    layout = plan_layout(NET, 2, budget="auto", batch_size=2)
    assert (layout.petra_split, layout.split) == ([2, 8], [3, 7])
    assert layout.kept == [[2, 2, 2], [0] * 7] == layout.plan.kept
    assert layout.why == "balanced by estimated cost, then with the kept blocks' costs"
    assert layout.plan.windows == [2, 0]
    # the plan on PETRA's split, fixed, is slower
    fixed = plan_layout(NET, 2, partition=[2, 8], budget="auto", batch_size=2)
    assert (fixed.split, fixed.why) == ([2, 8], "model.partition")
    assert max(fixed.plan.units) > max(layout.plan.units)


def test_planning_leaves_the_random_generator_alone():
    torch.manual_seed(3)
    want = torch.rand(1)
    torch.manual_seed(3)
    plan_layout(NET, 2, budget="auto", batch_size=2)
    assert torch.equal(torch.rand(1), want)


def test_a_runs_start_up_enters_the_planner_once(tmp_path, monkeypatch):
    """The trainer's start-up (one process, a budget, the estimate) plans its layout once, and
    builds its stages from that Layout without planning again."""
    from petra_mpi.run.placement import find_placement
    from petra_mpi.run.trainer import Trainer
    calls = []
    original = planner.plan_layout

    def counted(*args, **kwargs):
        calls.append(args[1])
        return original(*args, **kwargs)
    for module in list(sys.modules.values()):  # wherever it was imported
        if getattr(module, "plan_layout", None) is original:
            monkeypatch.setattr(module, "plan_layout", counted)
    sets = [*QUICK[1::2], "model.stages=2", "model.memory_budget=auto", "model.balance=estimate",
            "data.synthetic_train=16", "data.synthetic_val=8", "data.batch_size=2",
            f"run.out_dir={tmp_path}"]
    cfg = load_config(ROOT / "configs" / "quickstart.yaml", sets)
    trainer = Trainer(cfg, None, find_placement(cfg, None))
    try:
        assert calls == [2]
        assert [w.stage.kept for w in trainer.pipeline_workers] == trainer.layout["kept"]
    finally:
        trainer.close()
