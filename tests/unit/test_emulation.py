"""The emulated pipeline's pieces (petra_mpi/perf/emulation.py): cost profiles, waiting stages that
match the real stages' shapes and held memory, and the performance model's framework costs and
speed-up bound (the mpirun run of `bench emulate` is in tests/e2e/test_bench.py)."""
import json

import pytest
import torch

from petra_mpi.perf import emulation
from petra_mpi.perf import model as perfmodel
from petra_mpi.core.blockcost import BlockCosts
from petra_mpi.perf.emulation import (Clock, Profile, WaitingStage, balanced_profile,
                                      file_profile, paper_profile, probe_shapes)
from tests.support.nets import stages_of
from petra_mpi.comm.mpi import MPIRequest
from petra_mpi.comm.transport import Transport


@pytest.mark.parametrize("arch", ["revnet18", "revnet34"])
def test_paper_profile_reproduces_table5_with_one_block_per_stage(arch):
    profile = paper_profile(arch)
    n = len(profile.forward)
    costs = profile.petra_costs([1] * n, 1)
    work = costs.stage_seconds([1] * n)  # the paper's split: one block per GPU
    table = emulation.PAPER_TABLE5_MS[arch]
    assert 1e3 * sum(work) == pytest.approx(table["backprop"])  # every stage in series
    assert 1e3 * max(work) == pytest.approx(table["petra"])     # the slowest stage
    # a middle block works 4 forwards (forward, rebuild, VJP of 2), the last 3 (no rebuild)
    assert costs.backward[1] == pytest.approx(3 * costs.forward[1])
    assert costs.last[-1] == pytest.approx(3 * profile.forward[-1])
    assert profile.rebuild[-1] == 0.0


def test_the_balanced_profile_spreads_the_papers_total_evenly():
    profile = balanced_profile("revnet18")
    n = len(profile.forward)
    work = profile.petra_costs([1] * n, 1).stage_seconds([1] * n)
    assert 1e3 * sum(work) == pytest.approx(emulation.PAPER_TABLE5_MS["revnet18"]["backprop"])
    # every middle stage the same (4 forwards' worth), the last 3/4 of that
    assert max(work[:-1]) == pytest.approx(min(work[:-1]))
    assert work[-1] == pytest.approx(0.75 * work[0])


def test_file_profile_round_trip_and_errors(tmp_path):
    path = tmp_path / "p.json"
    path.write_text(json.dumps({"arch": "revnet18", "forward": [1.0, 2.0], "rebuild": [1.0, 0.5],
                                "backward": [2.0, 4.0], "step": [0.1, 0.2]}))
    p = file_profile(path)
    assert p.weight == [1.0, 2.0]  # half of the backward by default
    petra = p.petra_costs([10, 20], 5)
    plain = p.plain_costs([10, 20], 5)
    assert petra.backward == [3.0, 4.5] and petra.last == [3.0, 6.0]  # rebuild + VJP
    assert plain.backward == [2.0, 4.0] and plain.step == [0.1, 0.2]
    path.write_text(json.dumps({"arch": "revnet18", "forward": [1.0], "rebuild": [1.0],
                                "backward": [2.0], "speed": 3}))
    with pytest.raises(ValueError, match="speed"):
        file_profile(path)
    with pytest.raises(ValueError, match="one entry per block"):
        Profile("revnet18", [1.0, 2.0], [1.0], [2.0, 2.0])


def test_a_scaled_profile_multiplies_every_cost_and_says_so():
    p = Profile("revnet18", [1.0, 2.0], [1.0, 0.5], [2.0, 4.0], step=[0.1, 0.2],
                weight=[0.5, 1.0], source="file x")
    q = p.scaled(4)
    assert (q.forward, q.rebuild, q.backward, q.step, q.weight) == (
        [4.0, 8.0], [4.0, 2.0], [8.0, 16.0], [0.4, 0.8], [2.0, 4.0])
    assert q.source == "file x, every cost x4" and p.scaled(1).source == "file x"
    assert p.forward == [1.0, 2.0]  # the original stays


@pytest.mark.parametrize("args,message", [(["--cost-scale", "0"], "above 0"),
                                          (["--cost-scale", "2", "--real"], "--real")])
