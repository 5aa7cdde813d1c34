"""The performance pieces: the balanced split on given costs, the performance model's arithmetic,
the receive-buffer pool and the measured split in a run (the benchmarks are in
tests/e2e/test_bench.py)."""
import copy
import json
import subprocess
import sys

import pytest
import torch

from petra_mpi.perf import model as perfmodel
from petra_mpi.core.blockcost import BlockCosts, measure_block_costs
from petra_mpi.comm.transport import HostPool
from petra_mpi.models import NetSpec, build_blocks
from petra_mpi.core.partition import balanced_partition
from petra_mpi.core.planner import plan_layout
from petra_mpi.core.stages import Stage
from tests.support.paths import ROOT


REVNET18 = NetSpec("revnet18", 4, 10)


def test_balanced_split_on_measured_costs_is_deterministic():
    # Middle-stage costs 4 per block, 3 in the last stage: 10 blocks over 2 stages.
    costs = BlockCosts(forward=[1.0] * 10, backward=[3.0] * 10, last=[3.0] * 10,
                       step=[0.0] * 10, output_bytes=[1] * 10)
    first = plan_layout(REVNET18, 2, costs=costs).split
    assert first == [4, 6]  # 16 vs 18; [5, 5] would be 20 vs 15
    assert all(plan_layout(REVNET18, 2, costs=costs).split == first for _ in range(3))
    # A slow last block moves the cut towards the end: 32 vs 33 (and [9, 1]: 36 vs 30).
    slow_head = BlockCosts([1.0] * 10, [3.0] * 10, [3.0] * 9 + [30.0], [0.0] * 10, [1] * 10)
    assert plan_layout(REVNET18, 2, costs=slow_head).split == [8, 2]
    # The last stage counted with its own costs, not a factor.
    assert balanced_partition([4, 4, 4, 4], 2, last_costs=[1, 1, 1, 1]) == [1, 3]
    assert balanced_partition([4, 4, 4, 4], 2) == [2, 2]


def test_near_tie_goes_to_the_split_that_stores_less():
    # [3, 2] is fastest (6 vs 6.1); [2, 3] is within TIE_TOLERANCE and keeps block 2's stored
    # input out of stage 0's FIFO (2 deep at J = 2): it wins once stores are given.
    middle, last, stored = [2, 2, 2, 2, 2], [2, 2, 2, 2, 2.1], [0, 0, 9, 0, 0]
    held = dict(stored=stored, depths=[2, 0])  # PETRA's in-flight counts at J = 2
    assert balanced_partition(middle, 2, last_costs=last) == [3, 2]
    assert balanced_partition(middle, 2, last_costs=last, **held) == [2, 3]
    # Outside the tolerance (6.5 vs 6) speed wins whatever is stored.
    assert balanced_partition(middle, 2, last_costs=[2, 2, 2, 2, 2.5], **held) == [3, 2]
    # Equal stores: the fastest of the ties, as without stores.
    assert balanced_partition(middle, 2, last_costs=last, stored=[1, 0, 0, 0, 0],
                              depths=[2, 0]) == [3, 2]
    # Deeper stages hold fewer micro-batches: at J = 3, stage 0 holds 4, stage 1 holds 2.
    assert balanced_partition([1] * 6, 3, last_costs=[1] * 6) == [2, 2, 2]
    assert balanced_partition([1] * 6, 3, last_costs=[1] * 6, stored=[0, 0, 0, 0, 0, 0],
                              depths=[4, 2, 0]) == [2, 2, 2]


