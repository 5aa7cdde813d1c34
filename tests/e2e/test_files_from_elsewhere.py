"""Model files and checkpoints from elsewhere: every command that reads one (a resumed run,
export, evaluate of a run or of a model file, predict, generate) reads it as weights only, so
a file that runs code as it loads runs nothing; a file it cannot use (empty, text, truncated,
a zip of junk, a tensor, non-finite weights, an absurd record, a network its weights do not
fit) ends the command with one line naming the file and what is wrong, exit status 2 (a run: 1,
its status for a checkpoint it cannot resume from), no traceback, nothing written and its
inputs unchanged. Then what such files may not do quietly: a data file of another kind, a
model file holding paths of the machine that wrote it, outputs that are NaN, a damaged newest
checkpoint.

The default selection runs one crafted file per command in this process (on the shared
picture_model of tests/conftest.py); the full table runs each command as a user does, under a
timeout (extended)."""
import contextlib
import hashlib
import io
import json
import shutil
import subprocess
import sys
from pathlib import Path

import h5py
import pytest
import torch

from petra_mpi import evaluate, export, generate, predict, train
from petra_mpi.archs import ARCH_NAMES, LM_ARCHS, VIT_ARCHS
from petra_mpi.models import build_network
from tests.support.launch import run_packer
from tests.support.model_files import (MODEL_KINDS, STAGE_KINDS, craft, craft_stage_file,
                                       first_weight, picture_run_sets)
from tests.support.paths import ROOT
from tests.support.pictures import make_picture_folder

NEWEST = "ckpt-e00001-b00000000"  # the picture run's checkpoints: this one and ckpt-e00000-b...2
MODULES = {"train": train, "export": export, "evaluate": evaluate, "predict": predict,
           "generate": generate}


@pytest.fixture
def inputs(picture_model, tmp_path):
    """tmp_path/in: a copy of the picture run (run/) and of its model file (model.pt), beside
    the shared packed file and val folder, which are read only."""
    model, val, data, run = picture_model
    shutil.copytree(run, tmp_path / "in" / "run")
    shutil.copy(model, tmp_path / "in" / "model.pt")
    return tmp_path / "in", val, data


def command(reader, folder, val, data):
    """The command line (a module of petra_mpi and its arguments) of `reader` on the files of
    `folder` (run/, model.pt) and where it would write (out/)."""
    run, model = folder / "run", folder / "model.pt"
    return {"resume": ["train", "configs/folder_example.yaml",
                       *picture_run_sets(data, run, "train.epochs=2")],
            "export": ["export", run, "--out", folder / "out" / "model.pt"],
            "evaluate RUN_DIR": ["evaluate", run],
            "evaluate MODEL --data": ["evaluate", model, "--data", data],
            "predict": ["predict", model, val],
            "generate": ["generate", model, "--prompt", "a"]}[reader]


CHECKPOINT_READERS = ("resume", "export", "evaluate RUN_DIR")
MODEL_READERS = ("evaluate MODEL --data", "predict", "generate")


def in_process(module, *args):
    """python -m petra_mpi.MODULE ARGS in this process: (status, stdout, stderr)."""
    out, err, threads = io.StringIO(), io.StringIO(), torch.get_num_threads()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            status = MODULES[module].main([str(a) for a in args])
    finally:
        torch.set_num_threads(threads)  # a run sets its own
    return status, out.getvalue(), err.getvalue()


def as_a_user(module, *args):
    """python -m petra_mpi.MODULE ARGS in a process of its own, under a timeout: a hang fails."""
    proc = subprocess.run([sys.executable, "-m", f"petra_mpi.{module}", *map(str, args)],
                          capture_output=True, text=True, timeout=180, cwd=ROOT)
    return proc.returncode, proc.stdout, proc.stderr


def checksums(folder):
    """{path: sha1} of every file below `folder`: what was written, changed or removed."""
    return {str(p.relative_to(folder)): hashlib.sha1(p.read_bytes()).hexdigest()
            for p in sorted(Path(folder).rglob("*")) if p.is_file()}


def prepare(reader, kind, folder):
    """Put a crafted file of `kind` where `reader` reads it: the newest checkpoint's stage3.pt
    (the only checkpoint left, so there is nothing to fall back to), or the model file. Returns
    what the refusal must name: the file, or the weight of another shape."""
    marker = folder.parent / "code ran"
    if reader in CHECKPOINT_READERS:
        shutil.rmtree(folder / "run" / "checkpoints" / "ckpt-e00000-b00000002")
        checkpoint = folder / "run" / "checkpoints" / NEWEST
        weight = first_weight(torch.load(checkpoint / "stage3.pt", weights_only=True))
        craft_stage_file(checkpoint, "stage3.pt", kind, marker)
        return f"{weight} has shape" if kind == "a weight of another shape" else \
            f"{NEWEST}: stage3.pt"
    crafted = craft(kind, folder / "model.pt", folder / "crafted.pt", marker)
    shutil.move(crafted, folder / "model.pt")
    return f"{folder / 'model.pt'}: "


