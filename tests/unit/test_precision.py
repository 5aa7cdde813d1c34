"""run.precision: bf16 inside the blocks, float32 between them (invariant 4 in bf16; invariant 3
in bf16 is in tests/mpi/test_mpi.py, learning in bf16 in tests/e2e/test_accuracy.py)."""
import pytest
import torch

from tests.support.paths import ROOT


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
    float32 rounding, as tests/unit/test_invariants.py asks of fp32 (< 1e-5 relative)."""
    from petra_mpi.models import build_blocks, set_precision
    torch.manual_seed(0)
    blocks = build_blocks(arch, 8, 10)
    set_precision(blocks, "bf16")
    for block in [b for b in blocks if b.reversible][:3]:
        assert_bf16_rebuild(block, torch.randn(4, block.branch[0][0].in_channels * 2, 8, 8))


def assert_bf16_rebuild(block, x):
    """One middle stage of `block` (set to bf16): float32 output, rebuild and gradients, and the
    rebuild within 1e-5 of x. Returns the forward's output."""
    from petra_mpi.core.stages import Stage
    stage = Stage([block], 1, 3)
    y = stage(x)
    assert y.dtype == torch.float32
    rebuilt, grad = stage.backward(y, torch.randn_like(y))
    assert rebuilt.dtype == grad.dtype == torch.float32
    assert ((rebuilt - x).norm() / x.norm()).item() < 1e-5
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in block.parameters())
    return y


def test_invariant4_rebuild_in_bf16_revvit():
    """The same for the reversible ViT: Attn and MLP in bfloat16, token streams float32."""
    from petra_mpi.models import build_blocks, set_precision
    torch.manual_seed(0)
    blocks = build_blocks("revvit", 32, 10, depth=3, heads=2)
    set_precision(blocks, "bf16")
    block, x = blocks[1], torch.randn(4, 16, 64)
    y = assert_bf16_rebuild(block, x)
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
    from petra_mpi.run.diagnostics import Diagnostics
    from petra_mpi.engines.build import build_workers
    from tests.support.nets import stages_of
    from petra_mpi.engines.local import LocalEngine
    from petra_mpi.core.optim import LRSchedule
    stages = stages_of("revnet18", 4, 10, 10, seed=0, precision="bf16")
    records = []
    diagnostics = Diagnostics(1, 1, emit=records.append)
    engine = LocalEngine(build_workers(stages, LRSchedule(0.0, 10), 1, hooks=[diagnostics]),
                         "petra")
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randn(4, 3, 16, 16, generator=g), torch.randint(0, 10, (4,), generator=g))
               for _ in range(3)]
    engine.train_segment(iter(batches), 3)
    errors = [r["rebuild_error"] for r in records if r["rebuild_error"] is not None]
    assert errors and max(errors) < 1e-5, records
    assert all(r["cos_petra_e2e"] > 0.99 for r in records if r["cos_petra_e2e"] is not None)
