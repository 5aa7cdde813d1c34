"""model.compile: every block's sub-modules through torch.compile (inductor's C++ on this CPU).
Compiled training equals eager training to rounding (not bitwise: fused kernels sum in another
order), and nothing is compiled again once every graph has run."""
import pytest
import torch
from torch._dynamo.utils import counters

from petra_mpi.config import load_config
from petra_mpi.core.optim import LRSchedule
from petra_mpi.core.planner import Layout
from petra_mpi.engines.build import StageSpec, build_stages, build_workers
from petra_mpi.engines.local import LocalEngine
from petra_mpi.models import NetSpec
from tests.support.nets import make_batches
from tests.support.paths import ROOT

# compiling a small RevNet18's graphs takes a minute or more on 2 cores
pytestmark = pytest.mark.extended


def train(compiled, segments, kept=None):
    """PETRA on RevNet18 width 4 in 2 stages ([4, 6]), float64, k = 2, lr 0.05, stage 0 keeping
    the graphs of `kept` per block, trained for `segments` (lists of batches); returns the
    stages and dynamo's count of graphs after each segment."""
    net = NetSpec("revnet18", 4, 10, compile=compiled)
    stages = build_stages(StageSpec(net, dtype=torch.float64),
                          Layout([4, 6], kept=[kept or [0] * 4, [0] * 6]))
    workers = build_workers(stages, LRSchedule(0.05, 10**6), 2)
    engine = LocalEngine(workers, "petra")
    graphs = []
    for batches in segments:
        engine.train_segment(iter(batches), len(batches))
        graphs.append(counters["stats"]["unique_graphs"])
    return stages, graphs


def test_compiled_training_equals_eager_to_rounding_and_compiles_once():
    torch._dynamo.reset()
    counters.clear()
    segments = [make_batches(6, batch=4, size=32, seed=s) for s in (1, 2)]
    # block 1 keeps one of stage 0's two in-flight micro-batches: its kept forward runs the
    # compiled branch under autograd with stashed weights, the other rebuilds
    kept = [0, 1, 0, 0]
    eager, none = train(False, segments, kept)
    assert none == [0, 0]
    compiled, graphs = train(True, segments, kept)
    # the branches did run compiled: a graph per shape and mode (no grad, rebuild, kept forward)
    assert graphs[0] >= 5
    # the second segment runs the same shapes and modes: nothing compiled again per tick
    assert graphs[1] == graphs[0]
    # float64: inductor's fused kernels (batch norm's sums, the adds) round in another order,
    # about 1e-16 relative per operation; over 12 micro-batches and 6 updates the parameters
    # and batch-norm statistics stay within 1e-10 of eager training, while one update more or
    # less, or a rebuild from the wrong weights, moves them by 1e-3 or more
    for a, b in zip(eager, compiled):
        for (name, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items()):
            if x.is_floating_point():
                assert torch.allclose(x, y, rtol=1e-10, atol=1e-12), name
            else:
                assert torch.equal(x, y), name
    # and training moved them: the comparison is not of untouched weights
    fresh = build_stages(StageSpec(NetSpec("revnet18", 4, 10), dtype=torch.float64),
                         Layout([4, 6]))
    moved = [(p - q).abs().max().item() for s, f in zip(eager, fresh)
             for p, q in zip(s.parameters(), f.parameters())]
    assert max(moved) > 1e-3


def test_model_compile_reaches_the_net():
    cfg = load_config(ROOT / "configs/quickstart.yaml", ["model.compile=true"])
    assert NetSpec.of_config(cfg, 32).compile
    blocks = NetSpec.of_config(cfg, 32).blocks()
    assert all(b.compiled == {} for b in blocks)
    assert NetSpec.of_config(load_config(ROOT / "configs/quickstart.yaml"), 32).blocks()[0] \
        .compiled is None
