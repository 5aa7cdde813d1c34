"""The schedule's tick arithmetic, and the engine obeying it."""
from collections import Counter

import pytest

from petra_mpi.core.schedule import (SCHEDULES, Action, Kind, PetraSchedule, main, num_ticks,
                                     schedule_for, updates_after)


@pytest.mark.parametrize("J", list(range(1, 19)))
@pytest.mark.parametrize("n", [1, 5, 40])
def test_petra_every_microbatch_once_per_stage_with_the_design_delays(J, n):
    seen_f, seen_b = Counter(), Counter()
    fwd_tick, bwd_tick = {}, {}
    schedule = schedule_for("petra", J)
    for t in range(num_ticks("petra", J, n)):
        for s in range(J):
            b = schedule.forward_microbatch(s, t, n)
            if b is not None:
                seen_f[(s, b)] += 1
                fwd_tick[(s, b)] = t
                assert t == b + s
            b = schedule.backward_microbatch(s, t, n)
            if b is not None:
                seen_b[(s, b)] += 1
                bwd_tick[(s, b)] = t
                assert t == b + 2 * (J - 1) - s
    everything = {(s, b) for s in range(J) for b in range(n)}
    assert set(seen_f) == everything and set(seen_b) == everything
    assert max(seen_f.values()) == 1 and max(seen_b.values()) == 1
    for s in range(J):
        for b in range(n):
            assert bwd_tick[(s, b)] - fwd_tick[(s, b)] == schedule.in_flight(s) == 2 * (J - 1 - s)
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
    schedule = schedule_for("backprop", J)
    for t in range(num_ticks("backprop", J, n)):
        for s in range(J):
            f = schedule.forward_microbatch(s, t, n)
            b = schedule.backward_microbatch(s, t, n) if s < J - 1 else None
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
    """The stage's forward/backward actions as (kind name, micro-batch), steps left out."""
    return [(a.kind.value, a.microbatch) for tick in schedule_for(method, J).stage_actions(stage, n)
            for a in tick if a.kind is not Kind.STEP]


def test_stage_ops_interleave_forward_and_backward():
    ops = list(stage_ops("petra", 3, 0, 4))
    # stage 0 of 3: delay 4, so backward of b comes in the tick of the forward of b + 4 (fill,
    # steady, drain)
    assert ops == [("forward", 0), ("forward", 1), ("forward", 2), ("forward", 3),
                   ("backward", 0), ("backward", 1), ("backward", 2), ("backward", 3)]
    assert list(stage_ops("petra", 3, 2, 2)) == [("forward_backward", 0), ("forward_backward", 1)]
    ops = list(stage_ops("petra", 2, 0, 5))
    # backward first within a tick: tick 2 runs the backward of 0, then the forward of 2
    assert ops[:4] == [("forward", 0), ("forward", 1), ("backward", 0), ("forward", 2)]


def test_within_a_tick_backward_then_forward_then_step():
    s = schedule_for("petra", 3, accumulation=1)
    assert s.actions(0, 5, 8) == [Action(Kind.BACKWARD, 0, 1), Action(Kind.FORWARD, 0, 5),
                                  Action(Kind.STEP, 0, 1)]
    assert s.actions(2, 3, 8) == [Action(Kind.FORWARD_BACKWARD, 2, 1), Action(Kind.STEP, 2, 1)]
    assert [a.label for a in s.actions(1, 4, 8)] == ["B1", "F3", "S"]


