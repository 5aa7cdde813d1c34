"""Issue 10, the parts that run without a GPU: device binding from the launcher's environment,
the CPU share of a rank, bf16 compute precision (invariants 3 and 4 hold in it), the batched
crop/resize of the GPU decode path (run on the CPU) and the JPEG decode pools."""
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from petra_mpi.devices import gpu_index, launcher_local_rank

HERE = Path(__file__).parent
ROOT = HERE.parent


# ---- device binding ---------------------------------------------------------------------------
@pytest.mark.parametrize("env,visible,fallback,want", [
    ({}, 0, None, None),                                         # no GPU
    ({"OMPI_COMM_WORLD_LOCAL_RANK": "3"}, 4, None, 3),           # Open MPI, shared GPUs
    ({"OMPI_COMM_WORLD_LOCAL_RANK": "5"}, 4, None, 1),           # more ranks than GPUs
    ({"MPI_LOCALRANKID": "2"}, 8, None, 2),                      # MPICH Hydra
    ({"SLURM_LOCALID": "1", "SLURM_STEP_ID": "0"}, 4, None, 1),  # srun, GPUs shared
    ({"PMI_LOCAL_RANK": "2"}, 4, None, 2),
    ({"PALS_LOCAL_RANKID": "1"}, 4, None, 1),
    ({"PMIX_LOCAL_RANK": "3"}, 4, None, 3),
    ({"MV2_COMM_WORLD_LOCAL_RANK": "1"}, 2, None, 1),
    # one visible GPU (srun --gpus-per-task=1, or a per-task CUDA_VISIBLE_DEVICES): index 0
    ({"SLURM_LOCALID": "3", "SLURM_STEP_ID": "0", "SLURM_GPUS_PER_TASK": "1"}, 1, None, 0),
    ({"OMPI_COMM_WORLD_LOCAL_RANK": "3", "CUDA_VISIBLE_DEVICES": "3"}, 1, None, 0),
    # srun --gpus-per-task=2: the task's own two GPUs
    ({"SLURM_LOCALID": "3", "SLURM_STEP_ID": "0", "SLURM_GPUS_PER_TASK": "2"}, 2, None, 0),
    # ...but not in the batch step (id near 2**32), where the tasks' GPUs are not bound
    ({"SLURM_LOCALID": "1", "SLURM_STEP_ID": "4294967294", "SLURM_GPUS_PER_TASK": "2"}, 2,
     None, 1),
    # mpirun inside sbatch: the MPI launcher's local rank wins over the batch step's SLURM_LOCALID
    ({"SLURM_LOCALID": "0", "OMPI_COMM_WORLD_LOCAL_RANK": "2"}, 4, None, 2),
    ({"SLURM_LOCALID": "0", "MPI_LOCALRANKID": "3"}, 4, None, 3),
    # no launcher variable: MPI's node-local rank once known, else undecided with several GPUs
    ({}, 4, 2, 2),
    ({}, 4, None, None),
    ({}, 1, None, 0),
    ({"OMPI_COMM_WORLD_LOCAL_RANK": "junk"}, 4, 1, 1),
])
def test_gpu_index_from_launcher_environment(env, visible, fallback, want):
    assert gpu_index(env, visible, fallback) == want


def test_launcher_local_rank_names_its_source():
    assert launcher_local_rank({}) is None
    assert launcher_local_rank({"MPI_LOCALRANKID": "4"}) == (4, "MPI_LOCALRANKID")
    assert launcher_local_rank({"SLURM_LOCALID": "1", "OMPI_COMM_WORLD_LOCAL_RANK": "0"}) == \
        (0, "OMPI_COMM_WORLD_LOCAL_RANK")


def test_pick_device_cpu_and_bind_early_cpu():
    from petra_mpi.config import Config
    from petra_mpi.devices import bind_early
    from petra_mpi.train import pick_device
    cfg = Config()
    cfg.run.device = "cpu"
    assert pick_device(cfg, 3) == torch.device("cpu")
    assert bind_early("cpu", {"OMPI_COMM_WORLD_LOCAL_RANK": "1"}) is None


