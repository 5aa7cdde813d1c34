"""Checkpoints: taken at a drain point (no micro-batch in flight), one file per stage written
atomically by the process that owns the stage, then a manifest that marks the checkpoint complete.

Layout: out_dir/checkpoints/ckpt-e{epoch:05d}-b{position:08d}/ with stage{s}.pt, trainer.json and
manifest.json. A directory without a manifest, or whose files do not match it, is never picked.

Durability: every file is flushed to disk (fsync) before it is renamed into place and the
directory after the renames, so the manifest is written only over stage files that survive a
crash of the node, and older checkpoints are pruned only once the new manifest has reached the
disk. If the newest checkpoint still cannot be read back (a file corrupted on a file system that
broke these promises), the run resumes from the previous complete one, says so, and renames the
unreadable one out of the way (ckpt-...corrupt): no later resume, prune or stall count takes it
for the newest.

The checkpoint does not depend on the layout that wrote it (manifest "format": 2): stage{s}.pt
holds that stage's blocks under the names of the whole network ("blocks.{g}.{rest}", g the
block's index in the network), its optimizer state keyed by the same parameter names, the
optimizer's counters and the random state; the manifest says which blocks each file holds. A run
with another number of stages, another split or another number of replicas reads the blocks it
owns from whichever files hold them. A manifest of another format is refused.

A stage file is read as weights only (torch_files.load_tensors: nothing in it can run code) and
must be what save_blocks writes, with finite weights: any other file makes the checkpoint
unreadable, as a damaged one is.
"""
import itertools
import json
import os
import re
import shutil
import sys

import torch

from ..files import fsync_dir, write_atomic, write_json_atomic
from .torch_files import UnreadableFile, first_non_finite, load_tensors, state_misfit

MANIFEST = "manifest.json"
CHECKPOINT_NAME = re.compile(r"ckpt-e\d+-b\d+")  # what checkpoint_dir names; nothing else counts
BLOCK_KEY = re.compile(r"\w+\.\d+\..+")  # a state key under the network's names: blocks.{g}.{rest}
CORRUPT = ".corrupt"  # the suffix of a checkpoint set aside because it could not be read back
LAYOUT_FREE = 2  # the manifest's "format" of checkpoints keyed by the network's own names
# Identity keys added after the first checkpoints were written, with the value those runs had.
IDENTITY_DEFAULTS = {"optimizer": "sgd", "lr_schedule": "step", "replicas": 1}


class CheckpointError(RuntimeError):
    pass


class UnreadableCheckpoint(CheckpointError):
    """A checkpoint whose files cannot be read back (truncated, corrupted or missing)."""


def checkpoint_dir(out_dir: str, epoch: int, position: int) -> str:
    return os.path.join(out_dir, "checkpoints", f"ckpt-e{epoch:05d}-b{position:08d}")


def invalidate(path: str):
    """Before a checkpoint directory is (re)written: drop its manifest, so that a crash halfway
    cannot leave old and new stage files under a manifest that looks complete."""
    for name in (MANIFEST, "trainer.json"):
        try:
            os.remove(os.path.join(path, name))
        except FileNotFoundError:
            pass
    if os.path.isdir(path):
        fsync_dir(path)


def _write_stage_file(path: str, index: int, state: dict) -> tuple[str, int]:
    """torch.save under a temporary name, flushed to disk, then rename: (file name, size) for
    the manifest."""
    final = os.path.join(path, f"stage{index}.pt")
    write_atomic(final, lambda f: torch.save(state, f), binary=True, durable=True)
    return os.path.basename(final), os.path.getsize(final)


def _load_file(path: str, name: str, device):
    """One stage file of a checkpoint, read as weights only (nothing in it can run code) and
    checked to be what save_blocks writes, with finite weights; anything else makes the
    checkpoint unreadable."""
    try:
        part = load_tensors(os.path.join(path, name), device)
    except UnreadableFile as e:
        raise UnreadableCheckpoint(f"{name}: {e.why}") from None
    why = _stage_file_problem(part)
    if why:
        raise UnreadableCheckpoint(f"{name}: {why}")
    return part