def test_measured_split_stores_the_inputs_of_non_reversible_blocks():
    # RevNet18: stem, rev, rev, down, rev, down, rev, down, rev, head. Middle stages cost 4 per
    # block, the last 16/7 per block: [3, 7] and [4, 6] tie at 16; only [4, 6] puts the first
    # downsampling block's input (block 2's output, 1000 bytes) into stage 0's FIFO.
    blocks = build_blocks("revnet18", 4, 10)
    out = [1000] * 10
    costs = BlockCosts([1.0] * 10, [3.0] * 10, [16 / 7] * 10, [0.0] * 10, out, input_bytes=10)
    assert plan_layout(REVNET18, 2, costs=costs).split == [3, 7]
    # A reversible block's input is never stored: [5, 5] (20) ties with [4, 6] (20.4) and adds
    # only block 4 (reversible, with a huge input) to stage 0, so the faster [5, 5] stays.
    out = [1000, 1000, 1000, 10**6, 1000, 1000, 1000, 1000, 1000, 1000]
    costs = BlockCosts([1.0] * 10, [3.0] * 10, [3.4] * 10, [0.0] * 10, out, input_bytes=10)
    assert plan_layout(REVNET18, 2, costs=costs).split == [5, 5]
    assert [b.reversible for b in blocks[2:5]] == [True, False, True]


def test_measured_block_costs_leave_the_model_untouched():
    blocks = build_blocks("revnet18", 4, 10)
    before = [t.clone() for b in blocks for t in list(b.parameters()) + list(b.buffers())]
    costs = measure_block_costs(blocks, (3, 8, 8), 4, 10, repeats=1, time_kept=True)
    after = [t for b in blocks for t in list(b.parameters()) + list(b.buffers())]
    assert all(torch.equal(x, y) for x, y in zip(before, after))
    assert all(p.grad is None for b in blocks for p in b.parameters())
    assert len(costs.forward) == len(costs.backward) == len(costs.last) == len(costs.kept) == 10
    assert all(c > 0 for c in costs.forward + costs.backward + costs.last + costs.kept)
    assert costs.output_bytes[-1] == 4 * 10 * 4  # the logits, float32


class InputGradProbe(torch.nn.Module):
    """A buffered block that records, at every forward under autograd, whether its input asks
    for a gradient (in `calls`, shared by its deep copies)."""
    reversible = False

    def __init__(self, name, layer, calls):
        super().__init__()
        self.name, self.layer, self.calls = name, layer, calls

    def __deepcopy__(self, memo):  # the timing copies the blocks: keep recording into `calls`
        return InputGradProbe(self.name, copy.deepcopy(self.layer, memo), self.calls)

    def forward(self, x):
        if torch.is_grad_enabled():
            self.calls.append((self.name, x.requires_grad))
        return self.layer(x)


def test_first_block_is_costed_as_stage_0_runs_it():
    """Stage 0's backward computes no gradient for the images; the costing of the first block
    must not either (else the measured split puts too little on stage 0), while a later block's
    backward, as on any other stage, does."""
    calls = []
    stem = InputGradProbe("stem", torch.nn.Conv2d(3, 4, 1), calls)
    head = InputGradProbe("head", torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(16, 10)),
                          calls)
    x = torch.randn(2, 3, 2, 2)
    stage0 = Stage([stem], index=0, num_stages=2)  # what training runs
    stage0.backward(None, torch.ones_like(stage0(x)))
    trained = set(calls)
    calls.clear()
    measure_block_costs([stem, head], (3, 2, 2), 2, 10, repeats=1)
    assert trained == {("stem", False)}
    assert {c for c in calls if c[0] == "stem"} == trained
    assert {c for c in calls if c[0] == "head"} == {("head", True)}


def equal_stages(J, c=1.0, nbytes=0):
    return [perfmodel.StageCosts(forward=c / 4, backward=3 * c / 4, forward_backward=c,
                                 step=0.0,
                                 out_bytes=nbytes, down_bytes=2 * nbytes) for _ in range(J)]


FREE = perfmodel.Link(0.0, float("inf"))


@pytest.mark.parametrize("J", [2, 4, 10])
def test_model_equal_stages_give_J_times(J):
    n = 400
    one = perfmodel.predict_images_per_s("petra", equal_stages(1, c=J), FREE, n, 1)
    many = perfmodel.predict_images_per_s("petra", equal_stages(J), FREE, n, 1)
    # J times, less the fill and drain: n micro-batches in at most n + 2(J-1) ticks.
    assert J * n / (n + 2 * (J - 1)) <= many / one <= J + 1e-9
    # Backprop has one stage busy at a time: no speed-up at all.
    bp = perfmodel.predict_images_per_s("backprop", equal_stages(J), FREE, n, 1)
    assert bp == pytest.approx(one, rel=1e-12)