def refused(launch, reader, kind, inputs):
    """Run `reader` on a crafted file of `kind` and check the refusal."""
    folder, val, data = inputs
    named = prepare(reader, kind, folder)
    before = checksums(folder)
    status, out, err = launch(*command(reader, folder, val, data))
    said = [line for line in err.splitlines() if not line.startswith("petra_mpi: warning:")]
    assert status == (1 if reader == "resume" else 2), (reader, kind, status, err)
    assert len(said) == 1 and named in said[0] and "Traceback" not in err, (reader, kind, err)
    assert "weights_only" not in err and not out, (reader, kind, out, err)
    assert checksums(folder) == before, (reader, kind, "wrote or changed a file")
    assert not (folder.parent / "code ran").exists(), (reader, kind, "the file's code ran")
    return said[0]


@pytest.mark.parametrize("reader", CHECKPOINT_READERS + MODEL_READERS)
def test_a_file_that_runs_code_runs_nothing(inputs, reader):
    """The file whose unpickling runs `touch "code ran"` (what an unsafe torch.load does at
    once, before any check): refused by its name, the marker never made."""
    said = refused(in_process, reader, "runs code", inputs)
    assert "refused: it holds objects other than tensors and plain values (posix.system)" in said


@pytest.mark.parametrize("reader", CHECKPOINT_READERS)
def test_a_stage_file_that_does_not_fit_the_model_is_one_line(inputs, reader):
    """A stage file whose weight has another shape than the run's model (a run resuming: one
    line where torch's load_state_dict lists its errors; export refuses to write a model file
    that would not load)."""
    refused(in_process, reader, "a weight of another shape", inputs)


@pytest.mark.extended  # 51 commands in processes of their own: 3 to 6 minutes on 2 cores
@pytest.mark.parametrize("reader,kind",
                         [(r, k) for r in CHECKPOINT_READERS for k in STAGE_KINDS] +
                         [(r, k) for r in MODEL_READERS for k in MODEL_KINDS])
def test_every_reader_refuses_every_crafted_file_in_one_line(inputs, reader, kind):
    refused(as_a_user, reader, kind, inputs)


def test_predict_bounds_the_picture_side_a_data_file_records(inputs, tmp_path):
    """A JPEG-variant file whose image_size says 10**6: predict would prepare each picture at
    that side (terabytes); refused in one line, naming the file."""
    folder, val, data = inputs
    huge = tmp_path / "huge.h5"
    shutil.copy(data, huge)
    with h5py.File(huge, "r+") as f:
        f.attrs["image_size"] = 10**6
    status, out, err = in_process("predict", folder / "model.pt", val, "--data", huge)
    assert status == 2 and not out
    assert err == (f"error: {huge}: image_size 1000000 is not a picture side these commands "
                   f"prepare (1 to 4096 pixels)\n")


@pytest.fixture(scope="module")
def other_data(tmp_path_factory):
    """Packed files of other kinds than the picture model's (JPEGs of side 20, cropped to 16,
    classes cat, dog, fox): raw 12-pixel arrays of the same classes; two of the classes; and
    fox renamed owl."""
    root = tmp_path_factory.mktemp("other")
    files = {}
    for name, classes, size in (("raw12", ("cat", "dog", "fox"), ("--raw", 12)),
                                ("two", ("cat", "dog"), ("--size", 20)),
                                ("owl", ("cat", "dog", "owl"), ("--size", 20))):
        make_picture_folder(root / name / "train", classes, per_class=2)
        make_picture_folder(root / name / "val", classes, per_class=1, seed=1)
        files[name] = root / f"{name}.h5"
        status, _, err = run_packer("folder", "--source", root / name, "--out", files[name],
                                    *size, "--workers", 1)
        assert status == 0, err
    return files


def test_a_data_file_of_another_kind_is_refused(inputs, other_data):
    """evaluate --data compares the file with the model's record (sides, classes); predict
    --data with fewer classes than the model is one line, not an IndexError."""
    folder, val, _ = inputs
    model = folder / "model.pt"
    raw12, owl, two = (other_data[name] for name in ("raw12", "owl", "two"))
    cases = [("evaluate", raw12, f"{raw12} holds pictures of side 12, the model takes 16"),
             ("evaluate", owl, f"{owl}: its classes are not the model's ('owl' where the model "
                               f"has 'fox')"),
             ("predict", two, f"{two} has 2 classes, the model 3")]
    for module, data, why in cases:
        args = (model, "--data", data) if module == "evaluate" else (model, val, "--data", data)
        status, out, err = in_process(module, *args)
        assert status == 2 and not out and err == f"error: {why}\n", err


