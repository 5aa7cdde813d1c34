"""Communication as data: the schedule lowered with its messages (TickSchedule.lowered) pairs
every send with its receive across the stages, channel by channel of the channel table
(comm/channels.py), for every method, J <= 10, k <= 4, in a whole segment and in one a stop
shortened at any tick, and every receive a rank posts ahead still gets its message. The engines
run exactly these lowered actions (engines/segment.py), so a schedule whose messages do not pair
fails here, not as a hang under mpirun."""
from collections import Counter, defaultdict

import pytest

from petra_mpi.comm.channels import CHANNELS, of_action
from petra_mpi.core.schedule import (METHODS, RECEIVER, Action, ForwardOnlySchedule, Kind,
                                     PetraSchedule, schedule_for)
from petra_mpi.engines.stopping import stop_count

RECEIVES = {Kind(c.receive) for c in CHANNELS}


def plan_of(schedule, n, stop_tick=None, cache=None):
    """{stage: [(tick, action)]} of a segment of n; with stop_tick, the segment a stop applied at
    that tick shortened (the engines' rule: the old plan before it, the shorter one from it on),
    and its length. cache: {length: each stage's lowered actions per tick}, filled as needed."""
    cache = {} if cache is None else cache
    length = n if stop_tick is None else stop_count(schedule, stop_tick, n)
    for m in (n, length):
        if m not in cache:
            cache[m] = {s: [schedule.lowered(s, t, m) for t in range(schedule.num_ticks(m))]
                        for s in range(schedule.J)}
    plan = {}
    for s in range(schedule.J):
        plan[s] = [(t, a) for t in range(schedule.num_ticks(length))
                   for a in cache[n if stop_tick is not None and t < stop_tick else length][s][t]]
    return plan, length


def channels(schedule, plan):
    """(sends, receives): per (channel of the table, sender, receiver), the (tick, micro-batch)
    of each message in the order its sender sends it, or its receiver receives it. Each send
    goes to, and each receive comes from, the stage the table's channel names."""
    sends, receives = defaultdict(list), defaultdict(list)
    for s, actions in plan.items():
        for t, a in actions:
            assert a.stage == s
            for c in of_action(a.kind.value):
                if a.kind.value == c.send:
                    assert a.peer == c.receiver(s, schedule.J), (c.key, a)
                    sends[(c.key, s, a.peer)].append((t, a.microbatch))
                else:
                    assert a.peer == c.sender(s, schedule.J), (c.key, a)
                    receives[(c.key, a.peer, s)].append((t, a.microbatch))
    return sends, receives


def check_pairs(schedule, plan, length):
    """Every send has its receive, on the stage it names, in order, at a later tick; each stage
    receives what TickSchedule.receives says; the data enters and the results leave once each."""
    sends, receives = channels(schedule, plan)
    assert sends.keys() == receives.keys(), (sorted(sends), sorted(receives))
    for key, sent in sends.items():
        got = receives[key]
        assert [b for _, b in sent] == [b for _, b in got], key  # a stream keeps its order
        assert all(tr > ts for (ts, _), (tr, _) in zip(sent, got)), key  # an earlier tick's
    for s, actions in plan.items():
        counted = Counter(a.kind for _, a in actions if a.kind in RECEIVES)
        assert counted == +Counter(schedule.receives(s, length)), s
    every = list(range(length))
    assert [a.microbatch for _, a in plan[0] if a.kind is Kind.LOAD] == every
    assert [a.microbatch for _, a in plan[schedule.J - 1] if a.kind is Kind.REPORT] == every


def check_posted_receives(schedule, plan, n, length, stop_tick):
    """What a rank's streams posted before the stop applied (up to their channel's `ahead` past
    what they received, never more than announced) must still come in the shortened segment."""
    for s, actions in plan.items():
        before, after = schedule.receives(s, n), schedule.receives(s, length)
        received = Counter(a.kind for t, a in actions if t < stop_tick and a.kind in RECEIVES)
        for kind in RECEIVES:
            ahead = max(c.ahead for c in of_action(kind.value))
            posted = min(before[kind], received[kind] + ahead)
            assert posted <= after[kind], (s, kind, stop_tick)


