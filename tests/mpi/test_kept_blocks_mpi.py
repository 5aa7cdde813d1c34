"""Kept blocks under mpirun (docs/design.md §1, invariants 3 and 7): the MPI engine follows the
local one bitwise for a mixed plan and for a plan whose stages' last blocks keep everything (where
no rebuilt input is sent); a measured run under a budget trains its plan and resumes it."""
import json

import pytest
import torch

from petra_mpi.core.schedule import PetraSchedule
from petra_mpi.engines.build import build_workers
from tests.support.nets import stages_of
from petra_mpi.engines.local import LocalEngine
from petra_mpi.run.checkpoint import complete_checkpoints
from tests.support.launch import mpirun
from tests.support.paths import PROGRAMS, QUICK


def local_run(plan, n, k):
    """The program's training (tests/programs/kept_equivalence.py) with the local engine."""
    from kept_equivalence import ARCH, SIDE, batches, schedule
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    try:
        stages = stages_of(ARCH, 4, 10, 3, seed=0, image_size=SIDE)
        for s in stages:
            s.set_kept(plan(s))
        engine = LocalEngine(build_workers(stages, schedule(), k, weight_decay=5e-4), "petra")
        engine.train_segment(batches(n), n)
        engine.train_segment(batches(n, seed=2), n)
    finally:
        torch.use_deterministic_algorithms(False)
    return stages


def flat(stages):
    return torch.cat([t.detach().flatten() for s in stages for t in (*s.parameters(),
                                                                      *s.buffers())
                      if t.is_floating_point()])


@pytest.mark.extended  # mpirun -n 3, two plans
def test_mpi_equals_local_bitwise_and_sends_no_unused_rebuilt_input(tmp_path):
    """Both plans under mpirun -n 3, bitwise the local engine's. The mixed plan keeps some of
    every stage's micro-batches, and its successors send the rebuilt input; where a stage's last
    block keeps all its micro-batches it starts every backward from the graph, and its successor
    sends no rebuilt input (no stream, no bytes) while training the same."""
    from kept_equivalence import PLANS
    n, k = 6, 2
    proc = mpirun(3, [PROGRAMS / "kept_equivalence.py", tmp_path, n, k], timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    petra = flat(local_run(lambda s: None, n, k))
    got = {}
    for name, plan in PLANS.items():
        stages = local_run(plan, n, k)
        assert (flat(stages) - petra).abs().max() > 1e-6  # the plan changes what it learns
        for r, stage in enumerate(stages):
            got[name, r] = torch.load(tmp_path / f"{name}-rank{r}.pt")
            assert got[name, r]["kept"] == stage.kept
            assert got[name, r]["peak_kept_bytes"] == stage.peak_kept_bytes
            want = [*stage.parameters(), *stage.buffers()]
            assert len(got[name, r]["params"]) + len(got[name, r]["buffers"]) == len(want)
            for g, w in zip(got[name, r]["params"] + got[name, r]["buffers"], want):
                assert torch.equal(g, w), f"{name}: rank {r} differs from the local engine"
    assert [got["mixed", r]["kept"] for r in range(3)] == [[0, 1], [1, 2, 0], [0] * 5]
    assert [got["last_keeps_all", r]["kept"] for r in range(3)] == [[0, 4], [1, 2, 2], [0] * 5]
    for r in (1, 2):  # what rank r sends rank r - 1 with each gradient
        mixed, kept = got["mixed", r]["streams"], got["last_keeps_all", r]["streams"]
        assert mixed["rebuilt out"] == mixed["gradient out"] > 0
        assert "rebuilt out" not in kept and kept["gradient out"] == mixed["gradient out"]
        assert "rebuilt in" not in got["last_keeps_all", r - 1]["streams"]


@pytest.mark.extended  # mpirun -n 3, two short runs
def test_a_measured_run_with_a_budget_trains_its_plan_and_resumes_it(tmp_path):
    """model.balance: measure under a budget (layout.choose_layout): rank 0 times the
    blocks, redoes the balance with the plan in measured units and sends split and plan to
    every rank; the manifest records the plan with the budget, and a run resumed under that
    budget trains that plan again (a second timing could come out otherwise)."""
    args = ["-m", "petra_mpi.train", "configs/quickstart.yaml", *QUICK,
            "--set", f"run.out_dir={tmp_path}", "--set", "model.balance=measure",
            "--set", "model.memory_budget=auto", "--set", "run.threads=1"]
    first = mpirun(3, args, timeout=300)
    assert first.returncode == 0, first.stderr[-3000:]
    assert "stages balanced by measured cost" in first.stderr

    def last_manifest():
        last = complete_checkpoints(str(tmp_path))[-1]
        with open(f"{last}/manifest.json") as f:
            return last, json.load(f)
    first_ckpt, manifest = last_manifest()
    split, kept = manifest["partition"], manifest["kept"]
    assert sum(split) == 10 and [len(k) for k in kept] == split
    assert manifest["memory_budget"] == "auto"
    # at most d_s of every d_s micro-batches, nothing in the last stage (whether a block keeps
    # depends on the timings: a stage that is not the slowest keeps nothing)
    assert all(0 <= k <= PetraSchedule(3).in_flight(s) for s, ks in enumerate(kept) for k in ks)
    assert not any(kept[-1])
    # resumed with the checkpoint's split and plan, not a new measurement
    again = mpirun(3, args + ["--set", "train.epochs=2", "--set", "run.resume=auto"],
                   timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "stages balanced by measured cost" not in again.stderr
    last_ckpt, resumed = last_manifest()
    assert last_ckpt != first_ckpt  # written by the resumed run
    assert (resumed["partition"], resumed["kept"]) == (split, kept)