@pytest.mark.parametrize("mine,node,want", [
    ({0, 1, 2, 3}, [{0, 1, 2, 3}] * 4, 1),                 # unbound mpirun: shared, divided
    ({0, 1, 2, 3, 4, 5, 6, 7}, [set(range(8))] * 2, 4),
    ({0, 1}, [{0, 1}, {2, 3}, {4, 5}], 2),                 # srun --cpus-per-task=2: own set
    ({5}, [{4}, {5}, {6}], 1),                             # bound to a core each
    ({0, 1, 2, 3}, [{0, 1, 2, 3}, {0, 1, 2, 3}, {4, 5, 6, 7}], 2),  # two share one set
])
def test_cpu_share(mine, node, want):
    from petra_mpi.engine.world import cpu_share
    assert cpu_share(mine, node) == want


# ---- bf16 --------------------------------------------------------------------------------------
def test_precision_config_key():
    from petra_mpi.config import ConfigError, load_config
    cfg = load_config(ROOT / "configs/quickstart.yaml", ["run.precision=bf16"])
    assert cfg.run.precision == "bf16"
    with pytest.raises(ConfigError, match="run.precision"):
        load_config(ROOT / "configs/quickstart.yaml", ["run.precision=fp16"])
    with pytest.raises(ConfigError, match="run.precision"):
        load_config(ROOT / "configs/quickstart.yaml", ["run.precision=bf16", "run.dtype=float64"])


@pytest.mark.parametrize("arch", ["revnet18", "revnet50"])
def test_invariant4_rebuild_in_bf16(arch):
    """F runs in bfloat16 but the streams stay float32: the rebuild cancels F exactly up to
    float32 rounding, as tests/test_invariants.py asks of fp32 (< 1e-5 relative)."""
    from petra_mpi.models import build_blocks, set_precision
    from petra_mpi.stages import Stage
    torch.manual_seed(0)
    blocks = build_blocks(arch, 8, 10)
    set_precision(blocks, "bf16")
    for block in [b for b in blocks if b.reversible][:3]:
        x = torch.randn(4, block.branch[0][0].in_channels * 2, 8, 8)
        stage = Stage([block], 1, 3)
        y = stage(x)
        assert y.dtype == torch.float32
        rebuilt, grad = stage.backward(y, torch.randn_like(y))
        assert rebuilt.dtype == grad.dtype == torch.float32
        assert ((rebuilt - x).norm() / x.norm()).item() < 1e-5
        assert all(p.grad is not None and p.grad.dtype == torch.float32
                   for p in block.parameters())


def test_invariant4_rebuild_in_bf16_revvit():
    """The same for the reversible ViT: Attn and MLP in bfloat16, token streams float32."""
    from petra_mpi.models import build_blocks, set_precision
    from petra_mpi.stages import Stage
    torch.manual_seed(0)
    blocks = build_blocks("revvit", 32, 10, depth=3, heads=2)
    set_precision(blocks, "bf16")
    block = blocks[1]
    x = torch.randn(4, 16, 64)
    stage = Stage([block], 1, 3)
    y = stage(x)
    assert y.dtype == torch.float32
    rebuilt, grad = stage.backward(y, torch.randn_like(y))
    assert rebuilt.dtype == grad.dtype == torch.float32
    assert ((rebuilt - x).norm() / x.norm()).item() < 1e-5
    set_precision([block], "fp32")
    with torch.no_grad():
        rel = ((block(x) - y).norm() / y.norm()).item()
    assert 1e-5 < rel < 5e-2, rel  # bf16 really ran: the output differs from fp32's


def test_bf16_really_computes_in_bf16():
    from petra_mpi.models import build_blocks, set_precision
    torch.manual_seed(0)
    block = next(b for b in build_blocks("revnet18", 8, 10) if b.reversible)
    x1 = torch.randn(4, 8, 8, 8)
    with torch.no_grad():
        full = block.f(x1)
        set_precision([block], "bf16")
        half = block.f(x1)
    rel = ((half - full).norm() / full.norm()).item()
    assert half.dtype == torch.float32 and 1e-4 < rel < 5e-2, rel


