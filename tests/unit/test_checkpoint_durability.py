"""Checkpoints survive a crash of the node (petra_mpi/run/checkpoint.py): every file reaches the
disk before the manifest that marks the checkpoint complete, older checkpoints are pruned only
once that manifest is on disk, and a newest checkpoint that cannot be read back is passed over
for the previous complete one, with one line saying so. The trainer runs for real, in one
process; os.fsync is wrapped to watch (or fail) the writes reaching the disk."""
import errno
import json
import os
from pathlib import Path

import pytest

from petra_mpi.run.checkpoint import complete_checkpoints, is_complete
from tests.support.paths import QUICK, ROOT

# 12 micro-batches, a checkpoint every 4: ckpt b4, b8 and the end of the epoch (e1 b0)
EVERY_4 = [*QUICK, "--set", "run.checkpoint_every_microbatches=4"]


def train_here(monkeypatch, capsys, out_dir, *args):
    from petra_mpi.train import main
    monkeypatch.chdir(ROOT)
    capsys.readouterr()
    status = main(["configs/quickstart.yaml", "--set", f"run.out_dir={out_dir}", *EVERY_4,
                   *args])
    return status, capsys.readouterr().err


def checkpoints(out_dir):
    root = Path(out_dir) / "checkpoints"
    return sorted(p.name for p in root.iterdir()) if root.is_dir() else []


class WatchedFsync:
    """os.fsync that records what it flushes (the path behind the descriptor), and which
    checkpoints exist at that moment; `fail_on(path)` makes it raise there (a crash)."""

    def __init__(self, monkeypatch, out_dir, fail_on=None):
        self.out_dir, self.fail_on, self.calls = out_dir, fail_on, []
        self.real = os.fsync
        monkeypatch.setattr(os, "fsync", self)

    def __call__(self, fd):
        path = os.readlink(f"/proc/self/fd/{fd}")
        self.calls.append((path, checkpoints(self.out_dir)))
        if self.fail_on is not None and self.fail_on(path):
            raise OSError(errno.EIO, "injected: the disk failed", path)
        self.real(fd)


def test_every_file_and_rename_reaches_the_disk_before_the_older_checkpoint_goes(
        tmp_path, monkeypatch, capsys):
    fsync = WatchedFsync(monkeypatch, tmp_path)
    status, err = train_here(monkeypatch, capsys, tmp_path, "--set", "run.keep_checkpoints=1")
    assert status == 0, err[-3000:]
    assert checkpoints(tmp_path) == ["ckpt-e00001-b00000000"]
    root = str(tmp_path / "checkpoints")
    synced = [path for path, _ in fsync.calls]
    for name in ("ckpt-e00000-b00000008", "ckpt-e00001-b00000000"):
        ckpt = os.path.join(root, name)
        mine = [i for i, p in enumerate(synced) if p.startswith(ckpt + "/") or p == ckpt]
        manifest = next(i for i in mine if synced[i].startswith(f"{ckpt}/manifest.json.tmp"))
        stage_files = [i for i in mine if ".pt.tmp-" in synced[i]]
        assert stage_files and max(stage_files) < manifest, "stage file synced after the manifest"
        assert any(s < i < manifest and synced[i] == ckpt for s in stage_files for i in mine), \
            "the stage files' renames were not synced before the manifest"
        assert synced[manifest + 1] == ckpt, "the manifest's rename was not synced"
        assert synced[manifest + 2] == root, "the checkpoint's directory entry was not synced"
        # until the new manifest is on disk, the older checkpoint is still there
        previous = {"ckpt-e00000-b00000008": "ckpt-e00000-b00000004",
                    "ckpt-e00001-b00000000": "ckpt-e00000-b00000008"}[name]
        assert all(previous in present for _, present in fsync.calls[mine[0]:manifest + 3])


@pytest.mark.parametrize("failing", ["manifest file", "checkpoint directory entry"])
def test_a_crash_before_the_manifest_is_on_disk_keeps_the_older_checkpoint(
        tmp_path, monkeypatch, capsys, failing):
    """keep_checkpoints=1: the second checkpoint's manifest fails to reach the disk; the first
    checkpoint, the only complete one, must still be there to resume from."""
    second = str(tmp_path / "checkpoints" / "ckpt-e00000-b00000008")
    fails = {"manifest file": lambda p: p.startswith(f"{second}/manifest.json.tmp"),
             "checkpoint directory entry": lambda p: p == str(tmp_path / "checkpoints")
             and os.path.exists(f"{second}/manifest.json")}[failing]
    WatchedFsync(monkeypatch, tmp_path, fail_on=fails)
    with pytest.raises(OSError, match="injected"):
        train_here(monkeypatch, capsys, tmp_path, "--set", "run.keep_checkpoints=1")
    first = tmp_path / "checkpoints" / "ckpt-e00000-b00000004"
    assert is_complete(str(first)), checkpoints(tmp_path)