def test_bench_emulate_refuses_a_cost_scale_it_cannot_use(args, message, capsys):
    from petra_mpi.perf.bench.emulate import parse_args
    with pytest.raises(SystemExit):
        parse_args(args)
    assert message in capsys.readouterr().err


def test_waiting_stages_match_the_real_stages_shapes_and_fifo_bytes():
    """Every message a waiting stage makes has the real stage's shape, it needs the rebuilt
    input where the real one does, and it holds what the real FIFOs hold."""
    J, batch, width = 3, 4, 4
    real = stages_of("revnet18", width, 10, J, partition=[2, 4, 4])
    shapes = probe_shapes("revnet18", width)
    x = torch.randn(batch, 3, 32, 32)
    labels = torch.zeros(batch, dtype=torch.int64)
    first = 0
    clock = Clock(scale=0.0)  # no waiting here: shapes only
    for s, stage in enumerate(real):
        n = stage.partition[s]
        fake = WaitingStage(s, J, shapes, first, [(0.0, 0.0, 0.0)] * n, batch, clock=clock)
        first += n
        assert fake.needs_rebuilt_input == stage.needs_rebuilt_input
        if stage.is_last:
            _, logits, gx = stage.forward_backward_loss(x, labels)
            _, f_logits, f_gx = fake.forward_backward_loss(x, labels)
            assert f_logits.shape == logits.shape and f_gx.shape == gx.shape
            continue
        y = stage(x)
        stage(x)  # two micro-batches in flight
        assert fake(x).shape == y.shape
        fake(x)
        assert fake.peak_held_bytes == stage.peak_fifo_bytes
        rebuilt, gx = stage.backward(y, torch.ones_like(y))
        f_rebuilt, f_gx = fake.backward(y, torch.ones_like(y))
        assert f_rebuilt.shape == rebuilt.shape
        assert (f_gx is None) == (gx is None) and (gx is None or f_gx.shape == gx.shape)
        x = y.detach()


def test_a_wait_polls_between_sleeps_and_a_zero_scale_does_not_wait(monkeypatch):
    sleeps = []
    monkeypatch.setattr(emulation.time, "sleep", lambda s: sleeps.append(s) or _advance(s))
    now = [0.0]

    def _advance(s):
        now[0] += s

    def _read():  # reading the clock takes a microsecond, so that a spin ends
        now[0] += 1e-6
        return now[0]
    monkeypatch.setattr(emulation.time, "perf_counter", _read)
    polls = []
    clock = Clock()
    clock.poll = lambda: polls.append(1)
    cost = 4 * emulation.SLICE_S
    clock.wait(cost)
    assert all(s <= emulation.SLICE_S for s in sleeps)
    # it sleeps all but the last WAKE_S, which it spins through, and ends on time
    assert cost - emulation.WAKE_S - 1e-4 < sum(sleeps) <= cost - emulation.WAKE_S
    assert len(polls) == len(sleeps) >= 4 and clock.busy == pytest.approx(cost, abs=1e-5)
    slept = len(sleeps)
    clock.scale = 0.0
    clock.wait(1.0)
    assert len(sleeps) == slept and clock.busy == pytest.approx(cost, abs=1e-5)


class _Request:
    """An MPI request (what mpi4py gives) that completes at its tests_before_done-th test."""

    def __init__(self, tests_before_done):
        self.left, self.waited = tests_before_done, False

    def Test(self, status=None):
        self.left -= 1
        return self.left < 0

    def Wait(self, status=None):
        self.waited = True


def test_transport_wait_sleeps_between_tests_only_when_asked(monkeypatch):
    monkeypatch.delenv("PETRA_MPI_POLL_SLEEP", raising=False)
    plain = Transport(torch.device("cpu"), False)
    request = _Request(3)
    plain.wait(MPIRequest(request))
    assert request.waited  # MPI's own Wait by default
    monkeypatch.setenv("PETRA_MPI_POLL_SLEEP", "0.0001")
    sleeping = Transport(torch.device("cpu"), False)
    assert sleeping.poll_sleep == 0.0001
    request = _Request(3)
    sleeping.wait(MPIRequest(request))
    assert not request.waited and request.left == -1  # tested until done, never Wait


def _stage(fwd, bwd, out_bytes=0, weight=0.0):
    return perfmodel.StageCosts(fwd, bwd, fwd + bwd, 0.0, out_bytes, out_bytes, weight)