def check_segment(schedule, n):
    cache = {}
    plan, length = plan_of(schedule, n, cache=cache)
    check_pairs(schedule, plan, length)
    for stop_tick in range(schedule.num_ticks(n)):
        plan, length = plan_of(schedule, n, stop_tick, cache)
        check_pairs(schedule, plan, length)
        check_posted_receives(schedule, plan, n, length, stop_tick)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("J", range(1, 11))
@pytest.mark.parametrize("k", [1, 2, 3, 4])
def test_every_send_pairs_with_its_receive_with_a_stop_at_every_tick(method, J, k):
    """(`delayed` with or without buffered inputs, stashed weights or a kept plan has this one
    schedule: those change what a stage keeps, not its messages.)"""
    check_segment(schedule_for(method, J, k), 7)


@pytest.mark.parametrize("J", range(1, 11))
def test_evaluation_messages_pair(J):
    schedule = ForwardOnlySchedule(J)
    plan, length = plan_of(schedule, 5)
    check_pairs(schedule, plan, length)
    assert {a.kind for actions in plan.values() for _, a in actions} <= {
        Kind.LOAD, Kind.SEND_L, Kind.RECV_L, Kind.RECV_F, Kind.EVALUATE, Kind.SEND_F, Kind.REPORT}


def test_a_tick_receives_computes_and_sends_in_order():
    """Stage 1 of 3 at tick 4 (petra, k = 1): backward of 1 between its receive and its send,
    then forward of 3 likewise, then the step; the last stage's labels come from stage 0."""
    s = schedule_for("petra", 3)
    assert s.lowered(1, 4, 8) == [
        Action(Kind.RECV_B, 1, 1, 2), Action(Kind.BACKWARD, 1, 1), Action(Kind.SEND_B, 1, 1, 0),
        Action(Kind.RECV_F, 1, 3, 0), Action(Kind.FORWARD, 1, 3), Action(Kind.SEND_F, 1, 3, 2),
        Action(Kind.STEP, 1, 1)]
    assert s.lowered(0, 2, 8) == [Action(Kind.LOAD, 0, 2), Action(Kind.SEND_L, 0, 2, 2),
                                  Action(Kind.FORWARD, 0, 2), Action(Kind.SEND_F, 0, 2, 1)]
    assert s.lowered(2, 3, 8) == [
        Action(Kind.RECV_F, 2, 1, 1), Action(Kind.RECV_L, 2, 1, 0),
        Action(Kind.FORWARD_BACKWARD, 2, 1), Action(Kind.SEND_B, 2, 1, 1),
        Action(Kind.REPORT, 2, 1), Action(Kind.STEP, 2, 1)]


class SwappedSend(PetraSchedule):
    """PETRA, except that stage 1 sends its backward's message up instead of down."""

    def _outputs(self, a):
        if a.kind is Kind.BACKWARD and a.stage == 1:
            return [Action(Kind.SEND_F, 1, a.microbatch, 2)]
        return super()._outputs(a)


def test_the_pairing_catches_a_swapped_send():
    with pytest.raises(AssertionError):
        check_segment(SwappedSend(3), 7)


def test_every_channel_is_sent_and_received_by_actions_of_the_schedule():
    assert {Kind(c.send) for c in CHANNELS} == set(RECEIVER)
    assert all(RECEIVER[Kind(c.send)] is Kind(c.receive) for c in CHANNELS)
    assert [c.key for c in of_action(Kind.SEND_B.value)] == ["rebuilt", "gradient"]  # x̃, δ


class FarChannel(PetraSchedule):
    """PETRA whose backward messages skip a stage: what the table says no channel does."""

    def _message(self, kind, s, b):
        a = super()._message(kind, s, b)
        return Action(kind, s, b, a.peer - 1) if kind is Kind.SEND_B and a.peer > 0 else a


def test_the_pairing_catches_a_message_to_a_stage_its_channel_does_not_name():
    with pytest.raises(AssertionError):
        check_segment(FarChannel(4), 7)