def test_model_one_stage_twice_as_slow_halves_it():
    n, J = 400, 4
    costs = equal_stages(J)
    fast = perfmodel.predict_images_per_s("petra", costs, FREE, n, 1)
    costs[1] = perfmodel.StageCosts(0.5, 1.5, 2.0, 0.0, 0, 0)
    slow = perfmodel.predict_images_per_s("petra", costs, FREE, n, 1)
    assert slow / fast == pytest.approx(0.5, rel=0.02)


def test_model_textbook_formulas():
    J, m, f, b = 4, 8, 1.0, 2.0
    costs = [perfmodel.StageCosts(f, b, f + b, 0.0, 0, 0) for _ in range(J)]
    # 1F1B and GPipe: (m + J - 1)(f + b) per step with equal stages.
    for method in ("1f1b", "gpipe"):
        orders = (perfmodel.one_f_one_b_order(J, m) if method == "1f1b"
                  else perfmodel.gpipe_order(J, m))
        assert perfmodel.simulate(orders, costs, FREE) == pytest.approx((m + J - 1) * (f + b))
    # Backprop: every micro-batch crosses 2(J-1) links, each costing its latency.
    link = perfmodel.Link(0.25, float("inf"))
    orders = perfmodel.petra_orders("backprop", J, m)
    no_link = perfmodel.simulate(orders, costs, FREE)
    assert perfmodel.simulate(orders, costs, link) == pytest.approx(no_link + m * 2 * (J - 1)
                                                                     * 0.25)


def test_model_prediction_over_a_busy_link_runs_at_the_links_pace():
    # two stages of 1 s per tick; each backward of stage 1 sends 6 bytes (x̃ and δ) down a link of
    # 1 byte/s: with one message at a time on the wire a long segment goes at one micro-batch
    # per 6 s (the forward direction carries 3 per micro-batch, half as much)
    n, batch = 200, 4
    costs = [perfmodel.StageCosts(0.5, 0.5, 1.0, 0.0, out_bytes=3, down_bytes=6)
             for _ in range(2)]
    link = perfmodel.Link(0.0, 1.0)
    busy = perfmodel.predict_images_per_s("petra", costs, link, n, batch, busy_links=True)
    assert busy == pytest.approx(n * batch / (6 * n), rel=0.02)
    # without busy links the same messages only arrive late, however many are under way
    assert perfmodel.predict_images_per_s("petra", costs, link, n, batch) > 1.05 * busy


def test_model_detects_a_deadlocking_order():
    costs = equal_stages(2)
    with pytest.raises(ValueError, match="deadlock"):
        perfmodel.simulate([[("backward", 0)], [("forward", 0)]], costs, FREE)


def test_host_pool_reuses_a_buffer_only_once_released():
    pool = HostPool()
    a = pool.tensor((4, 3), torch.float32)
    view = a[:2]
    del a
    b = pool.tensor((4, 3), torch.float32)
    assert b.data_ptr() != view.data_ptr()  # a view keeps the first buffer in use
    address = b.data_ptr()
    del b
    c = pool.tensor((4, 3), torch.float32)
    assert c.data_ptr() == address  # released: reused
    assert pool.tensor((2, 3), torch.float32).data_ptr() not in (c.data_ptr(), view.data_ptr())