def test_framework_costs_delay_messages_and_steps():
    free = perfmodel.Link(0.0, float("inf"))
    orders = [[("forward", 0), ("step", 0)], [("forward", 0), ("step", 0)]]
    costs = [_stage(1.0, 0.0), _stage(1.0, 0.0)]
    base = perfmodel.simulate(orders, costs, free)
    assert base == 2.0
    assert perfmodel.simulate(orders, costs, free, perfmodel.Framework(0.5, 0.0)) == 2.5
    assert perfmodel.simulate(orders, costs, free, perfmodel.Framework(0.0, 0.25)) == 2.25
    # an operation's own cost holds its rank: the second forward starts after the first's
    assert perfmodel.simulate(orders, costs, free, perfmodel.Framework(0.0, 0.0, 0.5)) == 3.0
    # and the step is not an operation that pays it
    one = [[("forward", 0), ("step", 0)]]
    assert perfmodel.simulate(one, costs[:1], free, perfmodel.Framework(0.0, 0.0, 0.5)) == 1.5


def test_fit_framework_recovers_the_costs_that_made_the_runs():
    free = perfmodel.Link(1e-4, 1e9)
    zero = [_stage(0.0, 0.0, 1000)] * 4
    cases = [perfmodel.gpipe_order(4, 4), perfmodel.one_f_one_b_order(4, 8),
             perfmodel.petra_orders("petra", 4, 12), perfmodel.gpipe_order(4, 16),
             perfmodel.petra_orders("backprop", 4, 4, 4), perfmodel.one_f_one_b_order(4, 4)]
    for truth in (perfmodel.Framework(2e-3, 7e-3, 1e-3), perfmodel.Framework(2e-3, 7e-3),
                  perfmodel.Framework(0.0, 0.0, 3e-3)):
        made = [perfmodel.simulate(o, zero, free, truth) for o in cases]
        fitted = perfmodel.fit_framework(cases, [zero] * len(cases), [free] * len(cases), made)
        assert fitted.per_message == pytest.approx(truth.per_message, abs=1e-9)
        assert fitted.per_step == pytest.approx(truth.per_step, abs=1e-9)
        assert fitted.per_op == pytest.approx(truth.per_op, abs=1e-9)


def test_split_backward_waits_for_its_inputs():
    """Zero bubble's backward_input needs the next stage's, backward_weight its own input part."""
    free = perfmodel.Link(0.0, float("inf"))
    costs = [_stage(1.0, 2.0, weight=0.5), _stage(1.0, 2.0, weight=0.5)]
    orders = [[("forward", 0), ("backward_input", 0), ("backward_weight", 0)],
              [("forward", 0), ("backward_input", 0), ("backward_weight", 0)]]
    # s0 F [0,1]; s1 F [1,2], I [2,3.5], W [3.5,4]; s0 I [3.5,5], W [5,5.5]
    assert perfmodel.simulate(orders, costs, free) == 5.5


def test_speedup_bound_of_a_split():
    # per block: forward 1 and backward 3 in a middle stage, 4 in the last
    costs = BlockCosts([1.0] * 4, [3.0] * 4, [4.0] * 4, [0.0] * 4, [0] * 4)
    even = perfmodel.speedup_bound(costs, [2, 2], 1000)
    assert even["steady"] == 2.0 and even["segment"] == pytest.approx(2.0, rel=0.01)
    uneven = perfmodel.speedup_bound(costs, [1, 3], 1000)
    assert uneven["steady"] == pytest.approx(16 / 12)
    short = perfmodel.speedup_bound(costs, [2, 2], 4)
    assert 1.0 < short["segment"] < even["segment"]  # fill and drain cost a short segment


def test_steady_rate_counts_from_the_first_forward_paced_by_the_full_pipeline():
    from petra_mpi.perf.bench.emulate import _steady_rate
    J = 3  # forwards 0-3 run free (fill), 4 waits for the first gradient, then one per second
    starts = [0.0, 0.1, 0.2, 0.3, 0.4, 5.0, 6.0, 7.0, 8.0]
    assert _steady_rate(starts, J) == pytest.approx(1.0)
    assert _steady_rate(starts[:6], J) is None  # no full tick measured


