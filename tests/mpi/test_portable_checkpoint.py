"""Layout-free checkpoints: the files hold the network's own names, a run on another number of
stages, another split or another number of replicas resumes with exactly the checkpoint's weights
and optimizer state (under mpirun where the writer and the reader have several ranks), what
changes the learning dynamics is reported and what would be wrong (another model, data set or
recipe, another checkpoint format) is refused."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from petra_mpi.run.checkpoint import (CheckpointError, block_files, complete_checkpoints,
                                  load_blocks, read_manifest, save_blocks,
                                  write_manifest)
from petra_mpi.engines.build import build_workers
from petra_mpi.engines.local import LocalEngine
from petra_mpi.models import build_network
from petra_mpi.core.optim import LRSchedule
from tests.support.nets import make_batches, stages_of
from tests.support.launch import mpirun
from tests.support.paths import PROGRAMS, ROOT

DUMP = PROGRAMS / "resume_dump.py"


# ---------------------------------------------------------------- in one process

def trained_workers(partition, optimizer="sgd", seed=0):
    """RevNet18 (width 4) on `partition`, after 4 micro-batches of PETRA with k = 2: every
    parameter has optimizer state, every batch norm moved statistics."""
    stages = stages_of("revnet18", 4, 10, len(partition), seed=seed, partition=partition)
    workers = build_workers(stages, LRSchedule(0.1, 10), 2, weight_decay=5e-4,
                            optimizer=optimizer)
    batches = make_batches(4, dtype=torch.float32)
    LocalEngine(workers, "petra").train_segment(iter(batches), len(batches))
    return workers


def fresh_workers(partition, optimizer="sgd"):
    stages = stages_of("revnet18", 4, 10, len(partition), seed=7, partition=partition)
    return build_workers(stages, LRSchedule(0.1, 10), 2, optimizer=optimizer)


def merged(directory, optimizer="sgd"):
    """Every stage file of a layout-free checkpoint (or dump): (weights and statistics by network
    name, optimizer state by parameter name, the set of step counters)."""
    weights, state, steps = {}, {}, set()
    for f in sorted(Path(directory).glob("stage*.pt")):
        part = torch.load(f, weights_only=True)
        weights.update(part["stage"])
        state.update(part["optimizer"][optimizer]["state"])
        steps.add(part["optimizer"]["steps"])
    return weights, state, steps


def assert_bitwise_equal(got, want):
    (gw, gs, _), (ww, ws, _) = got, want
    assert gw.keys() == ww.keys() and gs.keys() == ws.keys() and ws
    for name, value in ww.items():
        assert torch.equal(gw[name], value), name
    for name, per_param in ws.items():
        assert per_param.keys() == gs[name].keys()
        for key, value in per_param.items():
            assert torch.equal(torch.as_tensor(gs[name][key]), torch.as_tensor(value)), (name, key)


def write_checkpoint(path, workers, partition):
    files = dict(save_blocks(str(path), w) for w in workers)
    head = {"format": 2, "stages": len(partition), "partition": partition,
            "block_files": block_files(partition)}
    write_manifest(str(path), head, {"epoch": 0, "position": 4}, files)
    return json.loads((Path(path) / "manifest.json").read_text())


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_stage_files_hold_network_names_that_load_on_any_split(tmp_path, optimizer):
    written = [2, 3, 5]
    workers = trained_workers(written, optimizer)
    manifest = write_checkpoint(tmp_path, workers, written)
    saved = merged(tmp_path, optimizer)
    # the names are the plain network's: block g of the net is blocks.{g} whatever its stage
    assert set(saved[0]) == set(build_network("revnet18", 4, 10).state_dict())
    for partition in ([10], [5, 5], [1, 2, 3, 4], [9, 1]):
        loaded = fresh_workers(partition, optimizer)
        for w in loaded:
            load_blocks(str(tmp_path), manifest, w, "cpu")
        again = tmp_path / f"again-{len(partition)}-{partition[0]}"
        for w in loaded:
            save_blocks(str(again), w)
        assert_bitwise_equal(merged(again, optimizer), saved)
        assert {w.optimizer.steps for w in loaded} == {2} and not any(
            w.optimizer.pending for w in loaded)


@pytest.mark.parametrize("kw", [{"precision": "bf16"}, {"dtype": torch.float64}])
def test_float32_checkpoint_loads_into_bf16_compute_or_float64_stages(tmp_path, kw):
    """bf16 compute keeps float32 weights (autocast inside the blocks): they load bitwise;
    float64 stages hold the float32 values exactly, optimizer state included."""
    manifest = write_checkpoint(tmp_path, trained_workers([5, 5]), [5, 5])
    stages = stages_of("revnet18", 4, 10, 3, seed=7, partition=[3, 3, 4], **kw)
    loaded = build_workers(stages, LRSchedule(0.1, 10), 2)
    for w in loaded:
        load_blocks(str(tmp_path), manifest, w, "cpu")
        save_blocks(str(tmp_path / "again"), w)
    got = merged(tmp_path / "again")
    dtype = kw.get("dtype", torch.float32)
    assert all(v.dtype == dtype for v in got[0].values() if v.is_floating_point())
    as32 = ({k: v.float() if v.is_floating_point() else v for k, v in got[0].items()},
            {k: {n: t.float() for n, t in s.items()} for k, s in got[1].items()}, got[2])
    assert_bitwise_equal(as32, merged(tmp_path))


def test_a_checkpoint_of_another_optimizer_is_refused(tmp_path):
    manifest = write_checkpoint(tmp_path, trained_workers([5, 5], "adamw"), [5, 5])
    with pytest.raises(CheckpointError, match="adamw"):
        load_blocks(str(tmp_path), manifest, fresh_workers([10], "sgd")[0], "cpu")


IDENTITY = {"arch": "revnet18", "width": 4, "num_classes": 10, "stem": "cifar",
            "data": "synthetic", "batch_size": 64}
LAYOUT = {"stages": 2, "partition": [5, 5], "replicas": 2, "microbatches_per_epoch": 8}


def manifest_dir(tmp_path, **fields):
    (tmp_path / "trainer.json").write_text(json.dumps({"epoch": 1, "position": 0}))
    (tmp_path / "manifest.json").write_text(json.dumps({**IDENTITY, **LAYOUT, **fields}))
    return str(tmp_path)


@pytest.mark.parametrize("key,value", [("arch", "resnet18"), ("width", 8), ("stem", "imagenet"),
                                       ("data", "/data/other.h5"), ("batch_size", 32)])
def test_another_model_or_data_set_is_refused_with_the_key(tmp_path, key, value):
    path = manifest_dir(tmp_path, format=2)
    with pytest.raises(CheckpointError, match=f"cannot resume .*{key}: checkpoint has"):
        read_manifest(path, {**IDENTITY, key: value})


def test_a_manifest_of_another_format_is_refused(tmp_path):
    assert read_manifest(manifest_dir(tmp_path, format=2), IDENTITY)["trainer"]["epoch"] == 1
    with pytest.raises(CheckpointError, match="not of the checkpoint format"):
        read_manifest(manifest_dir(tmp_path), IDENTITY)  # no "format"


# ---------------------------------------------------------------- the trainer, under mpirun

SMALL = ["--set", "model.width=4", "--set", "data.synthetic_train=1024",
         "--set", "data.synthetic_val=128", "--set", "train.epochs=1", "--set",
         "run.progress=false", "--set", "model.balance=estimate", "--set",
         "run.keep_checkpoints=10"]


def train_args(out_dir, *extra):
    return ["-m", "petra_mpi.train", "configs/quickstart.yaml", "--set", f"run.out_dir={out_dir}",
            *SMALL, *extra]


def dump_after_resume(ranks, checkpoint, dump, *sets):
    args = [DUMP, dump, "configs/quickstart.yaml", "--set", f"run.out_dir={dump}", *SMALL,
            "--set", f"run.resume={checkpoint}", *sets]
    if ranks == 1:
        proc = subprocess.run([sys.executable, *map(str, args)], capture_output=True, text=True,
                              timeout=180, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"})
    else:
        proc = mpirun(ranks, args)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    return json.loads((Path(dump) / "resumed.json").read_text())


@pytest.fixture(scope="module")
def two_by_two(tmp_path_factory):
    """Written by mpirun -n 4 as 2 replicas x 2 stages: 8 micro-batches of 64 per replica and
    epoch, k = 2, a checkpoint every 4 micro-batches. Returns the mid-epoch checkpoint."""
    out = tmp_path_factory.mktemp("writer")
    proc = mpirun(4, train_args(out, "--set", "model.stages=2",
                                "--set", "run.checkpoint_every_microbatches=4"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    mid = Path(complete_checkpoints(str(out))[0])
    assert mid.name == "ckpt-e00000-b00000004"
    manifest = json.loads((mid / "manifest.json").read_text())
    assert (manifest["stages"], manifest["replicas"], manifest["steps_per_epoch"]) == (2, 2, 4)
    return mid


@pytest.mark.parametrize("ranks,sets,layout", [
    pytest.param(1, ["model.stages=1"], (1, 1), marks=pytest.mark.extended),  # J 2 -> 1, R 2 -> 1
    pytest.param(3, ["model.stages=3"], (3, 1), marks=pytest.mark.extended),  # J 2 -> 3, R 2 -> 1
    pytest.param(2, ["model.stages=1"], (1, 2), marks=pytest.mark.extended),  # J 2 -> 1, R stays 2
    pytest.param(4, ["model.partition=[1, 2, 3, 4]"], (4, 1),  # J 2 -> 4 on a given split, R 2 -> 1
                 marks=pytest.mark.extended),
])
def test_resume_on_another_layout_holds_the_checkpoints_state_bitwise(two_by_two, tmp_path,
                                                                      ranks, sets, layout):
    sets = [a for s in sets for a in ("--set", s)]
    resumed = dump_after_resume(ranks, two_by_two, tmp_path, *sets)
    J, R = layout
    assert (resumed["layout"]["stages"], resumed["layout"]["replicas"]) == (J, R)
    want = merged(two_by_two)
    for r in range(R):  # every replica holds the checkpoint's state
        assert_bitwise_equal(merged(tmp_path / f"replica{r}"), want)
    changes = " ".join(resumed["changes"])
    assert f"stages 2 -> {J}" in changes
    # progress carried over: 4 micro-batches of each of 2 replicas are 8 of the epoch, 8 / R'
    # per replica; the step counter keeps the schedule's place (2 of 4 steps per epoch)
    assert resumed["state"]["position"] == 8 // R
    steps_per_epoch = resumed["layout"]["steps_per_epoch"]
    assert steps_per_epoch == 8 // R
    assert resumed["steps"] == steps_per_epoch // 2 and want[2] == {2}
    assert ("replicas 2 -> 1" in changes) == (R == 1)


@pytest.mark.extended
def test_a_run_resumed_on_fewer_stages_and_one_replica_finishes(two_by_two, tmp_path):
    """The whole trainer: resumed from the 2 x 2 run's mid-epoch checkpoint on 1 replica of 1
    stage, it reports the change in one line, trains the rest and writes a checkpoint."""
    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, *train_args(out, "--set", "model.stages=1",
                                                       "--set", f"run.resume={two_by_two}")],
                          capture_output=True, text=True, timeout=180, cwd=ROOT,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [line for line in proc.stderr.splitlines() if "resumed on another layout" in line]
    assert len(lines) == 1 and "stages 2 -> 1" in lines[0] and "replicas 2 -> 1" in lines[0]
    events = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert events[0]["event"] == "resume" and events[0]["position"] == 8
    assert Path(complete_checkpoints(str(out))[-1]).name == "ckpt-e00001-b00000000"