def _stage_file_problem(part):
    """What makes a loaded stage file other than what save_blocks writes, or None."""
    if not isinstance(part, dict):
        return f"holds a {type(part).__name__}, not a stage's state"
    stage, opt = part.get("stage"), part.get("optimizer")
    if not (isinstance(stage, dict) and all(isinstance(k, str) and BLOCK_KEY.fullmatch(k) and
                                            torch.is_tensor(v) for k, v in stage.items())):
        return "its \"stage\" is not tensors under the network's block names"
    names = [n for n in opt if n not in ("steps", "pending")] if isinstance(opt, dict) else []
    if not (len(names) == 1 and isinstance(opt[names[0]], dict) and
            isinstance(opt[names[0]].get("state"), dict) and
            all(isinstance(opt.get(k), int) for k in ("steps", "pending"))):
        return "its \"optimizer\" is not an optimizer's state and counters"
    if not (torch.is_tensor(part.get("rng")) and part["rng"].dtype == torch.uint8):
        return "its \"rng\" is not a random state"
    bad = first_non_finite(stage)
    return f"{bad} holds values that are not finite" if bad else None


def block_offset(stage) -> int:
    """The network index of the stage's first block."""
    return sum(stage.partition[:stage.index])


def _network_name(stage, local: str) -> str:
    """A stage's state key "blocks.{i}.{rest}" as the network's "blocks.{offset + i}.{rest}"."""
    head, i, rest = local.split(".", 2)
    return f"{head}.{int(i) + block_offset(stage)}.{rest}"


def _stage_name(stage, name: str) -> str:
    head, g, rest = name.split(".", 2)
    return f"{head}.{int(g) - block_offset(stage)}.{rest}"


def block_index(name: str) -> int:
    return int(name.split(".", 2)[1])


def _param_names(worker) -> list:
    """The network names of the optimizer's parameters, in the torch optimizer's index order
    (its groups' parameters one after the other: StageOptimizer.params)."""
    local = {id(p): n for n, p in worker.stage.named_parameters()}
    return [_network_name(worker.stage, local[id(p)]) for p in worker.optimizer.params]


def save_blocks(path: str, worker) -> tuple[str, int]:
    """Write one stage's blocks under their network names: weights and batch-norm statistics,
    the optimizer state of each parameter, the optimizer's counters and the random state,
    atomically; returns (file name, size) for the manifest."""
    stage, opt = worker.stage, worker.optimizer
    if opt.pending:  # a checkpoint is taken after a drain, whose last backward steps
        raise CheckpointError(f"stage {worker.index}: {opt.pending} gradients not yet applied")
    per_param = {}
    if opt.torch_optimizer is not None:
        names = _param_names(worker)
        per_param = {names[i]: s for i, s in opt.torch_optimizer.state_dict()["state"].items()}
    first = block_offset(stage)
    state = {"format": LAYOUT_FREE, "blocks": [first, first + len(stage.blocks)],
             "stage": {_network_name(stage, k): v for k, v in stage.state_dict().items()},
             "optimizer": {opt.name: {"state": per_param}, "steps": opt.steps,
                           "pending": opt.pending},
             "rng": torch.get_rng_state(), "cuda_rng": cuda_rng_state(stage_device(worker))}
    return _write_stage_file(path, worker.index, state)


def block_files(partition) -> dict:
    """{file name: [first block, end block)} of a layout-free checkpoint written on `partition`."""
    starts = list(itertools.accumulate([0, *partition]))
    return {f"stage{s}.pt": [starts[s], starts[s + 1]] for s in range(len(partition))}


