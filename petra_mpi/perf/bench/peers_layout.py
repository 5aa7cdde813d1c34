"""Where `bench peers`' contenders put their blocks, made once and reusable: each net's splits
(J stages, and 2J for the schedules with two stages per rank), PETRA's split for a last stage
that rebuilds, the kept plans of the kept-blocks variants, and the per-block costs they were
made with (also the waterfall's model). `--save-layout FILE` writes it (a new file), `--layout
FILE` reads it instead of measuring and planning again: the splits and plans, planned from
timings on a noisy machine, stay fixed across runs (the race, race.py, plans once and reuses
them)."""
import json
import os

from ...core.blockcost import BlockCosts
from ...core.planner import plan_layout

KIND = "peers layout"


def petra_splits(net, J, costs) -> dict:
    """{"ours": PETRA's split of `net` balanced by its measured costs (as training balances
    it), "rebuild_last": the same for a last stage that rebuilds}."""
    return {"ours": plan_layout(net, J, costs=costs).split,
            "rebuild_last": plan_layout(net, J, costs=costs, rebuild_last=True).split}


def pipeline_splits(net, J, costs) -> dict:
    """{stage count: split} of `net` balanced by its autograd costs, as a user of torch's
    pipelining would balance it: J stages, and 2J for two stages per rank where the net has
    enough blocks."""
    return {n: plan_layout(net, n, costs=costs).split for n in (J, 2 * J)
            if n <= net.num_blocks}


def plan_kept(net, J, budgets, costs, batch, sizes, rebuild_split, fixed, rebuilding) -> dict:
    """{variant: its kept plan} for each of `budgets` ({variant: (bytes per rank, or None for
    no limit; the contender whose memory set it, or None)}), planned as training plans them
    (planner.plan_layout: the split balanced again with the plan's costs) at micro-batch
    `batch`: on `fixed` (a given split) when set, on `rebuild_split` for the variants of
    `rebuilding` (a last stage that rebuilds), else balanced. `sizes`: PETRA's split, whose
    planned time the plan's is set against."""
    from ...core.memory_plan import AUTO
    plans = {}
    for name, (budget, rival) in sorted(budgets.items()):
        split = rebuild_split if name in rebuilding else fixed
        layout = plan_layout(net, J, partition=split, budget=AUTO if budget is None else budget,
                             batch_size=batch, costs=costs)
        plan = layout.plan
        petra = max(plan.petra_units_on(sizes))
        plans[name] = {"batch": batch, "budget_bytes": budget, "budget_from": rival,
                       "plan": plan.kept, "planned_kept_bytes": plan.kept_bytes,
                       "planned_relative_time": max(plan.units) / petra,
                       "partition": layout.split}
    return plans


class LayoutError(ValueError):
    pass


def read(path, work, J) -> dict:
    """The layout saved at `path`, checked against the run (`work`: peers.Workload, J ranks):
    LayoutError (one line naming the file) when it is not one or was made for another run."""
    try:
        with open(path) as f:
            layout = json.load(f)
    except OSError as e:
        raise LayoutError(f"{path}: cannot read it ({e.strerror})")
    except json.JSONDecodeError:
        raise LayoutError(f"{path}: not a layout (not JSON; --save-layout writes one)")
    if not isinstance(layout, dict) or layout.get("bench") != KIND:
        raise LayoutError(f"{path}: not a layout of bench peers (--save-layout writes one)")
    want = describe(work, J)
    for key, value in want.items():
        if layout.get(key) != value:
            raise LayoutError(f"{path}: made for {key} {layout.get(key)!r}, this run has "
                              f"{value!r}")
    return layout


def describe(work, J) -> dict:
    """What a layout is made for: the ranks and the nets."""
    return {"bench": KIND, "ranks": J, "model": work.arch, "plain_model": work.plain,
            "width": work.width, **work.model_kw}


def splits_of(layout) -> tuple:
    """(PETRA's split, the rebuilding one, {net: {stage count: split}}) of a layout."""
    s = layout["splits"]
    nets = {net: {int(n): split for n, split in by_count.items()}
            for net, by_count in s["nets"].items()}
    return s["ours"], s["rebuild_last"], nets


def costs_of(layout, batch) -> dict | None:
    """{"ours" or a net: BlockCosts} measured at micro-batch `batch`, or None."""
    found = layout.get("costs", {}).get(str(batch))
    return None if found is None else {k: BlockCosts(**v) for k, v in found.items()}


def kept_of(layout, batch) -> dict:
    """The kept plans made for micro-batch `batch`."""
    return {n: k for n, k in layout.get("kept", {}).items() if k["batch"] == batch}


def make(work, J, petra_split, rebuild_split, pt_splits, costs, batch, kept) -> dict:
    """A layout of these splits, with the costs measured at micro-batch `batch` and the kept
    plans."""
    return {**describe(work, J), "splits": {
        "ours": petra_split, "rebuild_last": rebuild_split,
        "nets": {net: {str(n): s for n, s in by_count.items()}
                 for net, by_count in pt_splits.items()}},
        "costs": {str(batch): {k: c.to_dict() for k, c in costs.items()}} if costs else {},
        "kept": kept}


def write(path, layout):
    """Write the layout to `path`, a new file, atomically (a reader never sees half of it)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(layout, f, indent=1)
    os.link(tmp, path)  # fails rather than replace a file that appeared meanwhile
    os.unlink(tmp)
