"""GPU paths: device tensors through the MPI transport, pinned host staging, and CUDA-aware MPI
when the library supports it. These need CUDA and skip without it (this project's CI machines
have no GPU; they run on the GPU machine, see the README)."""
import os

import pytest
import torch

from test_mpi import HERE, QUICK, check_run_outputs, mpirun

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_stage_backward_on_gpu_matches_cpu():
    from petra_mpi.engine.build import build_stages
    from helpers import flat_params, make_batches, run_engine
    batches = make_batches(5, dtype=torch.float64)
    cpu = run_engine("revnet18", 4, 2, batches, lr=0.1)
    gpu_batches = [(x.cuda(), y.cuda()) for x, y in batches]
    stages = build_stages("revnet18", 4, 10, 4, seed=0, dtype=torch.float64, device="cuda")
    from petra_mpi.engine.build import build_workers
    from petra_mpi.engine.local import LocalEngine
    from petra_mpi.optim import LRSchedule
    workers = build_workers(stages, LRSchedule(0.1, 10**6), 2, weight_decay=0.0)
    LocalEngine(workers, "petra").train_segment(iter(gpu_batches), len(gpu_batches))
    for a, b in zip(flat_params(cpu), flat_params(stages)):
        torch.testing.assert_close(a, b.cpu(), rtol=1e-7, atol=1e-9)


@pytest.mark.parametrize("aware", ["0", "1"])
def test_mpi_training_on_gpu(tmp_path, aware):
    from petra_mpi.comm import cuda_aware_mpi
    if aware == "1" and not cuda_aware_mpi()[0]:
        pytest.skip("the MPI library is not CUDA-aware")
    proc = mpirun(2, ["-m", "petra_mpi.train", "configs/quickstart.yaml", "--set",
                      f"run.out_dir={tmp_path}", *QUICK, "--set", "run.device=cuda"],
                  timeout=300, env={"PETRA_MPI_CUDA_AWARE": aware})
    assert proc.returncode == 0, proc.stderr[-3000:]
    mode = "cuda-aware" if aware == "1" else "pinned-host-staging"
    assert f"transport {mode}" in proc.stderr
    check_run_outputs(tmp_path, epochs=1, stages=2)


def test_mpi_equivalence_cpu_vs_gpu_staging(tmp_path):
    """The same training on GPU ranks (staged through pinned memory) and in one GPU process."""
    env = {"PETRA_MPI_CUDA_AWARE": "0"}
    proc = mpirun(2, ["-m", "petra_mpi.train", "configs/quickstart.yaml", "--set",
                      f"run.out_dir={tmp_path / 'mpi'}", *QUICK, "--set", "run.device=cuda",
                      "--set", "model.stages=2"], timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    import subprocess
    import sys
    local = subprocess.run([sys.executable, "-m", "petra_mpi.train", "configs/quickstart.yaml",
                            "--set", f"run.out_dir={tmp_path / 'local'}", *QUICK, "--set",
                            "run.device=cuda", "--set", "model.stages=2"], capture_output=True,
                           text=True, timeout=300, cwd=HERE.parent,
                           env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert local.returncode == 0, local.stderr[-3000:]
    import json
    a = json.loads((tmp_path / "mpi" / "summary.json").read_text())
    b = json.loads((tmp_path / "local" / "summary.json").read_text())
    assert abs(a["val_loss"] - b["val_loss"]) < 1e-3


def test_gpu_jpeg_decode_is_stream_safe(tmp_path):
    """pytorch/vision#9606: nvJPEG decode on the compute stream can overwrite memory queued
    kernels still read. The side-stream decode must train stage 0 bitwise as a run that
    synchronises the whole device before every decode."""
    pytest.importorskip("torchvision.io")
    import subprocess
    import sys
    script = HERE / "gpu" / "decode_training.py"
    for sync in ("0", "1"):
        proc = subprocess.run([sys.executable, str(script), str(tmp_path / f"sync{sync}.pt"), sync],
                              capture_output=True, text=True, timeout=300, cwd=HERE.parent,
                              env={**os.environ, "OMP_NUM_THREADS": "1"})
        assert proc.returncode == 0, proc.stderr[-3000:]
    free, synced = (torch.load(tmp_path / f"sync{s}.pt") for s in ("0", "1"))
    assert len(free) == len(synced) > 0
    for a, b in zip(free, synced):
        assert torch.equal(a, b), "stage-0 parameters differ with a synchronised decode"