def test_outputs_that_are_not_finite_are_never_printed_as_nan(inputs):
    """A model whose head overflows (weights finite, outputs not): evaluate's JSON holds null
    for the loss and the status is 1; predict --json answers each picture with an error, every
    line strict JSON."""
    folder, val, data = inputs
    saved = torch.load(folder / "model.pt", weights_only=True)
    head = [n for n, t in saved["state_dict"].items() if t.dim() == 2][-1]  # the head's weight
    saved["state_dict"][head] = torch.full_like(saved["state_dict"][head], 3e38)
    torch.save(saved, folder / "model.pt")

    def strict(line):
        return json.loads(line, parse_constant=lambda c: pytest.fail(f"bare {c} in {line}"))
    status, out, err = in_process("evaluate", folder / "model.pt", "--data", data)
    assert status == 1 and "is not finite" in err and err.count("\n") == 1, err
    result = strict(out.splitlines()[-1])
    assert result["val_loss"] is None and 0 <= result["val_acc"] <= 1
    status, out, err = in_process("predict", folder / "model.pt", val, "--json")
    answers = [strict(line) for line in out.splitlines()]
    assert status == 1 and len(answers) == 15 and all("not finite" in a["error"] for a in answers)


def test_export_and_evaluate_read_the_previous_checkpoint_when_the_newest_is_damaged(inputs,
                                                                                     capsys,
                                                                                     tmp_path):
    """The newest checkpoint's stage file zero-filled at its size (a crash): export and evaluate
    of the run read the previous complete one, as a resumed run does, with its line, and leave
    the run as it is (a resumed run sets the damaged one aside; a command that only reads
    does not)."""
    folder, _, _ = inputs
    run, out = folder / "run", tmp_path / "model.pt"
    damaged = run / "checkpoints" / NEWEST / "stage3.pt"
    damaged.write_bytes(bytes(damaged.stat().st_size))
    before = checksums(run)
    line = (f"petra_mpi: checkpoint {run / 'checkpoints' / NEWEST} cannot be read (stage3.pt: "
            f"not a file of tensors and plain values that torch.save wrote, or a damaged one "
            f"(truncated, corrupted)): reading the previous complete checkpoint "
            f"{run / 'checkpoints' / 'ckpt-e00000-b00000002'}")
    status, _, err = in_process("export", run, "--out", out)
    assert status == 0 and err.splitlines()[0] == line, err
    assert torch.load(out, weights_only=True)["checkpoint"] == "ckpt-e00000-b00000002"
    saved = evaluate.load_saved(str(run))  # what evaluate RUN_DIR evaluates
    assert capsys.readouterr().err.splitlines() == [line]
    assert saved["checkpoint"] == str(run / "checkpoints" / "ckpt-e00000-b00000002")
    assert checksums(run) == before


def test_a_model_file_records_no_path_of_the_machine_that_wrote_it(inputs, tmp_path,
                                                                     monkeypatch):
    """Exported to models/: the data file is recorded relative to the model file's folder, the
    checkpoint by its name; the readers find the data from the model file, wherever they run."""
    folder, _, data = inputs
    out = tmp_path / "models" / "model.pt"
    assert in_process("export", folder / "run", "--out", out)[0] == 0
    saved = torch.load(out, weights_only=True)

    def strings(value):
        if isinstance(value, dict):
            return [s for v in value.values() for s in strings(v)]
        if isinstance(value, (list, tuple)):
            return [s for v in value for s in strings(v)]
        return [value] if isinstance(value, str) else []
    recorded = strings({k: v for k, v in saved.items() if k != "state_dict"})
    assert not [s for s in recorded if s.startswith("/") or str(tmp_path.parent) in s]
    assert saved["data"]["path"].startswith("../")
    assert (out.parent / saved["data"]["path"]).resolve() == data.resolve()
    assert saved["checkpoint"] == NEWEST
    monkeypatch.chdir(tmp_path / "models")  # where evaluate, predict and generate find it
    assert Path(evaluate.load_saved("model.pt")["data"]["path"]).samefile(data)
    # a data file that shares no folder but the root with the model file: not recorded at all
    elsewhere = export.model_file({**saved, "data": {**saved["data"], "path": "/srv/d.h5"}},
                                  str(out))
    assert elsewhere["data"]["path"] is None


@pytest.mark.parametrize("reader", ["export", "evaluate MODEL --data"])
def test_non_finite_weights_are_refused_by_name(inputs, reader):
    """A NaN among the weights of a checkpoint or a model file: refused, the tensor named."""
    said = refused(in_process, reader, "non-finite weights", inputs)
    first = "blocks.3.branch.0.0.weight" if reader == "export" else "blocks.0.body.0.weight"
    assert f"{first} holds values that are not finite" in said


@pytest.mark.parametrize("arch", ARCH_NAMES)
def test_the_shapes_a_model_file_is_checked_against_are_the_built_networks(arch):
    """export.shapes_of builds on the meta device without initialisers: the same names and
    shapes as the network built for real (else a valid model file would be refused)."""
    network = dict(arch=arch, width=4, num_classes=5)
    if arch in LM_ARCHS:
        network.update(depth=2, heads=2, context=8)
    elif arch in VIT_ARCHS:
        network.update(depth=2, image_size=16, patch=4)
    built = build_network(**network).state_dict()
    assert {k: t.shape for k, t in export.shapes_of(network).items()} == \
        {k: t.shape for k, t in built.items()}
