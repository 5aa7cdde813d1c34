"""`python -m petra_mpi.evaluate (RUN_DIR | model.pt) [--data FILE.h5] [--split val]
[--batch-size N] [--device cuda] [--checkpoint PATH] [--plain]`

Evaluates a trained model in one process, without MPI: an exported model.pt (petra_mpi.export),
or a run directory's newest complete checkpoint (or PATH). It prints the loss, top-1 and top-5
accuracy, and as its very last line one JSON object with them. The data and its preprocessing
are the run's own evaluation's (the validation images in order, normalised by the file's channel
statistics, center-cropped to data.crop for JPEG files): --data and --batch-size default to the
run's, and so does the arithmetic (blocks in run.precision, activations rounded as comm.forward
rounds them between stages), so the figures equal the run's final evaluation. --plain evaluates
the plain float32 module that the export's state_dict loads into instead.
"""
import argparse
import json
import os
import sys

import torch

from .engines.evaluation import EvalTotals
from .export import (ExportError, MODEL_FORMAT, as_evaluated, exported_model, find_checkpoint,
                     load_model)


def load_saved(source: str, checkpoint: str | None = None) -> dict:
    """An exported model: the file `source`, or exported in memory from a run directory."""
    if os.path.isdir(source):
        return exported_model(find_checkpoint(source, checkpoint))
    saved = torch.load(source, map_location="cpu", weights_only=True)
    if not isinstance(saved, dict) or saved.get("format") != MODEL_FORMAT:
        raise ExportError(f"{source}: not a model written by python -m petra_mpi.export "
                          f"(the state_dict format)")
    return saved


def evaluate(saved: dict, data: str | None = None, split: str = "val",
             batch_size: int | None = None, device="cpu", plain: bool = False) -> dict:
    """Loss, top-1 and top-5 of the model on `split` of `data` (default: the run's data), as the
    run evaluated it (plain: the plain float32 module, without the run's precision and
    rounding)."""
    from .data import BatchLoader, open_split
    settings = saved["data"]
    path = data or settings["path"]
    src = open_split(path, split, synthetic_sizes=(settings["synthetic_train"],
                                                   settings["synthetic_val"]),
                     seed=settings["synthetic_seed"])
    classes = saved["network"]["num_classes"]
    if src.num_classes != classes:
        raise ExportError(f"{path} has {src.num_classes} classes, the model {classes}")
    device = torch.device(device)
    dtype = getattr(torch, saved.get("dtype", "float32"))
    model = (load_model(saved) if plain else as_evaluated(saved)).to(device=device, dtype=dtype)
    loader = BatchLoader(src, batch_size or settings["batch_size"], train=False, augment=False,
                         seed=saved.get("seed", 0), device=device,
                         crop=settings["crop"] if src.kind == "jpeg" else None)
    totals = EvalTotals()
    try:
        with torch.no_grad():
            for x, y in loader:
                totals.add(model(x.to(dtype)), y)
    finally:
        loader.close()
    return {"data": path, "split": split, **totals.result()}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m petra_mpi.evaluate",
                                description="Evaluate an exported model or a run's checkpoint.")
    p.add_argument("source", help="a model.pt written by petra_mpi.export, or a run directory")
    p.add_argument("--checkpoint", help="with a run directory: this checkpoint, not the newest")
    p.add_argument("--data", help="an HDF5 file in the dataset schema, or synthetic (default: "
                                  "the run's data.path)")
    p.add_argument("--split", default="val", choices=("val", "train"))
    p.add_argument("--batch-size", type=int, help="default: the run's data.batch_size")
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    p.add_argument("--plain", action="store_true",
                   help="the plain float32 module, without the run's precision (run.precision) "
                        "and forward rounding (comm.forward)")
    args = p.parse_args(argv)
    try:
        saved = load_saved(args.source, args.checkpoint)
        result = evaluate(saved, args.data, args.split, args.batch_size, args.device,
                          args.plain)
    except (ExportError, OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"{saved['network']['arch']} on {result['data']} ({args.split}, "
          f"{result['val_count']} images): loss {result['val_loss']:.4f} | top-1 "
          f"{result['val_acc']:.4f} | top-5 {result['val_top5']:.4f}")
    print(json.dumps({"evaluate": args.source, **result}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
