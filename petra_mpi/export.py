"""`python -m petra_mpi.export RUN_DIR [--checkpoint PATH] --out model.pt [--format torch.export]`

The trained model out of the pipeline, in one process and without MPI: the newest complete
checkpoint of RUN_DIR (or PATH) becomes one ordinary PyTorch state_dict of the plain module
petra_mpi.models.build_network builds, saved with that function's arguments:

    saved = torch.load("model.pt")
    model = petra_mpi.models.build_network(**saved["network"])
    model.load_state_dict(saved["state_dict"])

--format torch.export writes a torch.export program instead (the model in eval mode, any batch
size; a language model's takes token ids, up to model.context of them), which loads with torch
alone: torch.export.load("model.pt2").module().

Both compute in float32 without rounding. The saved model also records how the run evaluated
(`saved["evaluation"]`: run.precision, comm.forward and the stage split), which
`as_evaluated` (and so petra_mpi.evaluate) applies to reproduce the run's own evaluation, and
how that evaluation prepared an image and named the classes (`saved["preprocess"]`), which
petra_mpi.predict applies to a picture.
"""
import argparse
import itertools
import json
import os
import sys

import torch

from .archs import LM_ARCHS
from .run.checkpoint import LAYOUT_FREE, MANIFEST, complete_checkpoints, is_complete, read_blocks
from .comm.compress import Codec
from .files import atomic_path
from .models import build_network, set_precision

MODEL_FORMAT = "petra_mpi.model/1"


class ExportError(RuntimeError):
    pass


def find_checkpoint(run_dir: str, checkpoint: str | None = None) -> str:
    """`checkpoint` if given (it must be complete), else RUN_DIR's newest complete one."""
    if checkpoint:
        if not is_complete(checkpoint):
            raise ExportError(f"{checkpoint}: not a complete checkpoint (no valid {MANIFEST})")
        return checkpoint
    found = complete_checkpoints(run_dir)
    if not found:
        raise ExportError(f"{run_dir}: no complete checkpoint in {run_dir}/checkpoints")
    return found[-1]


def exported_model(checkpoint: str) -> dict:
    """What `export` saves for a checkpoint: the network's arguments, its state_dict (on the
    CPU) and what evaluating it the way the run did needs (its data settings, dtype, and the
    precision, forward compression and stage split of its evaluation)."""
    with open(os.path.join(checkpoint, MANIFEST)) as f:
        manifest = json.load(f)
    if manifest.get("format") != LAYOUT_FREE:
        raise ExportError(f"{checkpoint}: its manifest is not of the checkpoint format this "
                          f"version exports (\"format\": {LAYOUT_FREE})")
    network = manifest["network"]
    with open(os.path.join(checkpoint, "trainer.json")) as f:
        trainer = json.load(f)
    state = read_blocks(checkpoint, manifest, 0, sum(manifest["partition"]))["stage"]
    config = manifest["config"]
    data = {key: config["data"][key] for key in ("path", "batch_size", "synthetic_train",
                                                 "synthetic_val", "synthetic_seed", "crop")}
    # The run's evaluation: blocks in run.precision, each stage's output rounded to the nearest
    # in comm.forward before the next stage (Outbox.put with evaluation=True).
    evaluation = {"precision": config["run"].get("precision", "fp32"),
                  "forward": config.get("comm", {}).get("forward", "none"),
                  "partition": manifest["partition"]}
    return {"format": MODEL_FORMAT, "network": network, "state_dict": state,
            "evaluation": evaluation, "preprocess": preprocessing_of(data),
            "dtype": config["run"]["dtype"], "data": data, "seed": config["run"]["seed"],
            "epoch": trainer["epoch"], "position": trainer["position"],
            "checkpoint": os.path.abspath(checkpoint)}


