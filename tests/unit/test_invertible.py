"""The fully invertible RevNets (models/invertible.py): the downsampling coupling is a bijection
with an exact backward, no stage but the stem's buffers an input, and `bench memory` shows it.
The invariants of docs/design.md §1 on these nets are in test_invariants.py and
tests/mpi/test_mpi.py."""
import json

import pytest
import torch

from petra_mpi.perf.bench.memory import main as bench_memory
from tests.support.nets import stages_of
from petra_mpi.models import build_blocks, count_parameters, num_blocks
from petra_mpi.models.invertible import InvertibleDownsampleBlock, squeeze, unsqueeze
from petra_mpi.core.stages import Stage

INVERTIBLE = ["irevnet18", "irevnet34", "irevnet50"]


def downsampling_blocks(arch, width=4):
    return [b for b in build_blocks(arch, width, 10) if isinstance(b, InvertibleDownsampleBlock)]


def test_space_to_depth_is_a_permutation():
    x = torch.arange(2 * 3 * 4 * 6, dtype=torch.float64).reshape(2, 3, 4, 6)
    y = squeeze(x)
    assert y.shape == (2, 12, 2, 3)
    assert torch.equal(y.flatten().sort().values, x.flatten())  # the same entries, moved
    assert torch.equal(unsqueeze(y), x)


@pytest.mark.parametrize("arch", ["irevnet18", "irevnet50"])
def test_downsampling_is_a_bijection_rebuilt_within_1e5(arch):
    """Invariant 4 on the downsampling coupling: its input rebuilt from its output, by the block's
    inverse and by a PETRA stage's backward, to < 1e-5 in float32 with unchanged weights."""
    torch.manual_seed(0)
    blocks = downsampling_blocks(arch)
    assert len(blocks) == 3
    for block in blocks:
        c = block.branch[0][0].in_channels
        x = torch.randn(4, 2 * c, 8, 8)
        stage = Stage([block], 1, 3)
        assert stage.buffered == [False]  # rebuilt, not buffered
        y = stage(x)
        assert y.shape == (4, 8 * c, 4, 4)  # as many entries as the input: 4x the channels
        with torch.no_grad():
            assert ((block.inverse(y) - x).norm() / x.norm()).item() < 1e-5
        rebuilt, grad = stage.backward(y, torch.randn_like(y))
        assert ((rebuilt - x).norm() / x.norm()).item() < 1e-5
        assert grad.shape == x.shape


def test_downsampling_backward_equals_autograd_float64():
    """backward_from_output's input gradient and parameter gradients are autograd's through the
    forward (a wrong path of the gradient through S, or a swapped stream, is caught)."""
    torch.manual_seed(0)
    block = downsampling_blocks("irevnet18")[0].double()
    c = block.branch[0][0].in_channels
    x = torch.randn(4, 2 * c, 8, 8, dtype=torch.float64, requires_grad=True)
    y = block(x)
    g = torch.randn_like(y)
    y.backward(g)
    want_x, want_p = x.grad, [p.grad.clone() for p in block.parameters()]
    block.zero_grad()
    rebuilt, got_x = block.backward_from_output(y.detach(), g)
    torch.testing.assert_close(rebuilt, x.detach(), rtol=0, atol=1e-12)
    torch.testing.assert_close(got_x, want_x, rtol=1e-10, atol=1e-12)
    for p, w in zip(block.parameters(), want_p):
        torch.testing.assert_close(p.grad, w, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("arch", INVERTIBLE)
@pytest.mark.parametrize("imagenet", [False, True])
def test_only_the_stem_buffers(arch, imagenet):
    """In the paper's split (one stage per block) the stem is the only buffered block outside the
    last stage, and every shape works out to the logits."""
    J = num_blocks(arch)
    stages = stages_of(arch, 4, 7, J, imagenet_stem=imagenet, image_size=64)
    assert [s.buffered for s in stages] == [[True]] + [[False]] * (J - 2) + [[True]]
    x = torch.randn(2, 3, 64, 64)
    for s in stages:
        x = s.eval()(x)
    assert x.shape == (2, 7)


def test_stream_widths_grow_4x_and_parameter_counts():
    """Each downsampling keeps the entries: the stream width grows 4x per layer; at width 64 the
    bottleneck net stays within 12 % of RevNet50's parameters (see docs/design.md)."""
    widths = [b.branch[-1][0].out_channels for b in build_blocks("irevnet18", 8, 10)[1:-1]]
    assert widths == [8, 8, 32, 32, 128, 128, 512, 512]
    n = count_parameters(build_blocks("irevnet50", 64, 1000, imagenet_stem=True))
    assert 30.4e6 < n < 1.12 * 30.4e6


def memory_record(arch, capsys, width):
    bench_memory(["--arch", arch, "--width", str(width)])
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


@pytest.mark.parametrize("width", [16, pytest.param(64, marks=pytest.mark.extended)])
def test_bench_memory_invertible_saves_90_percent(capsys, width):
    """ImageNet, batch 64, 18 stages: PETRA on irevnet50 keeps < 10 % of what buffering every
    input and stashing the weights keeps; only stage 0 (the data) has an input buffer, whereas
    RevNet50's downsampling stages have one (the test has teeth)."""
    inv = memory_record("irevnet50", capsys, width)
    assert inv["petra_saving_percent"] >= 90
    assert [s["input_fifo_bytes"] > 0 for s in inv["stages"]] == [True] + [False] * 17
    assert all(s["buffered_input_fifo_bytes"] > 0 for s in inv["stages"][:-1])
    rev = memory_record("revnet50", capsys, width)
    buffered = [s["stage"] for s in rev["stages"] if s["input_fifo_bytes"] > 0]
    assert buffered == [0, 1, 4, 8, 14]  # the stem and RevNet50's four transitions
    assert rev["petra_saving_percent"] < inv["petra_saving_percent"]
