"""Paper Table 3: memory of the delayed-gradient variants of RevNet50 on ImageNet at batch 64,
as the paper counts it: parameters plus input buffers (except stage 0's, whose inputs the data
set provides again) plus stashed parameters, summed over the 18 stages, in float32.

With --arch revvit (or vit) the same four rows for a vision transformer on CIFAR-size images
(32x32, --width/--depth/--patch, one stage per block unless --stages): PETRA against storing the
inputs (the activations a delayed-gradient pipeline keeps) and/or the weights. The paper has no
figures for it.

With --arch irevnet18/34/50 (the fully invertible RevNets, models/invertible.py) the same rows on
ImageNet: no stage but the stem's buffers an input, so PETRA keeps the parameters alone.

Below the rows, the per-stage picture: each stage's blocks (rev: rebuilt from its output, buf:
input buffered), parameters, and the input buffer PETRA keeps beside the one that buffering every
input would keep."""
import argparse
import dataclasses

from ...config import Config, DataConfig, ModelConfig, TrainConfig
from ...core.planner import plan_layout
from ...models import NetSpec, num_blocks
from ...run.dryrun import stage_table
from ...models.vit import VIT_ARCHS
from .common import emit

ROWS = [  # (buffer_inputs, stash_weights): the paper's GB and saving
    (True, True, 44.5, 0.0), (True, False, 43.6, 2.0), (False, True, 21.2, 52.3),
    (False, False, 20.3, 54.3)]


def total_bytes(rows) -> dict:
    params = sum(r["param_bytes"] for r in rows)
    inputs = sum(r["input_fifo_bytes"] for r in rows if r["stage"] > 0)
    stash = sum(r["stash_bytes"] for r in rows)
    return {"params": params, "inputs": inputs, "stash": stash, "total": params + inputs + stash}


def main(argv):
    p = argparse.ArgumentParser(prog="python -m petra_mpi.bench memory", description=__doc__)
    p.add_argument("--arch", default="revnet50")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--stages", type=int, default=0, help="0: one per block (18 for RevNet50)")
    p.add_argument("--width", type=int, default=0, help="0: 64 (RevNet), 192 (ViT)")
    p.add_argument("--depth", type=int, default=8, help="revvit/vit: transformer blocks")
    p.add_argument("--patch", type=int, default=4, help="revvit/vit: patch side")
    a = p.parse_args(argv)
    vit = a.arch in VIT_ARCHS
    if vit:
        model = ModelConfig(arch=a.arch, width=a.width or 192, num_classes=10, stem="cifar",
                            depth=a.depth, patch=a.patch)
        a.stages = a.stages or num_blocks(a.arch, a.depth)
    else:
        model = ModelConfig(arch=a.arch, width=a.width or 64, num_classes=1000, stem="imagenet")
        a.stages = a.stages or num_blocks(a.arch)  # one stage per block: 18 for the 50-layer nets
    base = Config(model=model, data=DataConfig(batch_size=a.batch),
                  train=TrainConfig(method="delayed"))
    paper = a.arch == "revnet50"  # the paper's Table 3 has figures for RevNet50 alone
    results, per_stage = [], {}
    for buffer_inputs, stash, paper_gb, paper_saving in ROWS:
        cfg = dataclasses.replace(base, train=TrainConfig(method="delayed",
                                                          buffer_inputs=buffer_inputs,
                                                          stash_weights=stash))
        side = 32 if vit else 224
        layout = plan_layout(NetSpec.of_config(cfg, side), a.stages)
        rows = stage_table(cfg, layout, side=side, as_the_paper_counts=True)
        per_stage[buffer_inputs, stash] = rows
        results.append((buffer_inputs, stash, total_bytes(rows), paper_gb, paper_saving))
    reference = results[0][2]["total"]
    gb = 1e9
    print(f"{a.arch} width {base.model.width} on " +
          ("CIFAR (32x32)" if vit else "ImageNet (224x224)") +
          f", batch {a.batch}, {a.stages} stages, float32")
    print(f"{'input buf':>9} {'param buf':>9} {'params GB':>9} {'inputs GB':>9} {'stash GB':>9} "
          f"{'total GB':>9} {'saving':>7} | paper GB, saving")
    records = []
    for buffer_inputs, stash, t, paper_gb, paper_saving in results:
        saving = 100 * (1 - t["total"] / reference)
        print(f"{'yes' if buffer_inputs else 'no':>9} {'yes' if stash else 'no':>9} "
              f"{t['params'] / gb:>9.2f} {t['inputs'] / gb:>9.2f} {t['stash'] / gb:>9.2f} "
              f"{t['total'] / gb:>9.2f} {saving:>6.1f}% | " +
              (f"{paper_gb:>5.1f}, {paper_saving:.1f}%" if paper else "-"))
        records.append({"buffer_inputs": buffer_inputs, "stash_weights": stash,
                        "total_gb": t["total"] / gb, "saving_percent": saving})
    stages = stage_picture(per_stage[False, False], per_stage[True, False])
    emit({"bench": "memory", "arch": a.arch, "batch": a.batch, "rows": records,
          "petra_saving_percent": records[-1]["saving_percent"], "stages": stages})


def stage_picture(petra_rows, buffered_rows) -> list[dict]:
    """Print and return, per stage, what PETRA keeps (parameters, input buffer) beside the input
    buffer of the run that buffers every input. Stage 0's input buffer holds the data set's
    images, which the totals above leave out as the paper does."""
    mb = 1e6
    print("\nper stage, PETRA beside buffering every input (MB; stage 0's buffer holds the data):")
    print(f"{'stage':>5} {'kind':<14} {'input':<16} {'params':>9} {'PETRA buf':>10} "
          f"{'all buf':>10}")
    stages = []
    for r, b in zip(petra_rows, buffered_rows):
        print(f"{r['stage']:>5} {r['kind']:<14} {str(r['input']):<16} {r['param_bytes'] / mb:>9.1f} "
              f"{r['input_fifo_bytes'] / mb:>10.1f} {b['input_fifo_bytes'] / mb:>10.1f}")
        stages.append({"stage": r["stage"], "kind": r["kind"], "param_bytes": r["param_bytes"],
                       "input_fifo_bytes": r["input_fifo_bytes"],
                       "buffered_input_fifo_bytes": b["input_fifo_bytes"]})
    return stages