@pytest.mark.parametrize("damage", ["zeroed", pytest.param("truncated",
                                                             marks=pytest.mark.extended)])
def test_resume_passes_over_a_damaged_newest_checkpoint_and_says_so(tmp_path, monkeypatch,
                                                                    capsys, damage):
    """A crash can leave the newest checkpoint's file zero-filled at its full size (the rename
    reached the disk, the data did not) or short: the run resumes from the previous one."""
    status, err = train_here(monkeypatch, capsys, tmp_path)  # keeps the 2 newest
    assert status == 0, err[-3000:]
    older, newest = complete_checkpoints(str(tmp_path))
    stage_file = Path(newest) / "stage1.pt"
    size = stage_file.stat().st_size
    stage_file.write_bytes(bytes(size) if damage == "zeroed" else b"truncated")
    status, err = train_here(monkeypatch, capsys, tmp_path)  # run.resume=auto
    assert status == 0, err[-3000:]
    said = [line for line in err.splitlines() if newest in line]
    assert len(said) == 1 and "resuming from" in said[0] and older in said[0], err[-3000:]
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    (resumed,) = [r for r in records if r["event"] == "resume"]
    assert resumed["from"] == older and resumed["position"] == 8


def test_a_damaged_checkpoint_is_set_aside_and_never_kept_over_a_good_one(tmp_path, monkeypatch,
                                                                        capsys):
    """The newest checkpoint (end of the epoch) is damaged; the run resumed from the previous
    one (micro-batch 8) with run.keep_checkpoints=1 stops at its next drain. Its checkpoint
    sorts before the damaged one by name: the damaged one must be out of the way (renamed
    .corrupt), so that pruning keeps the new one, and the next run resumes from it."""
    from petra_mpi.config import load_config, validate
    from petra_mpi.engines.stopping import EXIT_REQUEUE, StopRequest
    from petra_mpi.train import run

    status, err = train_here(monkeypatch, capsys, tmp_path)  # keeps b8 and e1 b0
    assert status == 0, err[-3000:]
    older, newest = complete_checkpoints(str(tmp_path))
    stage_file = Path(newest) / "stage1.pt"
    stage_file.write_bytes(bytes(stage_file.stat().st_size))
    args = [*EVERY_4, "--set", f"run.out_dir={tmp_path}", "--set", "run.keep_checkpoints=1"]
    cfg = load_config(ROOT / "configs/quickstart.yaml", [a for a in args if a != "--set"])
    validate(cfg, 1)
    stop = StopRequest()
    stop.requested = True  # as a SIGUSR1 at start: the first drain checkpoints and stops
    assert run(cfg, None, stop=stop) == EXIT_REQUEUE
    err = capsys.readouterr().err
    (kept,) = complete_checkpoints(str(tmp_path))
    assert os.path.basename(older) < os.path.basename(kept) < os.path.basename(newest), kept
    assert checkpoints(tmp_path) == [os.path.basename(kept), "ckpt-e00001-b00000000.corrupt"]
    assert f"set aside as {newest}.corrupt; resuming from" in err, err[-3000:]
    status, err = train_here(monkeypatch, capsys, tmp_path)
    assert status == 0 and f"resumed from {kept}" in err, err[-3000:]


@pytest.mark.extended  # two runs; tests/mpi/test_hang_watchdog.py has the summary's order
def test_a_finished_run_whose_summary_was_lost_writes_it_again(tmp_path, monkeypatch, capsys):
    """summary.json comes last; a run whose writer was ended before writing it (a launcher's
    kill) is finished all the same by its checkpoints: the same command again trains nothing and
    writes the summary, with the run's history."""
    status, err = train_here(monkeypatch, capsys, tmp_path)
    assert status == 0, err[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    (tmp_path / "summary.json").unlink()
    records = (tmp_path / "metrics.jsonl").read_text()
    status, err = train_here(monkeypatch, capsys, tmp_path)
    assert status == 0 and "already finished, nothing to do" in err, err[-3000:]
    again = json.loads((tmp_path / "summary.json").read_text())
    assert again["history"] == summary["history"] and again["val_acc"] == summary["val_acc"]
    assert (tmp_path / "metrics.jsonl").read_text() == records  # nothing trained
