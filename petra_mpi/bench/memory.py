"""Paper Table 3: memory of the delayed-gradient variants of RevNet50 on ImageNet at batch 64,
as the paper counts it: parameters plus input buffers (except stage 0's, whose inputs the data
set provides again) plus stashed parameters, summed over the 18 stages, in float32."""
import argparse
import dataclasses

from ..config import Config, DataConfig, ModelConfig, TrainConfig
from ..dryrun import stage_table
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
    p.add_argument("--stages", type=int, default=18)
    a = p.parse_args(argv)
    base = Config(model=ModelConfig(arch=a.arch, width=64, num_classes=1000, stem="imagenet"),
                  data=DataConfig(batch_size=a.batch), train=TrainConfig(method="delayed"))
    results = []
    for buffer_inputs, stash, paper_gb, paper_saving in ROWS:
        cfg = dataclasses.replace(base, train=TrainConfig(method="delayed",
                                                          buffer_inputs=buffer_inputs,
                                                          stash_weights=stash))
        results.append((buffer_inputs, stash, total_bytes(stage_table(cfg, a.stages)), paper_gb,
                        paper_saving))
    reference = results[0][2]["total"]
    gb = 1e9
    print(f"{a.arch} on ImageNet (224x224), batch {a.batch}, {a.stages} stages, float32")
    print(f"{'input buf':>9} {'param buf':>9} {'params GB':>9} {'inputs GB':>9} {'stash GB':>9} "
          f"{'total GB':>9} {'saving':>7} | paper GB, saving")
    records = []
    for buffer_inputs, stash, t, paper_gb, paper_saving in results:
        saving = 100 * (1 - t["total"] / reference)
        print(f"{'yes' if buffer_inputs else 'no':>9} {'yes' if stash else 'no':>9} "
              f"{t['params'] / gb:>9.2f} {t['inputs'] / gb:>9.2f} {t['stash'] / gb:>9.2f} "
              f"{t['total'] / gb:>9.2f} {saving:>6.1f}% | {paper_gb:>5.1f}, {paper_saving:.1f}%")
        records.append({"buffer_inputs": buffer_inputs, "stash_weights": stash,
                        "total_gb": t["total"] / gb, "saving_percent": saving})
    emit({"bench": "memory", "arch": a.arch, "batch": a.batch, "rows": records,
          "petra_saving_percent": records[-1]["saving_percent"]})
