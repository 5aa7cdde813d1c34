"""docs/design.md §1 invariants 1, 2, 4 and 5 on small nets, several stage counts, with and without
accumulation."""

import pytest
import torch
import torch.nn.functional as F

from tests.support.nets import (applied_gradients, end_to_end_gradients, flat_params, in_flight,
                                make_batches, max_relative_error, run_engine, stages_of)
from petra_mpi.models import build_blocks, frozen_bn_stats, num_blocks
from petra_mpi.core.optim import LRSchedule, StageOptimizer
from petra_mpi.core.stages import Stage


@pytest.mark.parametrize("arch", ["revnet18", "resnet18", "irevnet18"])
@pytest.mark.parametrize("J", [1, 2, 4, 10])
@pytest.mark.parametrize("k", [1, 3])
def test_invariant1_lr0_gradient_equals_end_to_end_float64(arch, J, k):
    batches = make_batches(7)
    got, stages = applied_gradients(arch, J, k, batches)
    want = end_to_end_gradients(arch, k, batches)
    assert len(got) == len(want)
    # irevnet18: its head's batch norm cancels any per-channel shift of the streams, and on 8x8
    # images layer 4 runs on 1x1 maps, where a shift passes the branches' convolutions as a
    # shift that their batch norm cancels too: the biases of layer 4's last branch BNs (3
    # tensors) have zero gradient in exact arithmetic, 1e-17 of the largest here. They are judged
    # against 1e-6 of the largest gradient (every other tensor is above 0.02 of it, and is judged
    # against its own scale).
    floor = 1e-6 if arch == "irevnet18" else 0.0
    assert max_relative_error(got, want, floor) < 1e-10  # float64: the rebuild is exact to rounding
    assert all(in_flight(s) == 0 for s in stages), "drain left micro-batches in flight"


def test_invariant1_float32_and_revnet50():
    batches = make_batches(5, dtype=torch.float32)
    got, _ = applied_gradients("revnet50", 5, 2, batches, dtype=torch.float32)
    want = end_to_end_gradients("revnet50", 2, batches, dtype=torch.float32)
    # RevNet50's downsampling blocks begin every path with conv -> BN (projection shortcut and
    # transfer), which cancels any per-channel shift of their input: the gradients of the BN
    # biases feeding them (19 tensors) are zero in exact arithmetic (< 2e-15 in float64) and
    # float32 rounding noise here (< 5e-6, ~4e-8 of the largest gradient, 105). They are judged
    # against 2e-4 of the largest gradient; every other tensor (all above 6e-4 of it) against its
    # own scale.
    assert max_relative_error(got, want, floor=2e-4) < 1e-3


def test_invariant1_float32_invertible_revnet50():
    """The fully invertible bottleneck net in float32: every stage but the stem's rebuilds."""
    batches = make_batches(5, dtype=torch.float32)
    got, stages = applied_gradients("irevnet50", 5, 2, batches, dtype=torch.float32)
    assert not any(b for s in stages[1:-1] for b in s.buffered)
    want = end_to_end_gradients("irevnet50", 2, batches, dtype=torch.float32)
    # Bottleneck branches begin with a 1x1 conv -> BN, which cancels any per-channel shift of the
    # streams, and so does the head's BN: the biases of every branch's last BN (16 tensors),
    # which shift a stream, have zero gradient in exact arithmetic and float32 rounding noise
    # here (< 1e-7 of the largest gradient). As for RevNet50 above, they are judged against 2e-4
    # of the largest gradient; every other tensor against its own scale.
    assert max_relative_error(got, want, floor=2e-4) < 1e-3


def test_invariant1_detects_a_wrong_gradient():
    """The comparison has teeth: dropping one micro-batch from PETRA's run is caught."""
    batches = make_batches(6)
    got, _ = applied_gradients("revnet18", 4, 1, batches[:5])
    want = end_to_end_gradients("revnet18", 1, batches)
    assert max_relative_error(got, want) > 1e-3


