"""`python -m petra_mpi.evaluate (RUN_DIR | model.pt) [--data FILE.h5] [--split val]
[--batch-size N] [--device cuda] [--checkpoint PATH] [--plain]`

Evaluates a trained model in one process, without MPI: an exported model.pt (petra_mpi.export),
or a run directory's newest complete checkpoint (or PATH; where a file of the newest cannot be
read back, the previous complete one, with a line). It prints the loss, top-1 and top-5
accuracy, and as its very last line one JSON object with them. The data and its preprocessing
are the run's own evaluation's (the validation images in order, normalised by the file's channel
statistics, center-cropped to data.crop for JPEG files): --data and --batch-size default to the
run's, and so does the arithmetic (blocks in run.precision, activations rounded as comm.forward
rounds them between stages), so the figures equal the run's final evaluation. --plain evaluates
the plain float32 module that the export's state_dict loads into instead.

A --data file must be of the kind the model was trained on (its classes, the kind and side of
its pictures); a model file is read as weights only and checked first (export.checked_model).
Exit status 2, with one line, for a file it refuses; 1 when the loss is not finite (its JSON
holds null for it: JSON has no NaN).
"""
import argparse
import json
import math
import os
import sys

import torch

from .engines.evaluation import EvalTotals
from .export import (ExportError, add_arch_argument, as_evaluated, check_fits, checked_model,
                     checked_preprocess, exported_run, from_model_file, load_model,
                     preprocessing_of)
from .run.torch_files import load_tensors


def load_saved(source: str, checkpoint: str | None = None, trusted: str | None = None) -> dict:
    """An exported model, checked (export.checked_model; `trusted`: the import path of a network
    of one's own that the command line named): the file `source`, read as weights only, or
    exported in memory from a run directory (its newest readable checkpoint, or
    `checkpoint`)."""
    if os.path.isdir(source):
        path, saved = exported_run(source, checkpoint)
        return checked_model(saved, path, trusted)
    return from_model_file(checked_model(load_tensors(source), source, trusted), source)


def evaluate(saved: dict, data: str | None = None, split: str = "val",
             batch_size: int | None = None, device="cpu", plain: bool = False) -> dict:
    """Loss, top-1 and top-5 of the model on `split` of `data` (default: the run's data), as the
    run evaluated it (plain: the plain float32 module, without the run's precision and
    rounding). The data must be of the kind the model was trained on (export.check_fits)."""
    from .data import BatchLoader, open_split
    settings = saved["data"]
    path = data or settings["path"]
    if path is None:
        raise ExportError("the model does not record where its data file is (it was exported "
                          "away from it): name the file with --data")
    pre = preprocessing_of({**settings, "path": path})
    if pre is not None:
        check_fits(saved, checked_preprocess(pre, path), path)
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
    add_arch_argument(p)
    args = p.parse_args(argv)
    try:
        saved = load_saved(args.source, args.checkpoint, args.arch)
        result = evaluate(saved, args.data, args.split, args.batch_size, args.device,
                          args.plain)
    except (ExportError, OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"{saved['network']['arch']} on {result['data']} ({args.split}, "
          f"{result['val_count']} images): loss {result['val_loss']:.4f} | top-1 "
          f"{result['val_acc']:.4f} | top-5 {result['val_top5']:.4f}")
    # JSON has no NaN or infinity: a loss that is not finite is null, and the status says so
    finite = math.isfinite(result["val_loss"])
    print(json.dumps({"evaluate": args.source, **result,
                      "val_loss": result["val_loss"] if finite else None}))
    if not finite:
        print(f"error: the loss of {args.source} on {result['data']} is not finite: the model's "
              f"outputs overflow or are NaN", file=sys.stderr)
    return 0 if finite else 1


if __name__ == "__main__":
    sys.exit(main())