@pytest.mark.parametrize("method", ["petra", "delayed", "backprop"])
@pytest.mark.parametrize("J,n,k", [(1, 5, 2), (4, 8, 2), (3, 7, 3), (5, 2, 4)])
def test_the_grid_runs_everything_once_and_steps_every_k_and_at_the_drain(method, J, n, k):
    schedule = schedule_for(method, J, k)
    for s in range(J):
        actions = [a for tick in schedule.stage_actions(s, n) for a in tick]
        assert all(a.stage == s for a in actions)
        kinds = [Kind.FORWARD_BACKWARD] if s == J - 1 else [Kind.FORWARD, Kind.BACKWARD]
        for kind in kinds:  # every micro-batch once per stage, in order
            assert [a.microbatch for a in actions if a.kind is kind] == list(range(n))
        assert not [a for a in actions if a.kind not in (*kinds, Kind.STEP)]
        # a step right after every k-th backward and after the last one, nowhere else
        last_kind = kinds[-1]
        steps = [i for i, a in enumerate(actions) if a.kind is Kind.STEP]
        backwards = [a.microbatch for a in actions if a.kind is last_kind]
        assert [actions[i].microbatch for i in steps] == \
            [b for b in backwards if (b + 1) % k == 0 or b == n - 1]
        for i in steps:  # the step closes its tick, after the backward it follows
            before = [a for a in actions[:i] if a.kind is last_kind]
            assert before[-1].microbatch == actions[i].microbatch
        for tick in schedule.stage_actions(s, n):
            assert all(a.kind is not Kind.STEP for a in tick[:-1])
            assert [a.kind for a in tick if a.kind is not Kind.STEP] in (
                [], [Kind.FORWARD], [Kind.BACKWARD], [Kind.BACKWARD, Kind.FORWARD],
                [Kind.FORWARD_BACKWARD])


def cells(line):
    return [c.strip() for c in line.split("|")]


def test_the_grid_cli(capsys):
    main(["--method", "petra", "--stages", "4", "--microbatches", "8", "--accumulation", "2"])
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("petra: 4 stages, 8 micro-batches, accumulation 2, 14 ticks")
    assert lines[1].startswith("legend:") and "S optimizer step" in lines[1]
    assert cells(lines[2]) == ["tick", *map(str, range(14))]
    rows = [cells(line) for line in lines[3:]]
    assert [r[0] for r in rows] == [f"rank {s}" for s in range(4)]
    # rank 0 at tick 6: backward 0, then forward 6; at tick 7 backward 1, forward 7, then the
    # step of the second backward
    assert rows[0][1:] == ["F0", "F1", "F2", "F3", "F4", "F5", "B0 F6", "B1 F7 S", "B2",
                           "B3 S", "B4", "B5 S", "B6", "B7 S"]
    assert rows[3][1:] == [".", ".", ".", "FB0", "FB1 S", "FB2", "FB3 S", "FB4", "FB5 S", "FB6",
                           "FB7 S", ".", ".", "."]
    assert len({len(line) for line in lines[2:]}) == 1  # the columns line up
    with pytest.raises(SystemExit):
        main(["--stages", "0"])