def test_bench_pipeline_scales_the_timed_block_costs_to_the_stage_costs_of_its_runs():
    from petra_mpi.perf.bench.pipeline import scaled_to
    costs = BlockCosts([1.0] * 4, [3.0] * 4, [4.0] * 4, [0.5] * 4, [7] * 4, 3, [2.0] * 4)
    scaled = scaled_to(costs, [2, 2], [4.0, 16.0])  # stages timed at 8 and 8, ran at 4 and 16
    assert scaled.stage_seconds([2, 2]) == [4.0, 16.0]
    assert scaled.forward == [0.5, 0.5, 2.0, 2.0] and scaled.step == [0.25, 0.25, 1.0, 1.0]
    assert scaled.kept == [1.0, 1.0, 4.0, 4.0]
    assert scaled.output_bytes == [7] * 4 and scaled.input_bytes == 3
    assert perfmodel.speedup_bound(scaled, [2, 2], 1000)["steady"] == pytest.approx(20 / 16)


def test_a_runs_figures_are_its_last_json_line_whatever_follows(tmp_path):
    from petra_mpi.perf.bench.common import last_json_line
    log = tmp_path / "run.txt"
    log.write_text('petra_mpi: 2 ranks\n{"framework": 1}\n{"framework": 2}\n'
                   '{"cut off": \n12.3 s\n')
    assert last_json_line(log) == {"framework": 2}
    log.write_text("petra_mpi: 2 ranks\nno figures\n")
    with pytest.raises(ValueError, match="no line of JSON figures"):
        last_json_line(log)


class _RecordingClock(Clock):
    """Records every wait instead of waiting."""

    def __init__(self):
        super().__init__()
        self.waits = []

    def wait(self, seconds):
        self.waits.append(seconds)


def test_a_waiting_stage_follows_its_kept_plan():
    """A kept micro-batch skips its block's rebuild in the backward and holds the block's kept
    bytes from its forward to its backward; which micro-batches keep is Stage's rule (b mod d_s
    below the plan's count)."""
    shapes = probe_shapes("revnet18", 4)
    clock = _RecordingClock()
    # stage 1 of 3 (d_1 = 2) with blocks 1 and 2, both reversible
    stage = WaitingStage(1, 3, shapes, 1, [(1.0, 3.0, 0.0), (2.0, 6.0, 0.0)], 4, clock=clock,
                         rebuild=[1.0, 2.0])
    assert stage.window == 2 and stage.fifo_bytes == [0, 0]
    stage.set_kept([1, 2], [100, 1000])
    x = torch.zeros(4, *shapes.inputs[1])
    for b in range(2):  # both in flight: block 1 keeps micro-batch 0, block 2 both
        stage(x, b)
    assert stage.held == stage.peak_held_bytes == 100 + 2 * 1000
    assert clock.waits == [1.0, 2.0, 1.0, 2.0]  # a kept forward costs a forward
    clock.waits.clear()
    y = torch.zeros(4, *shapes.outputs[2])
    stage.backward(y, y, 0)
    assert clock.waits == [3.0 - 1.0, 6.0 - 2.0] and stage.held == 1000
    stage.backward(y, y, 1)
    assert clock.waits[2:] == [3.0, 6.0 - 2.0] and stage.held == 0
    stage.reset_peak()
    assert stage.peak_held_bytes == 0
    with pytest.raises(ValueError, match="keeps 0 to 2"):
        stage.set_kept([3, 0], [100, 1000])


