"""Checkpoints: taken at a drain point (no micro-batch in flight), one file per stage written
atomically by the process that owns the stage, then a manifest that marks the checkpoint complete.

Layout: out_dir/checkpoints/ckpt-e{epoch:05d}-b{position:08d}/ with stage{s}.pt, trainer.json and
manifest.json. A directory without a manifest, or whose files do not match it, is never picked.
"""
import itertools
import json
import os
import shutil

import torch

from .metrics import write_json_atomic

MANIFEST = "manifest.json"
# Identity keys added after the first checkpoints were written, with the value those runs had.
IDENTITY_DEFAULTS = {"optimizer": "sgd", "lr_schedule": "step", "replicas": 1}


class CheckpointError(RuntimeError):
    pass


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


def save_stage(path: str, worker) -> tuple[str, int]:
    """Write one stage's state (weights, batch-norm statistics, optimizer, RNG) atomically;
    returns (file name, size) for the manifest."""
    os.makedirs(path, exist_ok=True)
    state = {"stage": worker.stage.state_dict(), "optimizer": worker.optimizer.state_dict(),
             "rng": torch.get_rng_state(), "cuda_rng": cuda_rng_state(stage_device(worker))}
    final = os.path.join(path, f"stage{worker.index}.pt")
    tmp = f"{final}.tmp-{os.getpid()}"
    torch.save(state, tmp)
    os.replace(tmp, final)
    return os.path.basename(final), os.path.getsize(final)


def write_manifest(path: str, identity: dict, trainer_state: dict, stage_files: dict):
    """Called once every stage file exists, with their sizes as their writers saw them (a shared
    file system may not show another node's file size yet): marks the checkpoint complete."""
    write_json_atomic(os.path.join(path, "trainer.json"), trainer_state)
    files = dict(stage_files)
    files["trainer.json"] = os.path.getsize(os.path.join(path, "trainer.json"))
    write_json_atomic(os.path.join(path, MANIFEST), {**identity, "files": files,
                                                     "epoch": trainer_state["epoch"],
                                                     "position": trainer_state["position"]})


def is_complete(path: str) -> bool:
    try:
        with open(os.path.join(path, MANIFEST)) as f:
            manifest = json.load(f)
        return all(os.path.getsize(os.path.join(path, name)) == size
                   for name, size in manifest["files"].items())
    except (OSError, ValueError, KeyError, TypeError):
        return False


def complete_checkpoints(out_dir: str) -> list[str]:
    """Complete checkpoints, oldest first."""
    root = os.path.join(out_dir, "checkpoints")
    if not os.path.isdir(root):
        return []
    paths = [os.path.join(root, d) for d in sorted(os.listdir(root)) if d.startswith("ckpt-")]
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
        return found[-1] if found else None
    if not is_complete(resume):
        raise CheckpointError(f"run.resume {resume}: not a complete checkpoint (no valid "
                              f"{MANIFEST})")
    return resume


def read_manifest(path: str, identity: dict) -> dict:
    """The manifest, after checking it was written by the same model, split and method."""
    with open(os.path.join(path, MANIFEST)) as f:
        manifest = json.load(f)
    manifest = {**IDENTITY_DEFAULTS, **manifest}
    if manifest["replicas"] != identity.get("replicas", 1):
        # Not remapped: each replica's share of an epoch, the steps per epoch (and with them
        # the learning-rate schedule) and the per-replica batch-norm statistics depend on R.
        raise CheckpointError(
            f"cannot resume from {path}: it was written by {manifest['replicas']} replica(s) and "
            f"this run has {identity.get('replicas', 1)}; resuming with another number of "
            f"replicas is not supported (the epoch's shares, steps per epoch and learning-rate "
            f"schedule depend on it): run with {manifest['replicas']} replica(s), i.e. mpirun -n "
            f"{manifest['replicas']} x {manifest.get('stages')}, or start a new run.out_dir")
    wrong = [f"{k}: checkpoint has {manifest.get(k)!r}, this run has {v!r}"
             for k, v in identity.items() if manifest.get(k) != v]
    if wrong:
        raise CheckpointError(f"cannot resume from {path}: " + "; ".join(wrong))
    with open(os.path.join(path, "trainer.json")) as f:
        manifest["trainer"] = json.load(f)
    return manifest


def load_stage(path: str, worker, device):
    state = torch.load(os.path.join(path, f"stage{worker.index}.pt"), map_location=device,
                       weights_only=False)
    worker.stage.load_state_dict(state["stage"])
    worker.optimizer.load_state_dict(state["optimizer"])
    torch.set_rng_state(state["rng"].cpu())  # map_location moved it to the device
    restore_cuda_rng(state.get("cuda_rng"), torch.device(device))


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
    the GPUs visible now. Nothing for a CPU run, a checkpoint of a CPU run, or a checkpoint of the
    earlier format (a list of one state per GPU visible then: which of them was this rank's is
    not recorded, and no training step drew from them)."""
    if saved is None or isinstance(saved, (list, tuple)) or device.type != "cuda":
        return
    cuda.set_rng_state(saved.cpu(), device)


def prune(out_dir: str, keep: int):
    """Delete all but the `keep` newest complete checkpoints, and any incomplete ones older than
    the newest complete one (leftovers of a crash)."""
    complete = complete_checkpoints(out_dir)
    root = os.path.join(out_dir, "checkpoints")
    newest = complete[-1] if complete else None
    for d in sorted(os.listdir(root)):
        p = os.path.join(root, d)
        stale = p in complete[:-keep] or (p not in complete and newest and p < newest)
        if stale:
            shutil.rmtree(p, ignore_errors=True)
