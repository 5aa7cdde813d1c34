"""The schedule's tick arithmetic, and the engine obeying it."""
from collections import Counter

import pytest

from petra_mpi.schedule import (backward_microbatch, delay, forward_microbatch, num_ticks,
                                tick_ops, updates_after)


@pytest.mark.parametrize("J", list(range(1, 19)))
@pytest.mark.parametrize("n", [1, 5, 40])
def test_petra_every_microbatch_once_per_stage_with_the_design_delays(J, n):
    seen_f, seen_b = Counter(), Counter()
    fwd_tick, bwd_tick = {}, {}
    for t in range(num_ticks("petra", J, n)):
        for s in range(J):
            b = forward_microbatch("petra", J, s, t, n)
            if b is not None:
                seen_f[(s, b)] += 1
                fwd_tick[(s, b)] = t
                assert t == b + s
            b = backward_microbatch("petra", J, s, t, n)
            if b is not None:
                seen_b[(s, b)] += 1
                bwd_tick[(s, b)] = t
                assert t == b + 2 * (J - 1) - s
    everything = {(s, b) for s in range(J) for b in range(n)}
    assert set(seen_f) == everything and set(seen_b) == everything
    assert max(seen_f.values()) == 1 and max(seen_b.values()) == 1
    for s in range(J):
        for b in range(n):
            assert bwd_tick[(s, b)] - fwd_tick[(s, b)] == delay(J, s) == 2 * (J - 1 - s)
            if s > 0:  # data dependencies: one tick per hop
                assert fwd_tick[(s, b)] == fwd_tick[(s - 1, b)] + 1
                assert bwd_tick[(s - 1, b)] == bwd_tick[(s, b)] + 1
    # drain: the last tick is the stage-0 backward of the last micro-batch, nothing after
    assert bwd_tick[(0, n - 1)] == num_ticks("petra", J, n) - 1


@pytest.mark.parametrize("J", [1, 2, 5, 18])
def test_backprop_one_stage_busy_at_a_time(J):
    n = 4
    busy = Counter()
    order = []
    for t in range(num_ticks("backprop", J, n)):
        for s in range(J):
            f = forward_microbatch("backprop", J, s, t, n)
            b = backward_microbatch("backprop", J, s, t, n) if s < J - 1 else None
            if f is not None:
                busy[t] += 1
                order.append(("f", s, f))
            if b is not None:
                busy[t] += 1
                order.append(("b", s, b))
    assert set(busy.values()) == {1}
    expected = []
    for mb in range(n):
        expected += [("f", s, mb) for s in range(J)] + [("b", s, mb) for s in reversed(range(J - 1))]
    assert order == expected


def stage_ops(method, J, stage, n):
    return [op for t in range(num_ticks(method, J, n)) for op in tick_ops(method, J, stage, t, n)]


def test_stage_ops_interleave_forward_and_backward():
    ops = list(stage_ops("petra", 3, 0, 4))
    # stage 0 of 3: delay 4, so backward of b comes right after the forward of b + 4 (fill, steady, drain)
    assert ops == [("forward", 0), ("forward", 1), ("forward", 2), ("forward", 3),
                   ("backward", 0), ("backward", 1), ("backward", 2), ("backward", 3)]
    assert list(stage_ops("petra", 3, 2, 2)) == [("forward_backward", 0), ("forward_backward", 1)]
    ops = list(stage_ops("petra", 2, 0, 5))
    assert ops[:4] == [("forward", 0), ("forward", 1), ("forward", 2), ("backward", 0)]


@pytest.mark.parametrize("n,k", [(10, 1), (10, 3), (9, 3), (2, 5)])
def test_updates_every_k_and_at_the_drain(n, k):
    steps = [b for b in range(n) if updates_after(b, n, k)]
    assert steps[-1] == n - 1
    assert len(steps) == -(-n // k)
    assert all((b + 1) % k == 0 for b in steps[:-1])
