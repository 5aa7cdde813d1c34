"""`python -m petra_mpi.export RUN_DIR [--checkpoint PATH] --out model.pt [--force] [--format torch.export]`

The trained model out of the pipeline, in one process and without MPI: the newest complete
checkpoint of RUN_DIR (or PATH) becomes one ordinary PyTorch state_dict of the plain module
petra_mpi.models.build_network builds, saved with that function's arguments:

    saved = torch.load("model.pt", weights_only=True)
    model = petra_mpi.models.build_network(**saved["network"])
    model.load_state_dict(saved["state_dict"])

--format torch.export writes a torch.export program instead (the model in eval mode, any batch
size; a language model's takes token ids, up to model.context of them), which loads with torch
alone: torch.export.load("model.pt2").module().

Both compute in float32 without rounding. The saved model also records how the run evaluated
(`saved["evaluation"]`: run.precision, comm.forward and the stage split), which
`as_evaluated` (and so petra_mpi.evaluate) applies to reproduce the run's own evaluation, and
how that evaluation prepared an image and named the classes (`saved["preprocess"]`), which
petra_mpi.predict applies to a picture. It records no path of the machine that wrote it: the
checkpoint by its name, the data file relative to the model file's folder.

A model file may come from anyone: the commands read it as weights only (nothing in it runs
code) and check it before building anything (checked_model). A network of one's own (model.arch
an import path) is code the file only names: these commands import it only when the command
line names it too (--arch).
"""
import argparse
import itertools
import json
import math
import os
import sys

import torch
from torch.overrides import TorchFunctionMode

from .archs import ARCH_NAMES, LM_ARCHS, is_import_path
from .run.checkpoint import (LAYOUT_FREE, MANIFEST, UnreadableCheckpoint, complete_checkpoints,
                             is_complete, read_blocks, resume_readable)
from .run.torch_files import first_non_finite, state_misfit
from .comm.compress import FORMATS, Codec
from .files import OutputRefused, atomic_path, check_output
from .models import PRECISIONS, NetSpec, build_network, set_precision

MODEL_FORMAT = "petra_mpi.model/1"
# The largest picture side (stored or cropped) predict and evaluate prepare: a picture of that
# side is 50 MB of pixels; a crafted record of a million would take terabytes.
MAX_SIDE = 4096
DATA_TYPES = {"path": (str, type(None)), "batch_size": int, "synthetic_train": int,
              "synthetic_val": int, "synthetic_seed": int, "crop": (int, type(None))}
DTYPES = ("float32", "float64")  # run.dtype


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
    precision, forward compression and stage split of its evaluation). UnreadableCheckpoint
    when a file of it cannot be read back."""
    with open(os.path.join(checkpoint, MANIFEST)) as f:
        manifest = json.load(f)
    if manifest.get("format") != LAYOUT_FREE:
        raise ExportError(f"{checkpoint}: its manifest is not of the checkpoint format this "
                          f"version exports (\"format\": {LAYOUT_FREE})")
    try:
        with open(os.path.join(checkpoint, "trainer.json")) as f:
            trainer = json.load(f)
        position = {"epoch": trainer["epoch"], "position": trainer["position"]}
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise UnreadableCheckpoint(f"trainer.json: {e}") from None
    try:
        network, config = manifest["network"], manifest["config"]
        state = read_blocks(checkpoint, manifest, 0, sum(manifest["partition"]))["stage"]
        data = {key: config["data"][key] for key in DATA_TYPES}
        # The run's evaluation: blocks in run.precision, each stage's output rounded to the
        # nearest in comm.forward before the next stage (Outbox.put with evaluation=True).
        evaluation = {"precision": config["run"].get("precision", "fp32"),
                      "forward": config.get("comm", {}).get("forward", "none"),
                      "partition": manifest["partition"]}
        dtype, seed = config["run"]["dtype"], config["run"]["seed"]
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise ExportError(f"{checkpoint}/{MANIFEST}: not a manifest this version reads "
                          f"({type(e).__name__}: {e})") from None
    return {"format": MODEL_FORMAT, "network": network, "state_dict": state,
            "evaluation": evaluation, "preprocess": recorded_preprocessing(data), "dtype": dtype,
            "data": data, "seed": seed, **position, "checkpoint": os.path.abspath(checkpoint)}


def exported_run(run_dir: str, checkpoint: str | None = None) -> tuple[str, dict]:
    """(the checkpoint read, exported_model of it): `checkpoint` if given, else RUN_DIR's
    newest complete checkpoint, or where a file of it cannot be read back, the previous
    complete one, with a line saying so (as a resumed run does, but the run is left as it is)."""
    path = find_checkpoint(run_dir, checkpoint)
    try:
        return resume_readable(path, exported_model, fallback=checkpoint is None,
                               read_only=True)
    except UnreadableCheckpoint as e:
        raise ExportError(str(e)) from None


def model_file(saved: dict, out: str) -> dict:
    """`saved` as the model file `out` records it, with no path of the machine that wrote it:
    the checkpoint by its name, the data file relative to the model file's folder (a reader
    finds it there while the two keep their places, copied together or not), and none where
    only the file system's root holds both."""
    path = saved["data"]["path"]
    if path not in (None, "synthetic"):
        folder, path = os.path.dirname(os.path.abspath(out)), os.path.abspath(path)
        shared = os.path.commonpath([folder, path]) != os.path.sep
        path = os.path.relpath(path, folder) if shared else None
    return {**saved, "data": {**saved["data"], "path": path},
            "checkpoint": os.path.basename(saved["checkpoint"])}


