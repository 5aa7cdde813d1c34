"""A run's layout of blocks on stages: the split and, under model.memory_budget, the kept plan
(Stage.set_kept per stage). choose_layout picks them at start-up, the same on every rank, or
takes the checkpoint's when resuming under the same budget; layout_changes says how a
checkpoint's layout differs from this run's, with what that does to training."""
import json
import os
import sys
import time

from .checkpoint import MANIFEST
from ..core.planner import Layout, plan_layout
from ..models import NetSpec


def choose_layout(cfg, J, world, device, dtype, input_shape, resume) -> Layout:
    """The run's Layout, the same on every rank. Resuming, the checkpoint's (resumed_layout).
    Else the planner's for the config (config_layout): the split is the config's
    (model.partition, or one block per stage), or PETRA's by the estimate, or by timing every
    block when model.balance is measure; under model.memory_budget it is balanced with the
    plan's costs when it is the run's to choose, and the plan is made on it in the same costs
    (measured: kept times included). Rank 0 plans where timing or a fraction of its memory
    enters, and tells the others; elsewhere every rank plans the same."""
    if resume:
        with open(os.path.join(resume, MANIFEST)) as f:
            layout = resumed_layout(json.load(f), J, cfg.model.memory_budget)
        if layout:
            return layout
    net = NetSpec.of_config(cfg, input_shape[-1])
    fixed = bool(cfg.model.partition) or J == net.num_blocks
    measured = cfg.model.balance == "measure"
    if not cfg.model.memory_budget and (fixed or not measured):
        return config_layout(cfg, net, J, device, dtype)
    chosen = None
    if world is None or world.rank == 0:
        start = time.perf_counter()
        chosen = config_layout(cfg, net, J, device, dtype)
        if measured:
            say_measured(chosen, fixed, time.perf_counter() - start)
    return world.bcast(chosen) if world else chosen


def config_layout(cfg, net, J, device, dtype) -> Layout:
    """planner.plan_layout for the net `net` (models.NetSpec) and the layout keys of a config."""
    return plan_layout(net, J, partition=cfg.model.partition, budget=cfg.model.memory_budget,
                       batch_size=cfg.data.batch_size, measure=cfg.model.balance == "measure",
                       rebuild_last=cfg.model.rebuild_last_stage, method=cfg.train.method,
                       device=device, dtype=dtype)


def resumed_layout(manifest, J, budget) -> Layout | None:
    """The Layout of a checkpoint's manifest that a run of J stages under model.memory_budget
    `budget` resumes with, or None to choose afresh: when its stages differ, or its budget (a
    lowered budget must not keep what ran out of memory before). The same budget keeps the
    checkpoint's, though a measured split or a fraction of another node's memory might come
    out otherwise on this start. A manifest of an earlier version records no budget: a plan in
    it stands for one."""
    if "memory_budget" in manifest:  # as written: 1.0 (all the memory) is not 1 (one byte)
        same = json.dumps(manifest["memory_budget"]) == json.dumps(budget)
    else:
        same = (manifest.get("kept") is not None) == bool(budget)
    if manifest.get("stages") != J or not same:
        return None
    return Layout(manifest["partition"], manifest.get("kept"), why="the checkpoint's")


def say_measured(layout, fixed, seconds):
    """The line of a layout from timed blocks: the split and each stage's measured time."""
    timed = f"{seconds:.1f} s to time {len(layout.costs.forward)} blocks"
    shown = layout.petra_split
    per_stage = " ".join(f"{1e3 * c:.0f}" for c in layout.costs.stage_seconds(shown))
    what = "blocks timed for the kept plan" if fixed else "stages balanced by measured cost"
    line = f"petra_mpi: {what} ({timed}): blocks per stage {shown}, ms per micro-batch {per_stage}"
    if layout.split != shown:  # kept blocks cost less: their stages may take more blocks
        line += f"; with the kept blocks of model.memory_budget {layout.split}"
    print(line, file=sys.stderr, flush=True)


def layout_changes(old, new) -> list[str]:
    """Each difference between the checkpoint's layout and this run's, said with what it does
    to training."""
    changes = []
    if old["stages"] != new["stages"]:
        changes.append(f"stages {old['stages']} -> {new['stages']} (the gradient delays "
                       f"2(J-1-s) change with J)")
    elif old["partition"] != new["partition"]:
        changes.append(f"split {old['partition']} -> {new['partition']} (the delay each block "
                       f"sees changes)")
    if describe_kept(old["kept"]) != describe_kept(new["kept"]):
        budget = ("" if old.get("memory_budget") in (None, new["memory_budget"]) else
                  f"model.memory_budget {old['memory_budget']} -> {new['memory_budget']}, ")
        changes.append(f"kept blocks {describe_kept(old['kept'])} -> "
                       f"{describe_kept(new['kept'])} ({budget}planned afresh: a kept "
                       f"micro-batch is differentiated with the weights of its forward)")
    rebuilds = [bool(d.get("rebuild_last_stage")) for d in (old, new)]  # absent: an earlier run
    if rebuilds[0] != rebuilds[1]:
        changes.append(f"model.rebuild_last_stage {str(rebuilds[0]).lower()} -> "
                       f"{str(rebuilds[1]).lower()} (the last stage's memory and time change; "
                       f"its gradients only by the rounding of its rebuilt inputs)")
    if old["replicas"] != new["replicas"]:
        changes.append(f"replicas {old['replicas']} -> {new['replicas']} (effective batch, peak "
                       f"lr {old['peak_lr']:g} -> {new['peak_lr']:g} and batch-norm batches "
                       f"change; steps per epoch {old['steps_per_epoch']} -> "
                       f"{new['steps_per_epoch']}, the step counter rescaled to keep the "
                       f"schedule's place)")
    elif old["microbatches_per_epoch"] != new["microbatches_per_epoch"]:
        changes.append(f"micro-batches per epoch {old['microbatches_per_epoch']} -> "
                       f"{new['microbatches_per_epoch']}")
    for key in ("device", "dtype", "precision"):
        if old[key] != new[key]:
            changes.append(f"{key} {old[key]} -> {new[key]} (rounding differs)")
    return changes


def describe_kept(kept) -> str:
    """A kept plan in a few words: none, or per stage its blocks' counts."""
    if not kept or not any(map(any, kept)):
        return "none (PETRA)"
    return str(kept)
