"""The MPI engine under real mpirun: invariant 3 (same parameters as the single-process engine,
bitwise on CPU), faults that must end every rank, and bad world sizes."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from petra_mpi.engine.build import build_stages, build_workers
from petra_mpi.engine.local import LocalEngine
from petra_mpi.optim import LRSchedule

HERE = Path(__file__).parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE / "mpi"))
from equivalence import batches  # noqa: E402


def mpirun(n, args, timeout=180, env=None):
    """Launch for real; a hang fails the test through the timeout instead of freezing CI."""
    cmd = ["mpirun", "-n", str(n), sys.executable] + [str(a) for a in args]
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                          env=full_env)


def local_reference(J, method, k, n, **flags):
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    try:
        stages = build_stages("revnet18", 4, 10, J, seed=0, **flags)
        workers = build_workers(stages, LRSchedule(0.3, 4, warmup_epochs=1, milestones=(2,)), k,
                                weight_decay=5e-4)
        engine = LocalEngine(workers, method)
        engine.train_segment(batches(n), n)
        engine.train_segment(batches(n, seed=2), n)
        totals = engine.evaluate(batches(3, seed=3), 3)
    finally:
        torch.use_deterministic_algorithms(False)
    return stages, totals.result()


@pytest.mark.parametrize("J,method,k,flags", [
    (2, "petra", 1, ()), (3, "petra", 2, ()), (4, "petra", 1, ()), (4, "petra", 2, ()),
    (2, "backprop", 1, ()), (3, "backprop", 2, ()), (4, "backprop", 1, ()),
    (3, "delayed", 1, ("buffer", "stash")), (4, "delayed", 2, ("stash",)),
    (2, "delayed", 2, ("buffer",)),
])
def test_invariant3_mpi_equals_local_bitwise(tmp_path, J, method, k, flags):
    n = 6
    proc = mpirun(J, [HERE / "mpi" / "equivalence.py", tmp_path, method, k, n, *flags])
    assert proc.returncode == 0, proc.stderr[-3000:]
    stages, ref_eval = local_reference(J, method, k, n, buffer_inputs="buffer" in flags,
                                       stash_weights="stash" in flags)
    initial = build_stages("revnet18", 4, 10, J, seed=0)
    moved = 0.0
    for r in range(J):
        got = torch.load(tmp_path / f"rank{r}.pt")
        want_p = [p.detach() for p in stages[r].parameters()]
        want_b = list(stages[r].buffers())
        assert len(got["params"]) == len(want_p) and len(got["buffers"]) == len(want_b)
        for g, w in zip(got["params"] + got["buffers"], want_p + want_b):
            assert torch.equal(g, w), f"rank {r} differs from the local engine"
        moved = max(moved, max((p - q).abs().max().item() for p, q in
                               zip(want_p, initial[r].parameters())))
    assert moved > 1e-3  # it trained
    last = torch.load(tmp_path / f"rank{J - 1}.pt")["eval"]
    assert last == ref_eval
