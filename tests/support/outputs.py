"""Checks of what a run or a plot wrote."""
import json
import os


def check_run_outputs(out_dir, epochs, stages):
    """The output contract of a finished run: metrics.jsonl lines and summary.json."""
    records = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["event"] == "train"]
    evals = [r for r in records if r["event"] == "eval"]
    assert train and len(evals) == epochs
    for r in train:
        assert {"step", "epoch", "loss", "lr", "images_per_s"} <= r.keys()
        assert r["loss"] > 0 and r["images_per_s"] > 0
    for r in evals:
        assert {"epoch", "step", "val_loss", "val_acc"} <= r.keys() and 0 <= r["val_acc"] <= 1
    summary = json.loads((out_dir / "summary.json").read_text())
    assert summary["epochs"] == epochs and summary["stages"] == stages
    assert summary["val_acc"] == evals[-1]["val_acc"]
    assert summary["best_val_acc"] == max(r["val_acc"] for r in evals)
    assert len(summary["memory"]) == stages
    assert all(m["param_bytes"] > 0 for m in summary["memory"])
    return summary


def check_png(path):
    """A real picture: PNG signature, more than a blank canvas's bytes, decodes, not one colour."""
    from PIL import Image

    assert os.path.isfile(path), f"{path} not written"
    with open(path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n", path
    assert os.path.getsize(path) > 5000, path
    with Image.open(path) as img:
        img.load()
        extrema = img.convert("RGB").getextrema()
    assert any(lo != hi for lo, hi in extrema), f"{path} is a single colour"


def printed_rank_map(hosts) -> str:
    """The rank map that rank 0 of a run prints at start-up (comm/devices.rank_map, through
    World.map_ranks) for one rank on each of `hosts`, lines ending in a newline; map_ranks'
    allgather answered by a stand-in for the transport's group, as those ranks would."""
    import torch
    from petra_mpi.comm.devices import rank_map
    from petra_mpi.comm.world import World

    class Gathered:
        def allgather(self, mine):
            return [(host, *mine[1:]) for host in hosts]

    world = World.__new__(World)
    world._group, world.rank, world.local_rank = Gathered(), 0, 0
    world.stages, world.replicas = len(hosts), 1
    return rank_map(world, torch.device("cpu")) + "\n"
