"""The engine at lr > 0 against a deliberately naive reference of docs/design.md §1.

Invariant 1 pins the engine at lr = 0 only, where the delay does not matter. Here a second,
independent implementation of the algorithm trains the same net on the same data with a real
learning rate, momentum and weight decay, and the engine must match it to float64 rounding.

The reference shares nothing with the engine but the model blocks (used as pure functions through
torch.func.functional_call) and the initial weights. Everything else is written out plainly:
- weights are explicit tensors, W[s][i][name] for block i of stage s, replaced (never mutated) by
  each optimizer step, so "the weights of a micro-batch's forward" is just the W[s] of that tick;
- every in-flight quantity lives in a dict keyed by (stage, micro-batch) or (stage, block,
  micro-batch), so a wrong delay shows up as a missing or leftover key;
- the optimizer (SGD, Nesterov momentum, weight decay on weights of dimension > 1 only, linear
  warm-up, a step decay) is a few lines of tensor arithmetic, not torch.optim;
- a reversible block's backward rebuilds x̃ = (y2, y1 − F(y2)) with the current weights, then
  takes the VJP of the whole block at x̃ (two forwards of F where the engine does one: the same
  numbers, reached differently).
"""
import pytest
import torch
import torch.nn.functional as F
from torch.func import functional_call

from tests.support.nets import make_batches, max_relative_error, stages_of
from petra_mpi.engines.build import build_workers
from petra_mpi.engines.local import LocalEngine
from petra_mpi.models import frozen_bn_stats
from petra_mpi.core.optim import LRSchedule

PEAK, STEPS_PER_EPOCH, MOMENTUM, WEIGHT_DECAY = 0.3, 2, 0.9, 5e-4
TOL = 1e-10  # float64: the two implementations differ only by rounding (seen: ~1e-14)


def data():
    # 16x16 images, not 8x8: on 8x8 the last blocks see 1x1 maps where some BN running means are
    # zero in exact arithmetic and rounding noise (~1e-17) in practice, which no per-tensor
    # relative comparison can judge.
    return make_batches(7, size=16)