@pytest.mark.extended  # a trainer subprocess; the measured split's arithmetic is tested above
def test_training_prints_the_measured_split(tmp_path):
    cmd = [sys.executable, "-m", "petra_mpi.train", "configs/quickstart.yaml", "--set",
           f"run.out_dir={tmp_path}", "--set", "train.epochs=1", "--set", "train.limit_batches=4",
           "--set", "data.synthetic_train=256", "--set", "data.synthetic_val=64", "--set",
           "model.width=4", "--set", "run.progress=false", "--set", "model.stages=3"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "stages balanced by measured cost" in proc.stderr
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["stages"] == 3


def test_bench_data_cpu_seconds_count_worker_processes():
    """Images per CPU-second must count the decode workers: a process below this one that is
    still running (not yet waited for) and its own child are both in cpu_seconds(). The
    grandchild burns 0.5 s: counted, the figure is at least 0.48 s (/proc gives user and system
    time each rounded down to 10 ms; measured 0.513 to 0.533 s with the other two processes),
    left out it is the 0.03 s or so of those two. The bound lies midway (against 0.5 s, the
    smallest figure measured has a margin of 0.013 s, which the rounding alone can take)."""
    from petra_mpi.perf.bench.data import cpu_seconds
    burn = ("import sys, time\n"
            "while time.process_time() < 0.5: pass\n"
            "print('burnt', flush=True)\n"
            "sys.stdin.read()\n")
    nest = f"import subprocess, sys\nsubprocess.run([sys.executable, '-c', {burn!r}])\n"
    before = cpu_seconds()
    child = subprocess.Popen([sys.executable, "-c", nest], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline() == "burnt\n"  # the grandchild burnt 0.5 s and waits
        assert cpu_seconds() - before > 0.25
    finally:
        child.stdin.close()
        child.wait(timeout=60)


def test_steady_state_rate_leaves_out_the_fill_and_the_drain():
    from petra_mpi.perf.bench.peers import steady_images_per_s
    # J = 3: stage 0 runs forwards only for d_0 = 4 ticks (0.1 s each), then a forward and a
    # backward per tick (0.3 s); 16 micro-batches, k = 4: the steady window is the forwards of
    # micro-batches 4 to 12 (two updates), 8 ticks of 0.3 s
    starts, t = {}, 0.0
    for b in range(16):
        starts[b] = t
        t += 0.1 if b < 4 else 0.3
    assert steady_images_per_s(starts, 3, 4, 64) == pytest.approx(8 * 64 / (8 * 0.3))
    # not one update of steady state: no figure
    assert steady_images_per_s({b: b for b in range(8)}, 3, 4, 64) is None


def test_waterfall_steps_add_up_and_kept_blocks_shorten_the_model():
    from petra_mpi.perf.bench.waterfall import kept_stage_costs, ours_model, waterfall
    costs = BlockCosts(forward=[1.0] * 4, backward=[3.0] * 4, last=[3.0] * 4, step=[0.0] * 4,
                       output_bytes=[1] * 4, kept=[3.0] * 4)
    # stage 0 of [2, 2] keeps block 1 for 1 of every d_0 = 2 micro-batches: saves (4 - 3) / 2
    plain = kept_stage_costs(costs, [2, 2], None, [2, 0])
    kept = kept_stage_costs(costs, [2, 2], [[0, 1], [0, 0]], [2, 0])
    assert plain[0].backward - kept[0].backward == pytest.approx(0.5)
    assert kept[1] == plain[1]
    # stage 0 is the slower one (8 per micro-batch against 6): keeping shortens the run
    (t_plain, busy), (t_kept, _) = (ours_model("petra", costs, [2, 2], k, 8, 2)
                                    for k in (None, [[0, 1], [0, 0]]))
    assert t_kept < t_plain and busy == [8 * 8, 8 * 6]
    # the steps go from the model's makespan to the measured wall time on the busiest rank
    measured = [(2 * 70.0, 2 * 66.0, 2 * 1.0), (2 * 69.0, 2 * 50.0, 2 * 15.0)]
    w = waterfall(2, 8, t_plain, busy, measured)
    assert w["rank"] == 0 and w["wall_s"] == 70.0
    assert sum(w["steps_s"].values()) == pytest.approx(70.0)
    assert w["steps_s"]["compute above isolated"] == pytest.approx(66.0 - 64.0)
