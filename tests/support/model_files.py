"""Model files and checkpoints for the commands that read them (predict, evaluate, export,
generate, a resumed run): a model trained briefly on a packed folder of pictures, a language
model's file, and files crafted from real ones as a stranger might send them."""
import json
import os
import shlex
import zipfile

import torch

from tests.support.launch import run_packer
from tests.support.pictures import make_picture_folder

SIZE, CROP = 20, 16


def train_picture_model(root):
    """(model.pt, the val folder, the packed file, the run directory): configs/folder_example.yaml
    shrunk, one short epoch in one process on 3 classes of 12 training pictures, a checkpoint
    every 2 micro-batches (the run keeps the 2 newest)."""
    from petra_mpi import export, train
    make_picture_folder(root / "photos" / "train", per_class=12)
    make_picture_folder(root / "photos" / "val", per_class=5, seed=1)
    data = root / "photos.h5"
    status, _, err = run_packer("folder", "--source", root / "photos", "--out", data,
                                "--size", SIZE, "--workers", 1)
    assert status == 0, err
    threads = torch.get_num_threads()
    try:
        code = train.main(["configs/folder_example.yaml", *picture_run_sets(data, root / "run")])
    finally:
        torch.set_num_threads(threads)
    assert code == 0
    export.export(str(root / "run"), str(root / "model.pt"))
    return root / "model.pt", root / "photos" / "val", data, root / "run"


def picture_run_sets(data, out_dir, *more):
    """The --set arguments of train_picture_model's run (more: further KEY=VALUE)."""
    sets = [f"data.path={data}", f"run.out_dir={out_dir}", f"data.crop={CROP}",
            "data.batch_size=8", "model.width=4", "train.epochs=1", "run.threads=1",
            "run.progress=false", "model.balance=estimate", "optim.warmup_epochs=0",
            "run.checkpoint_every_microbatches=2", *more]
    return [a for s in sets for a in ("--set", s)]


def language_model_file(path, vocab_size, data=None):
    """A revlm model file as export writes one (untrained weights), whose data is `data`."""
    from petra_mpi.export import MODEL_FORMAT
    from petra_mpi.models import build_network
    network = dict(arch="revlm", width=8, num_classes=vocab_size, depth=2, heads=2, context=8)
    torch.manual_seed(0)
    torch.save({"format": MODEL_FORMAT, "network": network,
                "state_dict": build_network(**network).state_dict(),
                "data": {"path": None if data is None else str(data), "batch_size": 4,
                         "synthetic_train": 1, "synthetic_val": 1, "synthetic_seed": 0,
                         "crop": None}}, path)
    return path


class RunsCode:
    """Unpickled, runs `touch MARKER` (what a file that runs code does as it loads)."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {shlex.quote(str(self.marker))}",)


def weights_of(saved):
    """The weights (name -> tensor) of a model file's or a stage file's contents."""
    return saved["state_dict" if "state_dict" in saved else "stage"]


def first_weight(saved):
    """The name of the first floating-point tensor among the weights of `saved`."""
    return next(n for n, t in weights_of(saved).items() if t.is_floating_point())


def with_first_weight(saved, value):
    """A copy of a model file's or a stage file's contents whose first floating-point tensor
    of its weights holds `value` at one place."""
    key = "state_dict" if "state_dict" in saved else "stage"
    tensors, name = dict(saved[key]), first_weight(saved)
    tensors[name] = tensors[name].clone()
    tensors[name].view(-1)[0] = value
    return {**saved, key: tensors}


def craft(kind, real, out, marker):
    """Write to `out` a file of `kind` made from the real torch file `real` (a model file or a
    stage file); `marker`: the file that the code-running kind creates when it is loaded with
    weights_only=False."""
    saved = torch.load(real, weights_only=True)
    if kind == "runs code":
        torch.save({**saved, "format": RunsCode(marker)}, out)
    elif kind == "empty":
        out.write_bytes(b"")
    elif kind == "text":
        out.write_text("model weights\n")
    elif kind == "truncated":
        out.write_bytes(real.read_bytes()[:real.stat().st_size // 2])
    elif kind == "zip of junk":
        with zipfile.ZipFile(out, "w") as z:
            z.writestr("archive/data.pkl", os.urandom(64))
    elif kind == "a tensor, not a dict":
        torch.save(torch.ones(3), out)
    elif kind == "non-finite weights":
        torch.save(with_first_weight(saved, float("nan")), out)
    elif kind == "a weight of another shape":
        name = first_weight(saved)
        torch.save({**saved, "stage": {**saved["stage"], name: saved["stage"][name][:1]}}, out)
    elif kind == "absurd image_size":
        torch.save({**saved, "preprocess": {**saved["preprocess"], "image_size": 10**6}}, out)
    elif kind == "a network its weights do not fit":
        torch.save({**saved, "network": {**saved["network"], "width": 10**6}}, out)
    else:
        raise ValueError(kind)
    return out


# The crafted files of a model file, and of a stage file of a checkpoint (which has no record or
# network of its own, but whose weights must fit the run's).
MODEL_KINDS = ("runs code", "empty", "text", "truncated", "zip of junk", "a tensor, not a dict",
               "non-finite weights", "absurd image_size", "a network its weights do not fit")
STAGE_KINDS = MODEL_KINDS[:7] + ("a weight of another shape",)


def craft_stage_file(checkpoint, name, kind, marker):
    """Replace stage file `name` of the checkpoint directory `checkpoint` by one of `kind`
    (craft) and record its size in the manifest, as whoever sends a whole run directory can:
    the checkpoint stays complete, so the readers must read the file."""
    real = checkpoint / name
    crafted = craft(kind, real, checkpoint / f"{name}.crafted", marker)
    os.replace(crafted, real)
    manifest = json.loads((checkpoint / "manifest.json").read_text())
    manifest["files"][name] = real.stat().st_size
    (checkpoint / "manifest.json").write_text(json.dumps(manifest))