def from_model_file(saved: dict, source: str) -> dict:
    """`saved`, read from the model file `source`, with its data path as this process reaches
    it (model_file records it relative to the model file's folder)."""
    path = saved["data"]["path"]
    if path not in (None, "synthetic"):
        path = os.path.join(os.path.dirname(source), path)  # an absolute path stays as it is
    return {**saved, "data": {**saved["data"], "path": path}}


def preprocessing_of(data: dict) -> dict | None:
    """How the run's evaluation prepared an image of its data, for petra_mpi.predict to prepare
    a picture the same way: the kind of images ("jpeg" or "array"), their stored side (the JPEG
    variant's shorter side), the evaluation's centre crop (JPEG), the channel mean and std, and
    the class names (None where the file has none). None for token files; OSError or
    ValueError where the data cannot be read."""
    from .data import open_split
    from .data.augment import crop_side
    from .data.hdf5 import open_readonly
    src = open_split(data["path"], "val", seed=data["synthetic_seed"],
                     synthetic_sizes=(data["synthetic_train"], data["synthetic_val"]))
    if src.kind not in ("jpeg", "array"):
        return None
    classes = None
    if data["path"] != "synthetic":
        with open_readonly(data["path"]) as f:
            classes = [c.decode() for c in f["classes"][:]] if "classes" in f else None
    return {"kind": src.kind, "image_size": src.image_size, "mean": list(src.mean),
            "std": list(src.std),
            "crop": crop_side(src.image_size, data["crop"]) if src.kind == "jpeg" else None,
            "classes": classes}


def recorded_preprocessing(data: dict) -> dict | None:
    """preprocessing_of the run's data as export records it: None where the data cannot be read
    here (predict then asks for it)."""
    try:
        return preprocessing_of(data)
    except (OSError, ValueError):
        return None


def checked_model(saved, source: str, trusted: str | None = None) -> dict:
    """`saved` (what the model file `source` holds) once it is a model of this format whose
    network holds exactly its weights, all finite, and whose record of its data is of the
    kinds and sizes the commands prepare; ExportError naming the file and what is wrong
    otherwise. Nothing is built at the file's word before that: the network is compared with
    the weights on the meta device, which allocates nothing; a network of one's own only when
    `trusted` (the command's --arch) names its import path."""
    def wrong(why):
        return ExportError(f"{source}: {why}")
    if not isinstance(saved, dict) or saved.get("format") != MODEL_FORMAT:
        raise wrong("not a model written by python -m petra_mpi.export (the state_dict format)")
    saved = {"evaluation": {}, "preprocess": None, "dtype": "float32", "seed": 0, **saved}
    network, state, data = (saved.get(k) for k in ("network", "state_dict", "data"))
    if not (isinstance(state, dict) and all(isinstance(k, str) and torch.is_tensor(v)
                                            for k, v in state.items())):
        raise wrong("its state_dict is not tensors by name")
    bad = first_non_finite(state)
    if bad:
        raise wrong(f"{bad} holds values that are not finite")
    if not (isinstance(data, dict) and all(isinstance(data.get(k), kind)
                                           for k, kind in DATA_TYPES.items())):
        raise wrong(f"its data settings are not {', '.join(DATA_TYPES)}")
    if saved["dtype"] not in DTYPES or not evaluated_as_recorded(saved["evaluation"]):
        raise wrong("its dtype or its record of how the run evaluated is not one this version "
                    "reads")
    misfit = network_misfit(network, state, trusted)
    if misfit:
        raise wrong(misfit)
    if saved["preprocess"] is not None:
        check_fits(saved, checked_preprocess(saved["preprocess"], source), source)
    return saved