def test_diagnostics_rebuild_error_in_bf16():
    """The per-stage rebuild error the diagnostics report is float32 rounding in bf16 mode when
    the weights do not change (lr = 0)."""
    from petra_mpi.diagnostics import Diagnostics
    from petra_mpi.engine.build import build_stages, build_workers
    from petra_mpi.engine.local import LocalEngine
    from petra_mpi.optim import LRSchedule
    stages = build_stages("revnet18", 4, 10, 10, seed=0, precision="bf16")
    workers = build_workers(stages, LRSchedule(0.0, 10), 1)
    records = []
    engine = Diagnostics(LocalEngine(workers, "petra"), 1, emit=records.append)
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randn(4, 3, 16, 16, generator=g), torch.randint(0, 10, (4,), generator=g))
               for _ in range(3)]
    engine.train_segment(iter(batches), 3)
    errors = [r["rebuild_error"] for r in records if r["rebuild_error"] is not None]
    assert errors and max(errors) < 1e-5, records
    assert all(r["cos_petra_e2e"] > 0.99 for r in records if r["cos_petra_e2e"] is not None)


def _local_reference(J, method, k, n, precision):
    sys.path.insert(0, str(HERE / "mpi"))
    from equivalence import batches
    from petra_mpi.engine.build import build_stages, build_workers
    from petra_mpi.engine.local import LocalEngine
    from petra_mpi.optim import LRSchedule
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    try:
        stages = build_stages("revnet18", 4, 10, J, seed=0, precision=precision)
        workers = build_workers(stages, LRSchedule(0.3, 4, warmup_epochs=1, milestones=(2,)), k,
                                weight_decay=5e-4)
        engine = LocalEngine(workers, method)
        engine.train_segment(batches(n), n)
        engine.train_segment(batches(n, seed=2), n)
        totals = engine.evaluate(batches(3, seed=3), 3)
    finally:
        torch.use_deterministic_algorithms(False)
    return stages, totals.result()