def read_blocks(path: str, manifest: dict, first: int, end: int, device="cpu") -> dict:
    """The saved state of network blocks [first, end) of a layout-free checkpoint, merged from
    the files that hold them: {"stage": names -> tensors, "optimizer": {"state": names ->
    per-parameter state}, "steps", "name", "rng", "cuda_rng"}; the counters and the random
    state are those of the file holding block `first`."""
    merged = {"stage": {}, "state": {}}
    for name, (lo, hi) in manifest["block_files"].items():
        if hi <= first or lo >= end:
            continue
        part = _load_file(path, name, device)
        wanted = lambda key: first <= block_index(key) < end  # noqa: E731
        merged["stage"].update({k: v for k, v in part["stage"].items() if wanted(k)})
        opt_name = next(n for n in part["optimizer"] if n not in ("steps", "pending"))
        per_param = part["optimizer"][opt_name]["state"]
        merged["state"].update({k: v for k, v in per_param.items() if wanted(k)})
        if lo <= first < hi:
            merged.update(name=opt_name, steps=part["optimizer"]["steps"],
                          pending=part["optimizer"]["pending"], rng=part["rng"],
                          cuda_rng=part.get("cuda_rng"))
    return merged


def load_blocks(path: str, manifest: dict, worker, device):
    """Load a worker's blocks, whatever the layout that wrote them: weights and statistics
    (strictly: every key), the optimizer state of each parameter, the counters, the random
    state. The optimizer's hyper-parameters are this run's."""
    stage, opt = worker.stage, worker.optimizer
    first = block_offset(stage)
    saved = read_blocks(path, manifest, first, first + len(stage.blocks), device)
    if saved.get("name", opt.name) != opt.name:
        raise CheckpointError(f"the checkpoint holds {saved['name']} state, this run uses "
                              f"{opt.name}")
    own = {_network_name(stage, k): v for k, v in stage.state_dict().items()}
    misfit = state_misfit(own, saved["stage"])
    if misfit:  # one line, not torch's list; no fallback: an older one of the run fits no better
        raise CheckpointError(f"cannot resume from {path}: the blocks of stage {worker.index} do "
                              f"not load: {misfit}")
    stage.load_state_dict({_stage_name(stage, k): v for k, v in saved["stage"].items()})
    if opt.torch_optimizer is not None:
        names = _param_names(worker)
        state = {i: saved["state"][n] for i, n in enumerate(names) if n in saved["state"]}
        # torch casts each state to its parameter's device and dtype (CPU <-> GPU)
        opt.torch_optimizer.load_state_dict({"state": state,
                                 "param_groups": opt.torch_optimizer.state_dict()["param_groups"]})
    opt.steps, opt.pending = saved["steps"], saved["pending"]
    torch.set_rng_state(saved["rng"].cpu())
    restore_cuda_rng(saved.get("cuda_rng"), torch.device(device))


def write_manifest(path: str, identity: dict, trainer_state: dict, stage_files: dict):
    """Called once every stage file is on disk, with their sizes as their writers saw them (a
    shared file system may not show another node's file size yet): marks the checkpoint
    complete, and returns once that mark is on disk too (prune may then run)."""
    write_json_atomic(os.path.join(path, "trainer.json"), trainer_state, durable=True)
    files = dict(stage_files)
    files["trainer.json"] = os.path.getsize(os.path.join(path, "trainer.json"))
    write_json_atomic(os.path.join(path, MANIFEST), {**identity, "files": files,
                                                     "epoch": trainer_state["epoch"],
                                                     "position": trainer_state["position"]},
                      durable=True)
    fsync_dir(os.path.dirname(os.path.abspath(path)))  # the checkpoint's own directory entry


def incomplete_reason(path: str):
    """Why the checkpoint at `path` is not complete, or None when it is."""
    try:
        with open(os.path.join(path, MANIFEST)) as f:
            files = json.load(f)["files"]
        for name, size in files.items():
            if not os.path.exists(os.path.join(path, name)):
                return f"{name} is missing"
            if os.path.getsize(os.path.join(path, name)) != size:
                return f"{name} is not the size its manifest records"
    except FileNotFoundError:
        return f"no {MANIFEST}: its writing was interrupted"
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return f"its {MANIFEST} cannot be read"
    return None


def is_complete(path: str) -> bool:
    return incomplete_reason(path) is None