def test_waiting_stages_with_a_kept_plan_hold_what_the_real_stages_hold():
    """With every reversible block keeping all its in-flight micro-batches and every buffered
    one all but one (its FIFO holds the other's input), a waiting stage given the probed kept
    bytes holds at its peak what the real stage holds: FIFOs and kept graphs."""
    J, batch, width, split = 3, 4, 4, [3, 4, 3]
    real = stages_of("revnet18", width, 10, J, partition=split)
    shapes = probe_shapes("revnet18", width)
    sizes, shared = emulation.kept_sizes("revnet18", width, batch, split)
    assert shared[0]  # the stem's saved ReLU output is the next block's input: held once
    # a micro-batch of its own for each in flight (a stage counts a storage that several of its
    # kept graphs hold once, as their one input would be)
    xs = [torch.randn(batch, 3, 32, 32) for _ in range(real[0].window)]
    first = 0
    for s, stage in enumerate(real[:-1]):
        kept = [stage.window - stage.buffered[i] for i in range(len(stage.blocks))]
        assert any(stage.buffered) and all(z is not None for z in sizes[s])
        stage.set_kept(kept)
        fake = WaitingStage(s, J, shapes, first, [(0.0, 0.0, 0.0)] * split[s], batch,
                            clock=Clock(scale=0.0))
        fake.set_kept(kept, sizes[s], shared[s])
        first += split[s]
        with torch.no_grad():
            outputs = [stage(xs[b], b) for b in range(stage.window)]
        for b in range(stage.window):
            fake(xs[b], b)
        assert fake.peak_held_bytes == stage.peak_fifo_bytes + stage.peak_kept_bytes > 0
        # one of the window's micro-batches in each FIFO
        fifo = emulation.fifo_bytes(shapes, split, batch)[s]
        assert stage.peak_fifo_bytes * stage.window == fifo > 0
        xs = outputs


def test_the_kept_plan_of_the_paper_profile():
    """RevNet-18 with the paper's Table 5 costs at J = 10: one stage does a third of the work,
    so without a limit the plan keeps that stage's block for all its d_1 = 16 micro-batches and
    nothing elsewhere (the others are faster anyway), and PETRA's bound rises by 4/3, a rebuild
    of 4 forwards' worth; at budget 0 nothing is kept."""
    from petra_mpi.perf.bench.emulate import _bound, kept_stage_costs
    profile, J = paper_profile("revnet18"), 10
    split = [1] * J
    sizes, _ = emulation.kept_sizes("revnet18", 8, 16, split)
    stages = perfmodel.stage_costs(profile.petra_costs([0] * J, 0), split)
    unlimited = emulation.kept_plan(profile, split, sizes, [None] * J)
    assert unlimited.kept == [[0], [16]] + [[0]] * (J - 2)
    assert unlimited.relative_time == pytest.approx(0.75)
    kept = kept_stage_costs(stages, unlimited.kept, profile.rebuild, split)
    assert _bound(kept) / _bound(stages) == pytest.approx(4 / 3)
    none = emulation.kept_plan(profile, split, sizes, [0] * J)
    assert none.kept == [[0]] * J and none.relative_time == 1.0
    # a budget for 9 of block 1's micro-batches keeps 9: 4 - 9/16 forwards' worth on stage 1
    nine = emulation.kept_plan(profile, split, sizes, [9 * sizes[1][0]] * J)
    assert nine.kept[1] == [9] and nine.kept_bytes[1] == 9 * sizes[1][0]
    assert nine.relative_time == pytest.approx((4 - 9 / 16) / 4)


def test_a_checkpointed_plain_stage_holds_block_inputs_and_recomputes():
    shapes = probe_shapes("revnet18", 4)
    plain = emulation.WaitingPlainStage(shapes, [1, 2], 1.0, 2.0, 0.5, 4)
    ckpt = emulation.WaitingPlainStage(shapes, [1, 2], 1.0, 2.0, 0.5, 4, checkpointed=True)
    assert plain.input_grad_s == ckpt.input_grad_s == 1.5
    assert plain.weight_grad_s == 0.5 and ckpt.weight_grad_s == 0.5 + 1.0  # + the recomputation
    inputs = sum(4 * 4 * torch.Size(shapes.inputs[b]).numel() for b in (1, 2))
    assert ckpt.held_per_microbatch == inputs < plain.held_per_microbatch
    ckpt.peak_in_flight = 3
    assert ckpt.peak_held_bytes == 3 * inputs + 4 * max(shapes.saved[1], shapes.saved[2])


def test_the_pareto_front_keeps_the_runs_nothing_beats():
    from petra_mpi.perf.bench.emulate import pareto_front
    points = [("a", 10, 100.0), ("b", 20, 150.0), ("c", 20, 120.0), ("d", 30, 150.0),
              ("e", 5, 50.0), ("f", 40, 160.0), ("g", 10, 100.0)]
    # c: b holds as much and is faster; d: b is as fast and holds less; a and g tie
    assert pareto_front(points) == ["a", "b", "e", "f", "g"]