@pytest.mark.parametrize("n,k", [(10, 1), (10, 3), (9, 3), (2, 5)])
def test_updates_every_k_and_at_the_drain(n, k):
    steps = [b for b in range(n) if updates_after(b, n, k)]
    assert steps[-1] == n - 1
    assert len(steps) == -(-n // k)
    assert all((b + 1) % k == 0 for b in steps[:-1])


def test_the_grid_cli_as_a_module():
    import subprocess
    import sys
    proc = subprocess.run([sys.executable, "-m", "petra_mpi.schedule", "--method", "backprop",
                           "--stages", "2", "--microbatches", "2"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    rows = [cells(line)[1:] for line in proc.stdout.splitlines()[3:]]
    assert rows == [["F0", ".", "B0 S", "F1", ".", "B1 S"],
                    [".", "FB0 S", ".", ".", "FB1 S", "."]]


@pytest.mark.parametrize("arch,J", [("resnet18", 3), ("revnet18", 4)])
def test_backward_first_a_stage_holds_its_delay_in_fifo_entries(arch, J):
    """The backward of a tick pops its FIFO entry before the forward pushes the next one, so a
    buffered stage s holds its in-flight count d_s of inputs at its peak, not one more; a
    reversible stage and the last one (its forward_backward keeps the graph, not the input)
    hold none."""
    from tests.support.nets import make_batches, run_engine
    one = run_engine(arch, J, 1, make_batches(1))
    many = run_engine(arch, J, 1, make_batches(3 * J))
    for s, (a, b) in enumerate(zip(one, many)):
        # one micro-batch's inputs on a stage with buffered blocks, nothing on the others
        assert (a.peak_fifo_bytes > 0) == (any(a.buffered) and s < J - 1), s
        assert b.peak_fifo_bytes == schedule_for("petra", J).in_flight(s) * a.peak_fifo_bytes, s


@pytest.mark.parametrize("arch,J", [("resnet18", 3), ("revnet18", 4)])
def test_the_dry_run_counts_the_fifo_a_run_holds(arch, J):
    """--dry-run's input_fifo_bytes of each stage but the last is the peak of a real segment."""
    from tests.support.nets import make_batches, run_engine
    from petra_mpi.config import load_config
    import torch
    from petra_mpi.core.planner import Layout
    from petra_mpi.run.dryrun import stage_table
    stages = run_engine(arch, J, 1, make_batches(3 * J))
    cfg = load_config("configs/quickstart.yaml", [f"model.arch={arch}", "model.width=4",
                                                  "data.batch_size=4"])
    rows = stage_table(cfg, Layout(stages[0].partition), torch.float64, side=8)
    assert [r["input_fifo_bytes"] for r in rows[:-1]] == [s.peak_fifo_bytes for s in stages[:-1]]
    assert any(r["input_fifo_bytes"] for r in rows)


class SlowerHops(PetraSchedule):
    """A toy schedule: PETRA's order with three ticks a hop on the way back instead of two, so
    stage s holds 3(J-1-s) micro-batches in flight, not 2(J-1-s)."""
    method = "toy"

    def in_flight(self, stage):
        return 3 * (self.J - 1 - stage)


def test_every_reader_of_the_in_flight_count_takes_the_schedules(monkeypatch, capsys):
    """A schedule with another in-flight count changes the stages' window (FIFOs, kept graphs),
    the delay the optimizers compensate, the windows the kept plan fills and the dry run's FIFO
    bytes and delays, with no other change: each reads it from the schedule."""
    import dataclasses
    import torch
    from petra_mpi.config import load_config
    from petra_mpi.core.planner import Layout, plan_layout
    from petra_mpi.engines.build import build_workers
    from petra_mpi.models import NetSpec
    from petra_mpi.run.dryrun import report, stage_table
    from tests.support.nets import stages_of
    monkeypatch.setitem(SCHEDULES, "toy", SlowerHops)
    J, k, split = 4, 2, [1, 1, 2, 6]
    toy = [9, 6, 3, 0]
    stages = stages_of("revnet18", 4, 10, J, partition=split, method="toy")
    assert [s.window for s in stages] == toy
    workers = build_workers(stages, accumulation=k, method="toy")
    assert [w.optimizer.delay for w in workers] == [d / k for d in toy]
    net = NetSpec("revnet18", 4, 10, image_size=8)
    layout = plan_layout(net, J, partition=split, budget="auto", batch_size=2, method="toy")
    assert layout.plan.windows == toy
    cfg = load_config("configs/quickstart.yaml", ["model.width=4", "data.batch_size=4"])
    slower = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, method="toy"))
    rows = {c.train.method: stage_table(c, Layout(split), torch.float64, side=8)
            for c in (cfg, slower)}
    petra = [2 * (J - 1 - s) for s in range(J)]
    for s in range(J - 1):  # the same inputs, held for 3 ticks a hop instead of 2
        assert rows["toy"][s]["input_fifo_bytes"] * petra[s] == (
            rows["petra"][s]["input_fifo_bytes"] * toy[s])
    assert any(r["input_fifo_bytes"] for r in rows["toy"])
    report(slower, J)
    lines = capsys.readouterr().out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("delays"))
    delays = [line.split()[:3] for line in lines[start + 2:start + 2 + J]]
    assert [(int(d), float(u)) for _, d, u in delays] == [(d, d / k) for d in toy]
