"""`python -m petra_mpi.predict MODEL.pt IMAGE_OR_DIR... [--top 5] [--json] [--device cuda]
[--batch-size 64] [--data FILE.h5]`

Classifies pictures with an exported model (`python -m petra_mpi.export RUN_DIR --out
MODEL.pt`). Each picture (any format Pillow reads; a folder: every picture below it, in name
order) is prepared as the run's evaluation saw its data: decoded, made upright and RGB, resized
to the stored side and stored as the packer stores it (petra_mpi.prep.pictures.encode), then
centre-cropped to data.crop (the JPEG variant) and normalised by the file's channel statistics.
The model computes as the run evaluated (petra_mpi.evaluate), in batches, on the CPU unless
--device says otherwise. Prints one line per picture: its path and the --top most likely
classes with their probabilities (--json: one JSON object per line). A picture that cannot be
read, or whose outputs are not finite, gets one line saying why and the others still answer;
the exit status is then 1. The preprocessing and class names are recorded by export; a model
exported where its data file could not be read takes them from --data, which must then be of
the kind the model was trained on. A model file is read as weights only and checked first
(export.checked_model); one it refuses, or a --data file of another kind: one line, status 2.
"""
import argparse
import json
import os
import sys

import numpy as np
import torch

from .data.augment import center_box, decode_crop_pil, norm_constants, normalize
from .evaluate import load_saved
from .export import (ExportError, add_arch_argument, as_evaluated, check_fits, checked_preprocess,
                     preprocessing_of, takes_tokens)
from .prep.pictures import encode, image_extensions


NOT_FINITE = "the model's outputs for it are not finite (they overflow or are NaN)"


def pictures_in(paths):
    """The files named, and the pictures below the folders named (hidden names left out)."""
    found = []
    for path in paths:
        if not os.path.isdir(path):
            found.append(path)
            continue
        inside = []
        for root, dirs, names in os.walk(path):
            dirs[:] = [d for d in dirs if not d.startswith(".")]
            inside += [os.path.join(root, n) for n in names if not n.startswith(".")
                       and os.path.splitext(n)[1].lower() in image_extensions()]
        found += sorted(inside)
    return found


def prepare(path, pre):
    """The uint8 (side, side, 3) pixels the run's evaluation would have seen for this picture;
    ValueError when it cannot be read."""
    data, _, err = encode(path, pre["image_size"], raw=pre["kind"] == "array")
    if err is not None:
        raise ValueError(f"cannot read the picture ({err})")
    if pre["kind"] == "array":
        return data
    crop, side = pre["crop"], pre["image_size"]
    return decode_crop_pil(data, crop, lambda w, h: center_box(w, h, crop, side))


class Predictor:
    """An exported model with its preprocessing: probabilities of every class for a batch of
    prepared pictures."""

    def __init__(self, saved, device, pre):
        self.device, self.pre = torch.device(device), pre
        self.dtype = getattr(torch, saved.get("dtype", "float32"))
        self.model = as_evaluated(saved).to(device=self.device, dtype=self.dtype)
        self.scale, self.shift = norm_constants(pre["mean"], pre["std"], self.device)
        count = saved["network"]["num_classes"]
        self.names = pre["classes"] or [f"class {i}" for i in range(count)]

    def probabilities(self, pixels):
        x = normalize(torch.from_numpy(np.stack(pixels)).to(self.device), self.scale, self.shift)
        with torch.no_grad():
            return torch.softmax(self.model(x.to(self.dtype)).float(), dim=1).cpu()


def answer(path, probs, names, top, as_json):
    """One picture's line: its top classes and probabilities."""
    values, indices = probs.topk(min(top, len(probs)))
    best = [(names[i], int(i), float(v)) for v, i in zip(values.tolist(), indices.tolist())]
    if as_json:
        return json.dumps({"path": path, "top": [{"class": n, "index": i, "probability": p}
                                                 for n, i, p in best]})
    return f"{path}: " + ", ".join(f"{n} ({p:.3f})" for n, _, p in best)


def failure(path, why, as_json):
    return json.dumps({"path": path, "error": why}) if as_json else f"{path}: error: {why}"


def predict(predictor, paths, args):
    """Print the answer for each picture, in order, a batch at a time; the failures' count."""
    failed = 0
    for lo in range(0, len(paths), args.batch_size):
        batch, lines, pixels = paths[lo:lo + args.batch_size], {}, []
        for path in batch:
            try:
                pixels.append((path, prepare(path, predictor.pre)))
            except ValueError as e:
                lines[path], failed = failure(path, str(e), args.json), failed + 1
        if pixels:
            probs = predictor.probabilities([p for _, p in pixels])
            for (path, _), row in zip(pixels, probs):
                if bool(torch.isfinite(row).all()):
                    lines[path] = answer(path, row, predictor.names, args.top, args.json)
                else:  # no NaN printed, in JSON (where it is not a value) or not
                    lines[path], failed = failure(path, NOT_FINITE, args.json), failed + 1
        for path in batch:
            print(lines[path], flush=True)
    return failed


def load(args):
    """The exported model as a Predictor, or ExportError saying why it cannot predict."""
    saved = load_saved(args.model, trusted=args.arch)
    arch = saved["network"]["arch"]
    if takes_tokens(saved["network"]):
        raise ExportError(f"{args.model} holds a language model ({arch}): write text with it by "
                          f"python -m petra_mpi.generate {args.model} --prompt TEXT")
    pre = saved["preprocess"]  # checked with the model (export.checked_model)
    if args.data:  # a data file of the kind the model was trained on (check_fits)
        pre = preprocessing_of({**saved["data"], "path": args.data})
        if pre is None:
            raise ExportError(f"{args.data} holds tokens, not pictures")
        check_fits(saved, checked_preprocess(pre, args.data), args.data)
    if pre is None:
        raise ExportError(f"{args.model} does not record how its data was prepared (its data "
                          f"file could not be read at export): name the file with --data")
    if torch.device(args.device).type == "cuda" and not torch.cuda.is_available():
        raise ExportError("--device cuda: no CUDA device here")
    return Predictor(saved, args.device, pre)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m petra_mpi.predict",
                                description=__doc__.split("\n\n")[1])
    p.add_argument("model", help="an exported model (python -m petra_mpi.export)")
    p.add_argument("pictures", nargs="+", help="picture files, or folders of them")
    p.add_argument("--top", type=int, default=5, help="classes shown per picture (default 5)")
    p.add_argument("--json", action="store_true", help="one JSON object per line")
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    p.add_argument("--batch-size", type=int, default=64, help="pictures per batch (default 64)")
    p.add_argument("--data", help="the data file the model trained on (default: recorded at "
                                  "export)")
    add_arch_argument(p)
    args = p.parse_args(argv)
    if args.top < 1 or args.batch_size < 1:
        p.error("--top and --batch-size must be at least 1")
    try:
        predictor = load(args)
    except (ExportError, OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    paths = pictures_in(args.pictures)
    if not paths:
        print(f"error: no picture in {' '.join(args.pictures)}", file=sys.stderr)
        return 2
    failed = predict(predictor, paths, args)
    if failed:
        print(f"{failed} of {len(paths)} picture(s) could not be read", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