def checkpoint_names(root: str) -> list[str]:
    """The checkpoint directories in `root` (out_dir/checkpoints), oldest first; a checkpoint
    set aside (CORRUPT) is none of them."""
    if not os.path.isdir(root):
        return []
    return sorted(d for d in os.listdir(root) if CHECKPOINT_NAME.fullmatch(d))


def complete_checkpoints(out_dir: str) -> list[str]:
    """Complete checkpoints, oldest first."""
    root = os.path.join(out_dir, "checkpoints")
    paths = [os.path.join(root, d) for d in checkpoint_names(root)]
    return [p for p in paths if is_complete(p)]


def find_resume(out_dir: str, resume: str):
    """The checkpoint to resume from: None for a fresh start (`auto` with none there). `none`
    with checkpoints already in out_dir is an error: they would mix with the new run's."""
    if resume == "none":
        if complete_checkpoints(out_dir):
            raise CheckpointError(f"run.out_dir {out_dir} holds checkpoints of an earlier run: "
                                  f"continue it with run.resume=auto, or use another run.out_dir")
        return None
    if resume == "auto":
        found = complete_checkpoints(out_dir)
        newest = found[-1] if found else None
        _report_newer_incomplete(out_dir, newest)
        return newest
    if not is_complete(resume):
        raise CheckpointError(f"run.resume {resume}: not a complete checkpoint (no valid "
                              f"{MANIFEST})")
    return resume


def _report_newer_incomplete(out_dir: str, newest):
    """One line when a checkpoint newer than the one resumed from is incomplete (a crash while
    it was written, or a file lost since)."""
    root = os.path.join(out_dir, "checkpoints")
    newer = [os.path.join(root, d) for d in checkpoint_names(root)
             if newest is None or d > os.path.basename(newest)]
    if newer:
        what = f"resuming from {newest}" if newest else "starting from the beginning"
        print(f"petra_mpi: checkpoint {newer[-1]} is incomplete ({incomplete_reason(newer[-1])}): "
              f"{what}", file=sys.stderr, flush=True)


def read_manifest(path: str, identity: dict) -> dict:
    """The manifest, after checking it is of this format and was written by the same model, data
    and recipe (`identity`). Its layout is the caller's to compare."""
    with open(os.path.join(path, MANIFEST)) as f:
        manifest = json.load(f)
    manifest = {**IDENTITY_DEFAULTS, **manifest}
    if manifest.get("format") != LAYOUT_FREE:
        raise CheckpointError(f"cannot resume from {path}: its manifest is not of the checkpoint "
                              f"format this version reads (\"format\": {LAYOUT_FREE}); to start "
                              f"a new run instead, give it its own directory: --set "
                              f"run.out_dir=ANOTHER_DIR")
    wrong = [f"{k}: checkpoint has {manifest.get(k)!r}, this run has {v!r}"
             for k, v in identity.items() if manifest.get(k) != v]
    if wrong:
        raise CheckpointError(f"cannot resume from {path}: " + "; ".join(wrong) + "; the model, "
                              "the data and the training recipe must be the checkpoint's (the "
                              "stages, split, replicas, device and precision may change); to "
                              "start a new run instead, give it its own directory: --set "
                              "run.out_dir=ANOTHER_DIR")
    try:
        with open(os.path.join(path, "trainer.json")) as f:
            manifest["trainer"] = json.load(f)
    except (OSError, ValueError) as e:
        raise UnreadableCheckpoint(f"trainer.json: {e}") from e
    return manifest


def stage_device(worker) -> torch.device:
    """The device the worker's stage lives on (its first parameter's or buffer's)."""
    for t in itertools.chain(worker.stage.parameters(), worker.stage.buffers()):
        return t.device
    return torch.device("cpu")