def test_relative_error_is_per_tensor():
    """A small tensor that came out wrong is caught even beside a large one (a whole-net scale
    would call this 1e-6), and an exactly zero reference needs an exactly zero result."""
    big, small = torch.full((3,), 1000.0, dtype=torch.float64), torch.full((2,), 1e-3,
                                                                          dtype=torch.float64)
    assert max_relative_error([big, small], [big, small]) == 0.0
    assert max_relative_error([big, torch.zeros(2, dtype=torch.float64)], [big, small]) == 1.0
    zero = torch.zeros(2, dtype=torch.float64)
    assert max_relative_error([big, zero], [big, zero]) == 0.0
    assert max_relative_error([big, zero + 1e-20], [big, zero]) > 1e200
    # a floor (a fraction of the largest entry) only lifts tensors below it
    assert max_relative_error([big, zero], [big, small], floor=1e-4) == 1e-2


def test_nonzero_lr_changes_the_gradient_through_delay():
    """With lr > 0, PETRA's delayed gradients differ from plain training, and only through the
    delay: one micro-batch has no forward after an update, so nothing is delayed and PETRA
    trains as plain training to rounding; with more, every stage's parameters differ by far more
    than rounding."""
    batches = make_batches(6)
    one = [run_engine("revnet18", 4, 1, batches[:1], method=m, lr=0.5)
           for m in ("petra", "backprop")]
    assert max_relative_error(flat_params(one[0]), flat_params(one[1])) < 1e-10
    petra = run_engine("revnet18", 4, 1, batches, lr=0.5)
    plain = run_engine("revnet18", 4, 1, batches, method="backprop", lr=0.5)
    for s, (a, b) in enumerate(zip(petra, plain)):
        assert max_relative_error(list(a.parameters()), list(b.parameters())) > 1e-3, s


def plain_autograd_training(arch, k, batches, lr, dtype, width=4, weight_decay=5e-4):
    """Reference: ordinary PyTorch training of the whole net, k micro-batches per step."""
    (net,) = stages_of(arch, width, 10, 1, seed=0, dtype=dtype)
    model = torch.nn.Sequential(*net.blocks)
    opt = StageOptimizer(model, LRSchedule(lr, 3, warmup_epochs=1, milestones=(2,)),
                         weight_decay=weight_decay)
    for b, (x, y) in enumerate(batches):
        F.cross_entropy(model(x), y).backward()
        opt.accumulated()
        if (b + 1) % k == 0 or b == len(batches) - 1:
            opt.step()
    return list(model.parameters()) + list(model.buffers())


@pytest.mark.parametrize("arch,J,method", [
    ("revnet18", 1, "petra"), ("revnet18", 4, "backprop"), ("revnet18", 10, "backprop"),
    ("irevnet18", 1, "petra"), ("irevnet18", 4, "backprop")])
@pytest.mark.parametrize("k", [1, 2])
def test_invariant2_follows_plain_autograd(arch, J, method, k):
    batches = make_batches(8, size=16)  # 16x16 keeps the last BN layers off 1x1 maps, whose
    # near-zero batch variance would amplify rounding differences between the two computations
    stages = stages_of(arch, 4, 10, J, seed=0, dtype=torch.float64)
    from petra_mpi.engines.build import build_workers
    from petra_mpi.engines.local import LocalEngine
    workers = build_workers(stages, LRSchedule(0.2, 3, warmup_epochs=1, milestones=(2,)), k,
                            weight_decay=5e-4)
    LocalEngine(workers, method).train_segment(iter(batches), len(batches))
    got = flat_params(stages) + [b for s in stages for b in s.buffers()]
    want = plain_autograd_training(arch, k, batches, 0.2, torch.float64)
    assert len(got) == len(want)
    moved = max((w - w0).abs().max().item() for w, w0 in
                zip(want, flat_params(stages_of(arch, 4, 10, 1, seed=0, dtype=torch.float64))))
    assert moved > 1e-3  # training really happened
    for g, w in zip(got, want):
        torch.testing.assert_close(g.double(), w.double(), rtol=1e-9, atol=1e-11)


