"""A run's layout of blocks on stages: the split and, under model.memory_budget, the kept plan
(Stage.set_kept per stage). choose_layout picks them at start-up, the same on every rank, or
takes the checkpoint's when resuming under the same budget; layout_changes says how a
checkpoint's layout differs from this run's, with what that does to training."""
import json
import os
import sys
import time

import torch

from .checkpoint import MANIFEST
from ..config import model_kwargs
from ..models import build_blocks, num_blocks, set_precision


def choose_layout(cfg, J, world, device, dtype, input_shape, resume):
    """(blocks per stage, kept plan), the same on every rank; None for either: the estimate's
    split, PETRA. Resuming, the checkpoint's (resumed_layout). Else the split is the config's
    (model.partition, or one block per stage), or PETRA's by the estimate, or by timing every
    block when model.balance is measure; under model.memory_budget it is balanced with the
    plan's costs when it is the run's to choose, and the plan is made on it in the same costs
    (measured: kept times included). Rank 0 decides where timing or a fraction of its memory
    enters, and tells the others."""
    if resume:
        with open(os.path.join(resume, MANIFEST)) as f:
            layout = resumed_layout(json.load(f), J, cfg.model.memory_budget)
        if layout:
            return layout
    budget = cfg.model.memory_budget
    fixed = cfg.model.partition or ([1] * J if J == num_blocks(cfg.model.arch, cfg.model.depth)
                                    else None)
    if not budget and (fixed or cfg.model.balance != "measure"):
        return cfg.model.partition, None
    chosen = None
    if world is None or world.rank == 0:
        chosen = (measured_layout(cfg, J, device, dtype, input_shape, fixed)
                  if cfg.model.balance == "measure" else
                  estimated_layout(cfg, J, device, dtype, input_shape, fixed))
    return world.bcast(chosen) if world else chosen


def resumed_layout(manifest, J, budget):
    """(split, plan) of a checkpoint's manifest that a run of J stages under model.memory_budget
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
    return manifest.get("partition"), manifest.get("kept")


def measured_layout(cfg, J, device, dtype, input_shape, fixed):
    """(split, plan) from the blocks timed on this run's device, dtype and batch."""
    from ..core.blockcost import measured_partition_for
    start = time.perf_counter()
    sizes, costs, split, kept = measured_partition_for(cfg, J, input_shape, device, dtype, fixed)
    timed = f"{time.perf_counter() - start:.1f} s to time {len(costs.forward)} blocks"
    shown = split if fixed else sizes
    per_stage = " ".join(f"{1e3 * c:.0f}" for c in costs.stage_seconds(shown))
    what = "blocks timed for the kept plan" if fixed else "stages balanced by measured cost"
    line = f"petra_mpi: {what} ({timed}): blocks per stage {shown}, ms per micro-batch {per_stage}"
    if split != shown:  # kept blocks cost less: their stages may take more blocks
        line += f"; with the kept blocks of model.memory_budget {split}"
    print(line, file=sys.stderr, flush=True)
    return split, kept


def estimated_layout(cfg, J, device, dtype, input_shape, fixed):
    """(split, plan) by the estimated block costs, on a net built as build_stages builds it."""
    from ..core.memory_plan import plan_split
    torch.manual_seed(cfg.run.seed)
    blocks = build_blocks(cfg.model.arch, cfg.model.width, cfg.model.num_classes,
                          cfg.model.stem == "imagenet", image_size=input_shape[-1],
                          **model_kwargs(cfg))
    set_precision(blocks, cfg.run.precision)
    split, plan = plan_split(blocks, J, fixed, cfg.model.memory_budget, cfg.data.batch_size,
                             image_size=input_shape[-1], device=device, dtype=dtype)
    return split, plan.kept


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