def reference_lr(step):
    """The schedule given to the engine below, re-derived: one warm-up epoch of 2 steps rising
    linearly from PEAK/2, then PEAK, then PEAK/10 from epoch 2 on."""
    if step < STEPS_PER_EPOCH:
        return PEAK * (step + 1) / STEPS_PER_EPOCH
    return PEAK * (0.1 if step // STEPS_PER_EPOCH >= 2 else 1.0)


def engine_run(arch, J, k, batches, buffer_inputs=False, stash_weights=False):
    stages = stages_of(arch, 4, 10, J, seed=0, dtype=torch.float64,
                          buffer_inputs=buffer_inputs, stash_weights=stash_weights)
    workers = build_workers(stages, LRSchedule(PEAK, STEPS_PER_EPOCH, warmup_epochs=1,
                                               milestones=(2,)),
                            k, momentum=MOMENTUM, weight_decay=WEIGHT_DECAY)
    method = "delayed" if buffer_inputs or stash_weights else "petra"
    assert LocalEngine(workers, method).train_segment(iter(batches), len(batches)) == len(batches)
    params = [[dict(b.named_parameters()) for b in s.blocks] for s in stages]
    buffers = [[dict(b.named_buffers()) for b in s.blocks] for s in stages]
    return params, buffers


def reference_run(arch, J, k, batches, buffer_inputs=False, stash_weights=False, delay_shift=0):
    """docs/design.md §1 tick by tick. `delay_shift` > 0 makes stage s's delay (2 + delay_shift)(J-1-s)
    instead of 2(J-1-s) (a deliberately wrong schedule for the negative control)."""
    stages = stages_of(arch, 4, 10, J, seed=0, dtype=torch.float64)  # blocks + initial weights
    blocks = [list(s.blocks) for s in stages]
    W = [[{n: p.detach().clone() for n, p in b.named_parameters()} for b in bs] for bs in blocks]
    # Which blocks keep their input from forward to backward (all but reversible ones in PETRA).
    keeps_input = [[not b.reversible or buffer_inputs for b in bs] for bs in blocks]
    n, last = len(batches), J - 1
    acts = {}      # (s, b): input of stage s for micro-batch b, sent by s-1
    down = {}      # (s, b): (x̃, δ) for stage s < J-1, sent by s+1
    saved = {}     # (s, i, b): input of block i of stage s, kept by the forward
    stashed = {}   # (s, b): W[s] at the forward of b (only with stash_weights)
    grads = [None] * J     # per stage: summed parameter gradients since the last step
    count = [0] * J        # backwards since the last step
    steps = [0] * J
    momentum = [{} for _ in range(J)]  # (i, name): momentum buffer

    def accumulate(s, b, block_grads):
        grads[s] = block_grads if grads[s] is None else [
            {n: acc[n] + g[n] for n in acc} for acc, g in zip(grads[s], block_grads)]
        count[s] += 1
        if (b + 1) % k == 0 or b == n - 1:  # every k backwards, and at the drain
            step(s)

    def step(s):
        lr, new = reference_lr(steps[s]), []
        for i, weights in enumerate(W[s]):
            updated = {}
            for name, p in weights.items():
                g = grads[s][i][name] / count[s]
                if p.ndim > 1:  # weight decay on conv/linear weights, not on BN or biases
                    g = g + WEIGHT_DECAY * p
                buf = momentum[s].get((i, name))
                buf = g.clone() if buf is None else MOMENTUM * buf + g
                momentum[s][(i, name)] = buf
                updated[name] = p - lr * (g + MOMENTUM * buf)  # Nesterov
            new.append(updated)
        W[s] = new  # a new list: a stashed W[s] keeps the old tensors
        grads[s], count[s] = None, 0
        steps[s] += 1

    def vjp(block, weights, x, grad_out):
        """Input and parameter gradients of one block at x (BN in training mode: this updates the
        running statistics, once per micro-batch as docs/design.md asks)."""
        x = x.detach().requires_grad_()
        w = {n: t.detach().requires_grad_() for n, t in weights.items()}
        out = functional_call(block, w, (x,))
        gx, *gw = torch.autograd.grad(out, [x, *w.values()], grad_out)
        return gx, dict(zip(w, gw))

    for t in range(n + (2 + delay_shift) * last):
        for s in range(J):
            b = t - s
            if 0 <= b < n and s == last:  # forward, loss and backward at once, current weights
                x = batches[b][0] if s == 0 else acts.pop((s, b))
                x_leaf = x.detach().requires_grad_()
                w = [{n: p.detach().requires_grad_() for n, p in ws.items()} for ws in W[s]]
                h = x_leaf
                for block, wb in zip(blocks[s], w):
                    h = functional_call(block, wb, (h,))
                loss = F.cross_entropy(h, batches[b][1])
                flat = [p for wb in w for p in wb.values()]
                gx, *gw = torch.autograd.grad(loss, [x_leaf, *flat])
                it = iter(gw)
                block_grads = [{n: next(it) for n in wb} for wb in w]
                if s > 0:
                    down[(s - 1, b)] = (x, gx)
                accumulate(s, b, block_grads)
            elif 0 <= b < n:  # forward: no graph, BN on batch statistics, running stats untouched
                x = batches[b][0] if s == 0 else acts.pop((s, b))
                with torch.no_grad(), frozen_bn_stats():
                    for i, block in enumerate(blocks[s]):
                        if keeps_input[s][i]:
                            saved[(s, i, b)] = x
                        x = functional_call(block, W[s][i], (x,))
                acts[(s + 1, b)] = x
                if stash_weights:
                    stashed[(s, b)] = W[s]
            b = t - 2 * last + s - delay_shift * (last - s)  # delay 2(J-1-s), or longer
            if s < last and 0 <= b < n:  # backward with the current weights (or the stashed ones)
                if (s, b) not in down:
                    raise KeyError(f"stage {s} backwards micro-batch {b} before it arrived")
                y, gy = down.pop((s, b))
                vjp_weights = stashed.pop((s, b)) if stash_weights else W[s]
                block_grads = [None] * len(blocks[s])
                for i in reversed(range(len(blocks[s]))):
                    block = blocks[s][i]
                    if keeps_input[s][i]:
                        x = saved.pop((s, i, b))
                    else:  # rebuild x̃ from ỹ with the CURRENT weights (stats untouched)
                        y1, y2 = y.chunk(2, dim=1)
                        branch = {n[len("branch."):]: p for n, p in W[s][i].items()}
                        with torch.no_grad(), frozen_bn_stats():
                            x = torch.cat([y2, y1 - functional_call(block.branch, branch, (y2,))],
                                          dim=1)
                    gy, block_grads[i] = vjp(block, vjp_weights[i], x, gy)
                    y = x  # x̃ goes down, to the block before or to stage s-1
                if s > 0:
                    down[(s - 1, b)] = (y, gy)
                accumulate(s, b, block_grads)
    assert not (acts or down or saved or stashed), "reference did not drain"
    buffers = [[{n: t.clone() for n, t in b.named_buffers()} for b in bs] for bs in blocks]
    return W, buffers


def compare(got, want):
    """Per-tensor relative errors of the engine's parameters and BN running statistics against
    the reference (num_batches_tracked counts must be equal)."""
    (gp, gb), (wp, wb) = got, want
    pairs, counts_equal = [], True
    for gs, ws in zip(gp + gb, wp + wb):
        for g, w in zip(gs, ws):
            assert g.keys() == w.keys()
            for name in g:
                if name.endswith("num_batches_tracked"):
                    counts_equal &= torch.equal(g[name], w[name])
                else:
                    pairs.append((g[name].detach(), w[name]))
    got_t, want_t = zip(*pairs)
    return max_relative_error(got_t, want_t), counts_equal


def moved(params, arch, J):
    initial = stages_of(arch, 4, 10, J, seed=0, dtype=torch.float64)
    return max((p - q).abs().max().item() for ps, s in zip(params, initial)
               for d, b in zip(ps, s.blocks) for (_, p), q in zip(d.items(), b.parameters()))


SWITCHES = [dict(), dict(buffer_inputs=True), dict(stash_weights=True),
            dict(buffer_inputs=True, stash_weights=True)]
IDS = ["petra", "delayed-buffer", "delayed-stash", "delayed-buffer-stash"]


@pytest.mark.parametrize("switches", SWITCHES, ids=IDS)
@pytest.mark.parametrize("J", [1, 2, 3, 4, 10])
@pytest.mark.parametrize("k", [1, 2, 3])
def test_engine_matches_naive_reference_revnet18(J, k, switches):
    batches = data()
    got = engine_run("revnet18", J, k, batches, **switches)
    err, counts_equal = compare(got, reference_run("revnet18", J, k, batches, **switches))
    assert counts_equal, "BN statistics updated a different number of times"
    assert err < TOL, f"engine and reference differ: {err:.3g}"
    assert moved(got[0], "revnet18", J) > 1e-2  # the learning rate really acted


@pytest.mark.parametrize("switches", [dict(), dict(stash_weights=True)], ids=["petra", "stash"])
def test_engine_matches_naive_reference_resnet18(switches):
    batches = data()
    got = engine_run("resnet18", 4, 2, batches, **switches)
    err, counts_equal = compare(got, reference_run("resnet18", 4, 2, batches, **switches))
    assert counts_equal and err < TOL, err


@pytest.mark.parametrize("wrong", [
    dict(stash_weights=True),   # backward with the forward's weights instead of the current ones
    dict(buffer_inputs=True),   # exact stored input instead of the rebuilt one
    dict(delay_shift=1),        # a longer delay than 2(J-1-s)
], ids=["forward-weights", "stored-input", "longer-delay"])
def test_reference_comparison_detects_a_wrong_algorithm(wrong):
    """The comparison has teeth: the engine running PETRA differs from a reference that is
    PETRA with one detail changed, far above the tolerance."""
    batches = data()
    got = engine_run("revnet18", 4, 1, batches)
    err, _ = compare(got, reference_run("revnet18", 4, 1, batches, **wrong))
    assert err > 1e3 * TOL