# irevnet18's first three reversible blocks include its first (invertible) downsampling
@pytest.mark.parametrize("arch", ["revnet18", "revnet50", "irevnet18"])
def test_invariant4_reversible_rebuild(arch):
    torch.manual_seed(0)
    blocks = [b for b in build_blocks(arch, 8, 10) if b.reversible]
    for block in blocks[:3]:
        x = torch.randn(4, block.branch[0][0].in_channels * 2, 8, 8)
        stage = Stage([block], 1, 3)
        y = stage(x)
        rebuilt, grad = stage.backward(y, torch.randn_like(y))
        rel = ((rebuilt - x).norm() / x.norm()).item()
        assert rel < 1e-5
        assert grad.shape == x.shape


def test_invariant4_rebuild_drifts_when_weights_change():
    """Rebuilding after a weight change is approximate: the check above can fail."""
    torch.manual_seed(0)
    block = next(b for b in build_blocks("revnet18", 8, 10) if b.reversible)
    stage = Stage([block], 1, 3)
    x = torch.randn(4, 16, 8, 8)
    y = stage(x)
    with torch.no_grad():
        for p in block.parameters():
            p.add_(0.1 * torch.randn_like(p))
    rebuilt, _ = stage.backward(y, torch.randn_like(y))
    assert ((rebuilt - x).norm() / x.norm()).item() > 1e-3


def bn_layers(stages):
    return [m for s in stages for m in s.modules() if isinstance(m, torch.nn.BatchNorm2d)]


@pytest.mark.parametrize("J", [2, 10])
@pytest.mark.parametrize("method,flags", [
    ("petra", {}), ("delayed", {"stash_weights": True}), ("delayed", {"buffer_inputs": True}),
    ("delayed", {"buffer_inputs": True, "stash_weights": True})])
def test_invariant5_bn_stats_updated_once_per_microbatch_in_backward(J, method, flags):
    batches = make_batches(5)
    stages = stages_of("revnet18", 4, 10, J, seed=0, dtype=torch.float64, **flags)
    bns = bn_layers(stages)
    stage0 = stages[0]
    before = [bn.running_mean.clone() for bn in bns]
    with torch.no_grad():
        stage0(batches[0][0])  # a forward alone changes nothing
    assert all(bn.num_batches_tracked.item() == 0 for bn in bns)
    assert all(torch.equal(b, bn.running_mean) for b, bn in zip(before, bns))
    stage0.clear()
    # a full run: every BN counted exactly once per micro-batch
    from petra_mpi.engines.build import build_workers
    from petra_mpi.engines.local import LocalEngine
    LocalEngine(build_workers(stages, LRSchedule(0.0, 10)), method).train_segment(iter(batches), 5)
    assert all(bn.num_batches_tracked.item() == 5 for bn in bns)
    # and the running statistics equal those of plain training-mode forwards (lr = 0)
    (ref,) = stages_of("revnet18", 4, 10, 1, seed=0, dtype=torch.float64)
    model = torch.nn.Sequential(*ref.blocks)
    with torch.no_grad():
        for x, _ in batches:
            model(x)
    for bn, rb in zip(bns, bn_layers([ref])):
        torch.testing.assert_close(bn.running_mean, rb.running_mean, rtol=1e-9, atol=1e-12)
        torch.testing.assert_close(bn.running_var, rb.running_var, rtol=1e-9, atol=1e-12)


def test_frozen_bn_uses_batch_statistics():
    bn = build_blocks("revnet18", 4, 10)[0].body[1].double()
    x = torch.randn(6, 8, 4, 4, dtype=torch.float64) * 3 + 2
    with frozen_bn_stats():
        y = bn(x)
    assert abs(y.mean().item()) < 1e-6 and abs(y.std().item() - 1) < 0.1
    assert bn.num_batches_tracked.item() == 0


def test_block_counts():
    assert [num_blocks(a) for a in ("revnet18", "revnet34", "revnet50")] == [10, 18, 18]
    assert [num_blocks(a) for a in ("irevnet18", "irevnet34", "irevnet50")] == [10, 18, 18]