def preprocessing_of(data: dict) -> dict | None:
    """How the run's evaluation prepared an image of its data, for petra_mpi.predict to prepare
    a picture the same way: the kind of images ("jpeg" or "array"), their stored side (the JPEG
    variant's shorter side), the evaluation's centre crop (JPEG), the channel mean and std, and
    the class names (None where the file has none). None for token files, and where the data
    cannot be read here (predict then asks for it)."""
    from .data import open_split
    from .data.augment import crop_side
    from .data.hdf5 import open_readonly
    try:
        src = open_split(data["path"], "val", seed=data["synthetic_seed"],
                         synthetic_sizes=(data["synthetic_train"], data["synthetic_val"]))
        classes = None
        if data["path"] != "synthetic" and src.kind in ("jpeg", "array"):
            with open_readonly(data["path"]) as f:
                classes = [c.decode() for c in f["classes"][:]] if "classes" in f else None
    except (OSError, ValueError):
        return None
    if src.kind not in ("jpeg", "array"):
        return None
    return {"kind": src.kind, "image_size": src.image_size, "mean": list(src.mean),
            "std": list(src.std),
            "crop": crop_side(src.image_size, data["crop"]) if src.kind == "jpeg" else None,
            "classes": classes}


def load_model(saved: dict) -> torch.nn.Module:
    """The plain module of an exported model (build_network, then its state_dict), in eval mode."""
    model = build_network(**saved["network"])
    model.load_state_dict(saved["state_dict"])
    return model.eval()


class AsEvaluated(torch.nn.Module):
    """A network as a pipeline evaluates it: its blocks compute in `precision`, and the output
    of each stage of `partition` (blocks per stage) is rounded to the nearest in the `forward`
    format, as the message to the next stage is."""

    def __init__(self, network, precision="fp32", forward="none", partition=()):
        super().__init__()
        set_precision(network.blocks, precision)
        self.network, self.codec = network, Codec(forward)
        self.ends = set(itertools.accumulate(partition[:-1]))  # blocks before each message

    def forward(self, x):
        for i, block in enumerate(self.network.blocks):
            x = block(x)
            if i + 1 in self.ends:
                x = self.codec.roundtrip(x, evaluation=True)
        return x


def as_evaluated(saved: dict) -> torch.nn.Module:
    """The exported model as the run's own evaluation computed it, in eval mode (a model
    exported before the export recorded the evaluation: the plain module)."""
    return AsEvaluated(load_model(saved), **saved.get("evaluation", {})).eval()


def write_torch_export(saved: dict, out: str):
    """A torch.export program of the model in eval mode, with a dynamic batch dimension; a
    language model's takes token ids (batch, tokens), any number of tokens up to its context
    (generation starts from a short prompt)."""
    model = load_model(saved)
    network = saved["network"]
    batch = torch.export.Dim("batch", min=1)
    if network["arch"] in LM_ARCHS:
        context = network["context"]
        example = torch.zeros(2, context, dtype=torch.long)
        dims = {0: batch, 1: torch.export.Dim("tokens", min=1, max=context)}
    else:
        side = network.get("image_size", 32)
        example, dims = torch.zeros(2, 3, side, side), {0: batch}
    program = torch.export.export(model, (example,), dynamic_shapes=(dims,))
    torch.export.save(program, out)


def export(run_dir: str, out: str, checkpoint: str | None = None, fmt: str = "state_dict") -> dict:
    saved = exported_model(find_checkpoint(run_dir, checkpoint))
    # torch.export's writer wants the extension kept
    with atomic_path(out, keep_extension=True) as tmp:
        if fmt == "torch.export":
            write_torch_export(saved, tmp)
        else:
            torch.save(saved, tmp)
    return saved


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m petra_mpi.export",
                                description=__doc__.split("\n")[0].strip("`"))
    p.add_argument("run_dir", help="the run's run.out_dir")
    p.add_argument("--checkpoint", help="a checkpoint directory (default: the run's newest)")
    p.add_argument("--out", required=True, help="the file to write, e.g. model.pt")
    p.add_argument("--format", choices=("state_dict", "torch.export"), default="state_dict",
                   help="state_dict (default): the state_dict and build_network's arguments; "
                        "torch.export: a program that loads with torch alone")
    args = p.parse_args(argv)
    try:
        saved = export(args.run_dir, args.out, args.checkpoint, args.format)
    except ExportError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"exported {saved['network']['arch']} from {saved['checkpoint']} (epoch "
          f"{saved['epoch']}, micro-batch {saved['position']}) to {args.out} ({args.format})",
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