def evaluated_as_recorded(evaluation) -> bool:
    """Whether `evaluation` is AsEvaluated's arguments: a precision, a forward format and a
    split."""
    partition = evaluation.get("partition", []) if isinstance(evaluation, dict) else None
    return (isinstance(partition, list) and all(type(n) is int for n in partition) and
            set(evaluation) <= {"precision", "forward", "partition"} and
            evaluation.get("precision", "fp32") in PRECISIONS and
            evaluation.get("forward", "none") in FORMATS)


def network_misfit(network, state: dict, trusted: str | None = None):
    """Why `network` (build_network's arguments) is not the network of the tensors `state`,
    found on the meta device (nothing allocated); None when it is. A network of one's own
    (its arch an import path) is built only when `trusted` is that import path."""
    arch = network.get("arch") if isinstance(network, dict) else None
    yours = is_import_path(arch)
    if not ((arch in ARCH_NAMES or yours) and isinstance(network.get("num_classes"), int)):
        return (f"its network is not one of {', '.join(ARCH_NAMES)} nor a network of your own "
                f"(an import path), with its num_classes")
    if yours and arch != trusted:
        return (f"its network is {arch}, a network of your own: name it with --arch {arch} to "
                f"let this command import that code (a file alone never makes it run code)")
    depth = network.get("depth", 0)  # every transformer block holds tensors: bound the build
    if not yours and (not isinstance(depth, int) or not 0 <= depth <= len(state)):
        return f"its network's depth {depth!r} does not match its {len(state)} tensors"
    side = network.get("image_size", 32)  # a language model's is its context

    def not_a_side():
        return not (type(side) is int and 1 <= side <= MAX_SIDE)
    if not yours and arch not in LM_ARCHS and not_a_side():
        return f"its network's image_size {side!r} is not a picture side (1 to {MAX_SIDE})"
    try:
        own = shapes_of(network)
        pictures = not takes_tokens(network)
    except Exception as e:  # noqa: BLE001 - arguments from a file: any of them may be wrong
        return f"its network does not build ({type(e).__name__}: {str(e).splitlines()[0]})"
    if yours and pictures and not_a_side():
        return f"its network's image_size {side!r} is not a picture side (1 to {MAX_SIDE})"
    misfit = state_misfit(own, state)
    return f"its weights are not its network's: {misfit}" if misfit else None


def takes_tokens(network: dict) -> bool:
    """Whether the network of build_network's arguments reads token ids (a language model)."""
    return NetSpec.of_network(network).takes_tokens