def test_invariant3_mpi_equals_local_bitwise_in_bf16(tmp_path):
    J, method, k, n = 3, "petra", 2, 6
    cmd = ["mpirun", "-n", str(J), sys.executable, str(HERE / "mpi" / "equivalence_precision.py"),
           "bf16", str(tmp_path), method, str(k), str(n)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    stages, ref_eval = _local_reference(J, method, k, n, "bf16")
    fp32, _ = _local_reference(J, method, k, n, "fp32")
    for r in range(J):
        got = torch.load(tmp_path / f"rank{r}.pt")
        want = [p.detach() for p in stages[r].parameters()] + list(stages[r].buffers())
        for g, w in zip(got["params"] + got["buffers"], want):
            assert torch.equal(g, w), f"rank {r} differs from the local engine in bf16"
    assert torch.load(tmp_path / f"rank{J - 1}.pt")["eval"] == ref_eval
    # and bf16 is a different computation from fp32 (the test has teeth)
    assert any(not torch.equal(a, b) for a, b in zip(stages[0].parameters(), fp32[0].parameters()))


# ---- JPEG decode -------------------------------------------------------------------------------
def _jpegs(n=6, seed=0):
    rng = np.random.default_rng(seed)
    blobs = []
    for i in range(n):
        h, w = (48, 64) if i % 2 else (64, 40)
        img = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
        buf = io.BytesIO()
        Image.fromarray(img).save(buf, format="JPEG", quality=90)
        blobs.append(buf.getvalue())
    return blobs


def test_crop_resize_batch_matches_per_image_interpolate():
    import torch.nn.functional as F
    from petra_mpi.data.augment import crop_resize_batch
    g = torch.Generator().manual_seed(0)
    images = [torch.randint(0, 256, (3, h, w), dtype=torch.uint8, generator=g)
              for h, w in [(40, 50), (40, 50), (33, 60), (40, 50), (24, 24)]]
    boxes = [(3, 2, 30, 20), (0, 0, 30, 20), (5, 1, 17, 31), (10, 10, 24, 24), (0, 0, 24, 24)]
    out = crop_resize_batch(images, boxes, 24)
    assert out.shape == (5, 3, 24, 24) and out.dtype == torch.uint8
    for k, (im, (left, top, w, h)) in enumerate(zip(images, boxes)):
        patch = im[:, top:top + h, left:left + w]
        if (w, h) != (24, 24):
            patch = F.interpolate(patch[None].float(), size=(24, 24), mode="bilinear",
                                  align_corners=False, antialias=True)[0].round_().clamp_(0, 255)
        assert torch.equal(out[k], patch.to(torch.uint8)), k


@pytest.mark.parametrize("train", [True, False])
def test_decode_pools_agree(train):
    from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
    import multiprocessing
    from petra_mpi.data import augment as A
    blobs = _jpegs(7)
    uniforms = A.rrc_uniforms(np.random.default_rng(1), len(blobs))[1] if train else None
    serial = A.decode_crop_batch_pil(blobs, 32, 40, uniforms)
    with ThreadPoolExecutor(2) as tp:
        threads = A.decode_crop_batch_pil(blobs, 32, 40, uniforms, tp)
    with ProcessPoolExecutor(2, mp_context=multiprocessing.get_context("forkserver")) as pp:
        procs = A.decode_crop_batch_pil(blobs, 32, 40, uniforms, pp)
    assert serial.shape == (7, 32, 32, 3)
    assert np.array_equal(serial, threads) and np.array_equal(serial, procs)


def test_decode_workers_config_key():
    from petra_mpi.config import ConfigError, load_config
    cfg = load_config(ROOT / "configs/quickstart.yaml", ["data.decode_workers=3",
                                                         "data.decode_pool=process"])
    assert (cfg.data.decode_workers, cfg.data.decode_pool) == (3, "process")
    with pytest.raises(ConfigError, match="data.decode_pool"):
        load_config(ROOT / "configs/quickstart.yaml", ["data.decode_pool=fork"])
    with pytest.raises(ConfigError, match="data.decode_workers"):
        load_config(ROOT / "configs/quickstart.yaml", ["data.decode_workers=-1"])


# ---- bf16 learns as fp32 does -----------------------------------------------------------------
# The quickstart shortened: on a CPU without native bfloat16 (no AVX512-BF16/AMX) oneDNN emulates
# bf16 convolutions, ~8x slower than fp32, so the full quickstart (8 epochs of 3200 images) would
# take ~13 CPU-minutes in bf16. 2400 images x 7 epochs (lr step after 5) still ends well above
# 0.9 in fp32 (measured: fp32 0.970 in 46 CPU-s, bf16 0.962 in 515 CPU-s), so the criterion of
# tests/test_accuracy.py (>= 0.9, within 2 points) keeps its teeth; 1000 validation images keep
# the 2-point comparison above sampling noise (with 500 and 6 epochs: 0.974 vs 0.950).
SHORT = ["--set", "data.synthetic_train=2400", "--set", "data.synthetic_val=1000", "--set",
         "train.epochs=7", "--set", "optim.milestones=[5]", "--set", "run.threads=1", "--set",
         "run.progress=false"]


def test_bf16_learns_as_fp32(tmp_path):
    procs = {}
    for precision in ("fp32", "bf16"):
        cmd = [sys.executable, "-m", "petra_mpi.train", "configs/quickstart.yaml", "--set",
               f"run.out_dir={tmp_path / precision}", "--set", f"run.precision={precision}", *SHORT]
        procs[precision] = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE,
                                            stderr=subprocess.STDOUT, text=True,
                                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    acc = {}
    for precision, proc in procs.items():
        out, _ = proc.communicate(timeout=1800)
        assert proc.returncode == 0, out[-3000:]
        summary = json.loads((tmp_path / precision / "summary.json").read_text())
        acc[precision] = summary["val_acc"]
    assert acc["fp32"] >= 0.9 and acc["bf16"] >= 0.9, acc
    assert abs(acc["bf16"] - acc["fp32"]) <= 0.02, acc