# Training draws no CUDA random numbers today (augmentation uses numpy generators, the models have
# no dropout), so the CUDA state is kept only so that a future random op resumes exactly. It is the
# state of the rank's own GPU, not one per visible GPU: a job requeued with fewer GPUs visible per
# rank (srun --gpus-per-task=1 after a run that saw 4) must still resume.
def cuda_rng_state(device: torch.device, cuda=torch.cuda):
    """The random state of `device` when it is a GPU, else None."""
    if device.type != "cuda":
        return None
    return cuda.get_rng_state(device)


def restore_cuda_rng(saved, device: torch.device, cuda=torch.cuda):
    """Put a state saved by cuda_rng_state on this rank's GPU `device`, whatever its index among
    the GPUs visible now. Nothing for a CPU run or a checkpoint of a CPU run."""
    if saved is None or device.type != "cuda":
        return
    cuda.set_rng_state(saved.cpu(), device)


def previous_complete(path: str):
    """The newest complete checkpoint older than the checkpoint at `path`, or None."""
    out_dir = os.path.dirname(os.path.dirname(os.path.abspath(path)))
    name = os.path.basename(os.path.abspath(path))
    older = [p for p in complete_checkpoints(out_dir) if os.path.basename(p) < name]
    return older[-1] if older else None


def resume_readable(path: str, load, fallback: bool = True, world=None, read_only: bool = False):
    """load(path) on every rank of `world` (None: this process alone); while any of them finds
    a file of the checkpoint unreadable, go back to the previous complete checkpoint and load
    that, every rank alike, with one line on stderr saying which and why (`fallback` False:
    raise instead). The unreadable one is set aside, unless `read_only` (a command that only
    reads the run: export, evaluate). Returns (the checkpoint loaded, what load returned)."""
    while True:
        result, error = None, None
        try:
            result = load(path)
        except UnreadableCheckpoint as e:
            error = str(e)
        errors = [e for e in (world.allgather(error) if world else [error]) if e]
        if not errors:
            return path, result
        first = world is None or world.rank == 0
        older = previous_complete(path) if fallback and first else None
        if world:  # the directory as one rank sees it: a shared file system may lag
            older = world.bcast(older)
        if older is None:
            raise UnreadableCheckpoint(f"cannot {'read' if read_only else 'resume from'} "
                                       f"{path}: {errors[0]}" +
                                       ("; no earlier complete checkpoint" if fallback else ""))
        if first:
            what = "reading" if read_only else f"{_set_aside_saying(path)}; resuming from"
            print(f"petra_mpi: checkpoint {path} cannot be read ({errors[0]}): {what} the "
                  f"previous complete checkpoint {older}", file=sys.stderr, flush=True)
        path = older


def _set_aside_saying(path: str) -> str:
    """set_aside(path), and what became of it, in words (a rename that fails only warns: the
    other ranks go on to the next read)."""
    try:
        return f"set aside as {set_aside(path)}"
    except OSError as e:
        return f"left in place, could not be set aside ({e})"


def set_aside(path: str) -> str:
    """Rename the unreadable checkpoint at `path` out of the checkpoints (PATH.corrupt, or
    PATH.corrupt-2, ...; kept for a look): complete by its manifest, it would otherwise stay the
    newest, which prune keeps and a later resume tries first. Returns the new path."""
    aside, n = path + CORRUPT, 1
    while os.path.exists(aside):
        n += 1
        aside = f"{path}{CORRUPT}-{n}"
    os.rename(path, aside)
    fsync_dir(os.path.dirname(os.path.abspath(path)))
    return aside


def prune(out_dir: str, keep: int):
    """Delete all but the `keep` newest complete checkpoints, and any incomplete ones older than
    the newest complete one (leftovers of a crash). Call it only once the newest manifest is
    on disk (write_manifest has returned): until then the older ones are all a crash leaves."""
    complete = complete_checkpoints(out_dir)
    root = os.path.join(out_dir, "checkpoints")
    newest = complete[-1] if complete else None
    for d in checkpoint_names(root):  # a checkpoint set aside stays
        p = os.path.join(root, d)
        stale = p in complete[:-keep] or (p not in complete and newest and p < newest)
        if stale:
            shutil.rmtree(p, ignore_errors=True)