class _ValuesSkipped(TorchFunctionMode):
    """Under it (and torch.device("meta")), building a module makes its tensors' shapes only:
    the in-place ops that write values (every initialiser) are skipped, as meta tensors hold no
    values; run, the meta kernels of the random draws import torch's compiler (seconds)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name.endswith("_") and not name.endswith("__"):
            return args[0] if args else next(iter(kwargs.values()))
        return func(*args, **kwargs)


def shapes_of(network: dict) -> dict:
    """The state_dict build_network(**network) would have, on the meta device: every tensor's
    name and shape, with no memory allocated and nothing drawn."""
    with torch.device("meta"), _ValuesSkipped():
        return build_network(**network).state_dict()


def checked_preprocess(pre, source: str) -> dict:
    """`pre` (how images were prepared: a model's record, or preprocessing_of a data file) once
    its values are of the kinds and sizes predict and evaluate prepare; ExportError naming
    `source` otherwise."""
    def wrong(why):
        return ExportError(f"{source}: {why}")
    if not isinstance(pre, dict) or pre.get("kind") not in ("jpeg", "array"):
        raise wrong("its record of how images were prepared is not of this version")
    for key in ("image_size", "crop") if pre["kind"] == "jpeg" else ("image_size",):
        side = pre.get(key)
        if not (type(side) is int and 1 <= side <= MAX_SIDE):
            raise wrong(f"{key} {side!r} is not a picture side these commands prepare (1 to "
                        f"{MAX_SIDE} pixels)")
    stats = [pre.get("mean"), pre.get("std")]
    if not (all(isinstance(v, list) and len(v) == 3 and
                all(isinstance(x, (int, float)) and math.isfinite(x) for x in v) for v in stats)
            and min(pre["std"]) > 0):
        raise wrong("its channel mean and std are not 3 finite numbers each (std above 0)")
    classes = pre.get("classes")
    if not (classes is None or (isinstance(classes, list) and
                                all(isinstance(c, str) for c in classes))):
        raise wrong("its class names are not a list of names")
    return pre


def check_fits(saved: dict, pre: dict, source: str):
    """ExportError unless the images `pre` describes (checked_preprocess) are of the kind the
    model was trained on: as many class names as it has classes, arrays of its input side,
    and what its record says (the kind of images, their stored side, the class names)."""
    network, record = saved["network"], saved["preprocess"]
    classes, count = pre["classes"], network["num_classes"]
    if classes is not None and len(classes) != count:
        raise ExportError(f"{source} has {len(classes)} classes, the model {count}")
    side = network.get("image_size")
    if pre["kind"] == "array" and side is not None and pre["image_size"] != side:
        raise ExportError(f"{source} holds pictures of side {pre['image_size']}, the model "
                          f"takes {side}")
    if record is None:
        return
    for key, what in (("kind", "images are stored as"), ("image_size", "pictures' stored side")):
        if pre[key] != record[key]:
            raise ExportError(f"{source}: its {what} {pre[key]!r}, the model's data "
                              f"{record[key]!r}")
    if classes is not None and record["classes"] is not None and classes != record["classes"]:
        theirs, mine = next((a, b) for a, b in zip(classes, record["classes"]) if a != b)
        raise ExportError(f"{source}: its classes are not the model's ({theirs!r} where the "
                          f"model has {mine!r})")


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
    if takes_tokens(network):
        context = network["context"]
        example = torch.zeros(2, context, dtype=torch.long)
        dims = {0: batch, 1: torch.export.Dim("tokens", min=1, max=context)}
    else:
        side = network.get("image_size", 32)
        example, dims = torch.zeros(2, 3, side, side), {0: batch}
    program = torch.export.export(model, (example,), dynamic_shapes=(dims,))
    torch.export.save(program, out)


def export(run_dir: str, out: str, checkpoint: str | None = None, fmt: str = "state_dict",
           trusted: str | None = None) -> dict:
    path, saved = exported_run(run_dir, checkpoint)
    checked_model(saved, path, trusted)  # write only what the commands that read it accept
    # torch.export's writer wants the extension kept
    with atomic_path(out, keep_extension=True) as tmp:
        if fmt == "torch.export":
            write_torch_export(saved, tmp)
        else:
            torch.save(model_file(saved, out), tmp)
    return saved


def add_arch_argument(parser):
    """--arch, for the model of a network of one's own, which these commands import only when
    told to."""
    parser.add_argument("--arch", metavar="PACKAGE.MODULE:FUNCTION",
                        help="a network of your own: the import path the model names (its "
                             "model.arch), to let this command import that code; a file alone "
                             "never makes these commands run code")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m petra_mpi.export",
                                description=__doc__.split("\n")[0].strip("`"))
    p.add_argument("run_dir", help="the run's run.out_dir")
    p.add_argument("--checkpoint", help="a checkpoint directory (default: the run's newest)")
    p.add_argument("--out", required=True, help="the file to write, e.g. model.pt")
    p.add_argument("--force", action="store_true", help="replace --out if it exists")
    p.add_argument("--format", choices=("state_dict", "torch.export"), default="state_dict",
                   help="state_dict (default): the state_dict and build_network's arguments; "
                        "torch.export: a program that loads with torch alone")
    add_arch_argument(p)
    args = p.parse_args(argv)
    try:  # before any checkpoint is read: not a folder, not an existing file unless --force
        check_output(args.out, [os.path.join(args.run_dir, "checkpoints")], force=args.force)
    except OutputRefused as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        saved = export(args.run_dir, args.out, args.checkpoint, args.format, args.arch)
    except (ExportError, OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"exported {saved['network']['arch']} from {saved['checkpoint']} (epoch "
          f"{saved['epoch']}, micro-batch {saved['position']}) to {args.out} ({args.format})",
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
