"""A stop request (a signal, a due wall-time checkpoint) at any tick of a segment, in the
single-process engine, for every method, stage count and accumulation: the segment ends at the
length of the rule both engines follow (stopping.SegmentVotes), every stage has taken its steps
so a checkpoint can be written, and the state is exactly that of an uninterrupted segment of that
length. tests/mpi/test_stop_engines_agree.py holds the MPI engine to the same state."""
import pytest
import torch

from tests.support.nets import make_batches, stages_of
from stop_anywhere import StopAtTick
from petra_mpi.run.checkpoint import save_blocks
from petra_mpi.engines.build import build_workers
from petra_mpi.engines.local import LocalEngine
from petra_mpi.core.optim import LRSchedule
from petra_mpi.core.schedule import schedule_for

pytestmark = pytest.mark.usefixtures("one_thread")

CHECK = 8    # stopping.STOP_CHECK_TICKS, restated: the test pins the rule
MARGIN = 3   # stopping.STOP_MARGIN


def expected_length(schedule, n, fired):
    """The request turns on inside tick `fired`, after that tick's check; the first check after
    it that still posts a vote (while two checks remain) reads it, and it applies one check
    later: the segment becomes what has entered stage 0 by then plus the margin."""
    ticks = schedule.num_ticks(n)
    read = next((t for t in range(fired + 1, ticks) if t % CHECK == 0 and t + 2 * CHECK < ticks),
                None)
    return n if read is None else min(n, schedule.entered_before(read + CHECK) + MARGIN)


def segment_length(method, J):
    """The fewest micro-batches whose segment an early stop shortens."""
    schedule = schedule_for(method, J)
    return next(n for n in range(1, 100) if expected_length(schedule, n, 0) < n)


def train(method, J, k, n, stop=None):
    """One segment of the tiny float64 net of the invariant tests, at a learning rate that makes
    every step show; returns (micro-batches trained, workers)."""
    delayed = method == "delayed"
    stages = stages_of("revnet18", 4, 10, J, seed=0, dtype=torch.float64,
                          buffer_inputs=delayed, stash_weights=delayed)
    workers = build_workers(stages, LRSchedule(0.1, 10**6), k, weight_decay=5e-4,
                            hooks=[stop] if stop is not None else ())
    trained = LocalEngine(workers, method).train_segment(iter(make_batches(n)), n, stop=stop)
    return trained, workers


def state(workers):
    return [(list(w.stage.parameters()) + list(w.stage.buffers()), w.optimizer.steps)
            for w in workers]


def same(a, b):
    return all(sa == sb and all(torch.equal(x, y) for x, y in zip(ta, tb))
               for (ta, sa), (tb, sb) in zip(a, b))


def check_stops(tmp_path, method, J, k, ticks):
    schedule = schedule_for(method, J, k)
    n = segment_length(method, J)
    uninterrupted = {}  # by length
    shortened = set()
    for tick in ticks(schedule.num_ticks(n)):
        stop = StopAtTick(schedule, n, tick)
        trained, workers = train(method, J, k, n, stop)
        assert stop.requested
        assert [w.optimizer.pending for w in workers] == [0] * J, f"stop at tick {tick}"
        for w in workers:  # a real checkpoint of every stage: it refuses unapplied gradients
            save_blocks(str(tmp_path / f"{method}-{J}-{k}-{tick}"), w)
        if trained not in uninterrupted:
            uninterrupted[trained] = state(train(method, J, k, trained)[1])
        assert same(state(workers), uninterrupted[trained]), f"stop at tick {tick}"
        assert trained == expected_length(schedule, n, stop.fired), (tick, stop.fired, trained)
        shortened.add(trained < n)
    assert shortened == {True, False}, "the ticks tried include stops that shorten and not"


@pytest.mark.parametrize("method,J,k", [("petra", 1, 3), ("delayed", 2, 2), ("backprop", 3, 3),
                                          ("petra", 3, 2)])
def test_a_stop_anywhere_leaves_the_state_of_a_shorter_segment(tmp_path, method, J, k):
    """Stop ticks 1, 8, 15, ... across the segment."""
    check_stops(tmp_path, method, J, k, lambda ticks: range(1, ticks, 7))


@pytest.mark.extended
@pytest.mark.parametrize("method", ["petra", "delayed", "backprop"])
@pytest.mark.parametrize("J,k", [(1, 3), (2, 1), (2, 3), (3, 3), (4, 1), (4, 3)])
def test_a_stop_at_every_tick(tmp_path, method, J, k):
    """Every J to 4 with a step over 3 micro-batches, and one update per micro-batch at an even
    and at the deepest J (k = 2: the test above, every 7th tick)."""
    check_stops(tmp_path, method, J, k, range)


def test_the_bitwise_comparison_sees_one_step_less():
    """The comparison has teeth: a segment one micro-batch shorter differs."""
    _, a = train("backprop", 3, 3, 8)
    _, b = train("backprop", 3, 3, 7)
    assert not same(state(a), state(b))
