"""Kept blocks under a memory budget (docs/design.md §1, invariant 7): budget 0 is PETRA, a block
keeping every micro-batch trains as `delayed` with buffer_inputs and stash_weights, a mixed plan
as the per-micro-batch mixture of the two rules, the planner's bytes are what the graphs hold, and
the config key's errors are one clear line (under mpirun: tests/mpi/test_kept_blocks_mpi.py)."""
import dataclasses

import pytest
import torch

from petra_mpi.config import ConfigError, load_config
from petra_mpi.engines.build import StageSpec, build_stages, build_workers
from petra_mpi.engines.local import LocalEngine
from petra_mpi.core.blockcost import BlockCosts
from petra_mpi.core.memory_plan import (budget_bytes, choose, measured_units, plan_stages,
                                        probe_kept, stage_kept_bytes, stage_units)
from petra_mpi.core.planner import balance_with_plan, plan_layout
from petra_mpi.models import NetSpec, build_blocks, frozen_bn_stats
from petra_mpi.models.blocks import Head
from petra_mpi.core.optim import LRSchedule
from petra_mpi.core.partition import balanced_partition, block_costs, split_blocks
from petra_mpi.core.schedule import PetraSchedule
from petra_mpi.core.stages import Stage
from petra_mpi.run.layout import choose_layout
from tests.support.nets import in_flight, make_batches, stages_of
from tests.support.paths import ROOT

# Three stages of reversible blocks (irevnet18's first coupling blocks and its first invertible
# downsampling, all with batch norm) and a head: every block before the last stage can keep, so
# keeping everything is exactly `delayed` with both switches (which stashes every block's weights).
SIZES = [2, 2, 1]   # windows d_0 = 4, d_1 = 2
ALL_KEPT = [[4, 4], [2, 2], [0]]
MIXED = [[1, 3], [1, 0], [0]]
N = 9
QUICKSTART = ROOT / "configs" / "quickstart.yaml"


# RevNet18 whole, 3 stages: the stem and the downsampling blocks are buffered (they keep their
# input and recompute), the others reversible; both kinds keep.
REVNET_SIZES = [3, 3, 4]   # windows d_0 = 4, d_1 = 2
REVNET_ALL_KEPT = [[4, 4, 4], [2, 2, 2], [0] * 4]
REVNET_MIXED = [[3, 1, 0], [1, 2, 0], [0] * 4]  # the stem keeps 3 of 4, a downsampling one 1


def tiny_stages(kept=None, stage_cls=Stage, revnet=False, **kw):
    torch.manual_seed(0)
    if revnet:
        blocks, sizes = build_blocks("revnet18", 4, 10, image_size=8), REVNET_SIZES
    else:
        blocks, sizes = build_blocks("irevnet18", 4, 10, image_size=8)[1:5] + [Head(32, 10)], SIZES
    return [stage_cls(part, s, len(sizes), kept=kept[s] if kept else None, **kw).double()
            for s, part in enumerate(split_blocks(blocks, sizes))]


def batches(n=N, batch=4, seed=1, channels=8):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(batch, channels, 8, 8, generator=g, dtype=torch.float64),
             torch.randint(0, 10, (batch,), generator=g)) for _ in range(n)]


def train(stages, method="petra", k=2, lr=0.2, channels=8):
    """Two segments (the kept rule restarts with each), momentum and lr > 0: the delay matters.
    channels: of the input (3: images, for RevNet18 whole)."""
    workers = build_workers(stages, LRSchedule(lr, 10**6), k, momentum=0.9)
    engine = LocalEngine(workers, method)
    engine.train_segment(iter(batches(channels=channels)), N)
    engine.train_segment(iter(batches(seed=2, channels=channels)), N)
    assert all(in_flight(s) == 0 and s.kept_bytes == 0 for s in stages)
    return stages


def state(stages):
    return [t.detach().clone() for s in stages for t in (*s.parameters(), *s.buffers())]


def assert_same(got, want, exact=False):
    assert len(got) == len(want)
    for g, w in zip(got, want):
        if exact:
            assert torch.equal(g, w)
        else:
            torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-13)


def differs(got, want) -> float:
    return max((g.double() - w.double()).abs().max().item() for g, w in zip(got, want))


class MixtureReference(Stage):
    """The per-micro-batch mixture written out plainly: block i of micro-batch b follows
    `delayed` with buffer_inputs and stash_weights (its forward keeps its input and a copy of its
    weights, its backward recomputes under autograd with that copy, updating batch norm's
    statistics) when b mod d_s < plan[i], else PETRA's rule: a reversible block rebuilds, a
    buffered one recomputes from its input with the current weights."""

    def __init__(self, blocks, index, num_stages, kept=None):
        super().__init__(blocks, index, num_stages)
        self.plan, self.held = kept, [{} for _ in blocks]

    @torch.no_grad()
    def forward(self, x, b=None):
        with frozen_bn_stats():
            for i, block in enumerate(self.blocks):
                if b % self.window < self.plan[i] if self.window else False:
                    self.held[i][b] = (x, [p.detach().clone() for p in block.parameters()])
                elif not block.reversible:  # PETRA's rule: the input, the current weights
                    self.held[i][b] = (x, None)
                x = block(x)
        return x

    def backward(self, y, grad_y, b=None):
        for i in reversed(range(len(self.blocks))):
            block, need_grad_x = self.blocks[i], not (self.is_first and i == 0)
            if b not in self.held[i]:
                y, grad_y = block.backward_from_output(y, grad_y, need_grad_x)
                continue
            x, weights = self.held[i].pop(b)
            weights = weights or [p.detach().clone() for p in block.parameters()]
            params = list(block.parameters())
            live = [p.data for p in params]
            for p, w in zip(params, weights):
                p.data = w
            x_leaf = x.detach().requires_grad_(need_grad_x)
            with torch.enable_grad():
                block(x_leaf).backward(grad_y)
            for p, c in zip(params, live):
                p.data = c
            y, grad_y = x, x_leaf.grad
        return y, grad_y

    def in_flight(self):
        return sum(len(h) for h in self.held)


def test_budget_zero_is_petra_bitwise():
    """The planner keeps nothing under budget 0, and that plan trains PETRA's bits (revnet18,
    k = 2, 4 stages)."""
    stages = stages_of("revnet18", 4, 10, 4, seed=0, dtype=torch.float64)
    plan = plan_stages(stages, lambda n: torch.zeros(n, 3, 8, 8, dtype=torch.float64), 4, 0,
                       block_costs(build_blocks("revnet18", 4, 10), 8))
    assert plan.kept == [[0] * len(s.blocks) for s in stages] and plan.relative_time == 1.0
    got = stages_of("revnet18", 4, 10, 4, seed=0, dtype=torch.float64, kept=plan.kept)
    want = stages_of("revnet18", 4, 10, 4, seed=0, dtype=torch.float64)
    for stages in (got, want):
        workers = build_workers(stages, LRSchedule(0.2, 10**6), 2, momentum=0.9)
        LocalEngine(workers, "petra").train_segment(iter(make_batches(7)), 7)
    assert_same(state(got), state(want), exact=True)


def test_keeping_everything_is_delayed_with_buffers_and_stash():
    got = state(train(tiny_stages(ALL_KEPT)))
    want = state(train(tiny_stages(buffer_inputs=True, stash_weights=True), "delayed"))
    assert_same(got, want)
    assert differs(got, state(train(tiny_stages()))) > 1e-4  # PETRA differs: the test has teeth


def test_buffered_blocks_keep_too():
    """RevNet18 whole: the stem and the downsampling blocks (buffered) keep their graph instead
    of their input, by the same rule: all kept is `delayed` with both switches, a mixed plan the
    per-micro-batch mixture; a kept buffered micro-batch leaves nothing in the FIFO."""
    got = state(train(tiny_stages(REVNET_ALL_KEPT, revnet=True), channels=3))
    want = state(train(tiny_stages(revnet=True, buffer_inputs=True, stash_weights=True),
                       "delayed", channels=3))
    assert_same(got, want)
    petra = state(train(tiny_stages(revnet=True), channels=3))
    assert differs(got, petra) > 1e-4
    mixed = tiny_stages(REVNET_MIXED, revnet=True)
    assert mixed[0].buffered[0] and mixed[1].buffered[0]  # the stem, a downsampling block
    got = state(train(mixed, channels=3))
    want = state(train(tiny_stages(REVNET_MIXED, MixtureReference, revnet=True), channels=3))
    assert_same(got, want)
    assert differs(got, petra) > 1e-6
    # forwarding d_0 micro-batches: the stem buffers only the one it does not keep
    stage = tiny_stages(REVNET_MIXED, revnet=True)[0]
    for b in range(stage.window):
        stage(batches(1, channels=3)[0][0], b)
    assert len(stage.fifos[0]) == 1 and len(stage.graphs[0]) == 3


def test_mixed_plan_is_the_per_microbatch_mixture():
    got = state(train(tiny_stages(MIXED)))
    want = state(train(tiny_stages(MIXED, stage_cls=MixtureReference)))
    assert_same(got, want)
    # and it is neither rule alone
    assert differs(got, state(train(tiny_stages()))) > 1e-6
    assert differs(got, state(train(tiny_stages(ALL_KEPT)))) > 1e-6


def test_a_stage_whose_last_block_keeps_everything_wants_no_rebuilt_input():
    """Where a stage's last block keeps every micro-batch in flight, each backward starts from
    the kept graph: the rebuilt input its successor would send is unused, so the stage does not
    ask for it (both engines send ỹ only where needs_rebuilt_input), and its backward without
    it is the same."""
    assert [s.needs_rebuilt_input for s in tiny_stages()[:-1]] == [True, True]
    assert [s.needs_rebuilt_input for s in tiny_stages(MIXED)[:-1]] == [True, True]
    assert [s.needs_rebuilt_input for s in tiny_stages(ALL_KEPT)[:-1]] == [False, False]
    assert tiny_stages([[0, 1], [0, 2], [0]])[1].needs_rebuilt_input is False
    results = []
    for rebuilt in (True, False):
        stage = tiny_stages(ALL_KEPT)[1]
        x, _ = batches(1)[0]
        y = stage(x, 0)
        x_, grad_x = stage.backward(y if rebuilt else None, torch.ones_like(y), 0)
        results.append([x_, grad_x, *(p.grad for p in stage.parameters())])
    assert_same(*results, exact=True)


def test_batch_norm_statistics_update_once_per_microbatch_in_the_backward():
    stages = tiny_stages(MIXED)
    bns = [m for m in stages[0].modules() if isinstance(m, torch.nn.BatchNorm2d)]
    train(stages)
    assert bns and all(m.num_batches_tracked.item() == 2 * N for m in bns)
    # the forward alone leaves them alone, kept or not
    before = state(stages)
    for b in range(3):
        stages[0](batches(1)[0][0], b)
    assert_same(state(stages), before, exact=True)


def held_by_graphs(stage):
    """What a stage's kept graphs hold, counted apart from the stage's own bookkeeping: from each
    graph's output edge, every autograd node's saved tensors (its _saved_* attributes) and leaves
    (AccumulateGrad.variable), with the input, stashed weights and batch-norm statistics the
    graph holds itself; each storage once, less the stage's parameters and buffers. Returns
    (bytes held, of which saved activations: saved storages that are none of those leaves)."""
    own = {t.untyped_storage().data_ptr() for t in (*stage.parameters(), *stage.buffers())}
    saved, leaves = {}, {}

    def add(into, t):
        if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in own:
            into[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    for graph in (g for q in stage.graphs for g in q):
        nodes, seen = [graph.edge.node], set()
        while nodes:
            node = nodes.pop()
            if node is None or node in seen:
                continue
            seen.add(node)
            nodes += [n for n, _ in node.next_functions]
            for name in (n for n in dir(node) if n.startswith("_saved_")):
                value = getattr(node, name)
                for t in value if isinstance(value, (tuple, list)) else (value,):
                    add(saved, t)
            add(leaves, getattr(node, "variable", None))
        for t in (graph.input, *graph.weights, *(t for _, *ts in graph.batch_norms for t in ts)):
            add(leaves, t)
    activations = sum(n for ptr, n in saved.items() if ptr not in leaves)
    return sum({**saved, **leaves}.values()), activations


def at_the_peak(stages, channels=8):
    """Forward d_s micro-batches through each stage, no backward: every stage holds what it
    holds at its peak, one micro-batch of every b mod d_s."""
    xs = [x for x, _ in batches(max(s.window for s in stages), channels=channels)]
    for stage in stages[:-1]:
        xs = [stage(x, b) for b, x in enumerate(xs[:stage.window])]
    return stages


@pytest.mark.parametrize("revnet", [False, True])
def test_predicted_kept_bytes_are_what_the_graphs_hold(revnet):
    """The planner's bytes (probed on 2 and 3 samples, extended to the batch of 4) against an
    independent count of what the kept graphs hold at the peak (held_by_graphs), which must
    include the saved activations; the stage's own count and its peak in training agree.
    RevNet18 whole: the stem keeps 3 of 4 micro-batches and the next block 1, and the stem's
    saved (in-place) ReLU output is that block's input: held once, not twice."""
    plan, channels = (REVNET_MIXED, 3) if revnet else (MIXED, 8)
    sizes, shared = probe_kept(tiny_stages(revnet=revnet),
                               lambda n: batches(1, batch=n, channels=channels)[0][0], 4)
    predicted = [stage_kept_bytes(k, z, g) for k, z, g in zip(plan, sizes, shared)]
    stages = at_the_peak(tiny_stages(plan, revnet=revnet), channels)
    for s, stage in enumerate(stages[:-1]):
        held, activations = held_by_graphs(stage)
        assert activations > 0 and held > activations
        assert stage.kept_bytes == held == predicted[s] > 0, s
    if revnet:  # the stem shares with the next block
        assert shared[0] == {(0, 1): 4 * 8 * 8 * 8 * 8}  # the stem's output, float64
        assert predicted[0] == sum(k * z for k, z in zip(plan[0], sizes[0])) - shared[0][(0, 1)]
    stages = train(tiny_stages(plan, revnet=revnet), channels=channels)
    assert [s.peak_kept_bytes for s in stages] == predicted


def test_plan_rule_bounds():
    (stage, *_) = tiny_stages()
    with pytest.raises(ValueError, match="0 to 4 are in flight"):
        stage.set_kept([5, 0])
    with pytest.raises(ValueError, match="2 entries"):
        stage.set_kept([1])
    *_, last = stages_of("revnet18", 4, 10, 3, seed=0)
    with pytest.raises(ValueError, match="the last stage and weight stashing keep no graphs"):
        last.set_kept([1] + [0] * (len(last.blocks) - 1))
    (stashing, *_) = tiny_stages(stash_weights=True)
    with pytest.raises(ValueError, match="the last stage and weight stashing keep no graphs"):
        stashing.set_kept([1, 0])


def test_the_planner_counts_a_shared_storage_once():
    """Two blocks whose graphs of one micro-batch share 40 bytes (shared): keeping both for both
    of the d_s = 2 micro-batches holds 2 (100 + 100 - 40) = 320 bytes, which a budget of 320
    allows, and the plan says so; keeping one block's micro-batch alone holds its 100."""
    units, sizes, shared = [[1.0, 1.0], [0.1]], [[100, 100], [None]], [{(0, 1): 40}, {}]
    plan = choose(units, sizes, [2, 0], [320, None], shared)
    assert plan.kept[0] == [2, 2] and plan.kept_bytes[0] == 320
    assert choose(units, sizes, [2, 0], [319, None], shared).kept[0] in ([2, 1], [1, 2])
    assert stage_kept_bytes([2, 1], sizes[0], shared[0]) == 160 + 100
    assert stage_kept_bytes([2, 2], sizes[0]) == 400  # without the sharing


def test_planner_minimises_the_slowest_stage_under_the_budget():
    # stage 0: two blocks, the first cheap per byte; stage 1 the slowest; last stage cheap
    units = [[1.0, 1.0], [4.0], [0.1]]
    sizes = [[100, 10], [50], [None]]
    windows = [4, 2, 0]
    free = choose(units, sizes, windows, [None, None, None])
    assert free.kept[1] == [2]  # the slowest stage keeps everything: 4 * 3 = 12 units
    assert free.units[1] == 12.0 and free.relative_time == 12.0 / 16.0
    # stage 0 needs 8 - 12 ... it is already at 8 <= 12: it keeps nothing
    assert free.kept[0] == [0, 0] and free.kept_bytes[0] == 0
    tight = choose(units, sizes, windows, [1000, 60, None])
    assert tight.kept[1] == [1] and tight.kept_bytes[1] == 50
    assert tight.units[1] == 4.0 * (4 - 0.5)
    none = choose(units, sizes, windows, [0, 0, 0])
    assert none.kept == [[0, 0], [0], [0]] and none.relative_time == 1.0
    # greedy by time saved per byte: block 1 first, and only what the budget allows
    units = [[1.0, 1.0], [0.1]]
    plan = choose(units, [[100, 10], [None]], [2, 0], [125, None])
    assert plan.kept[0] == [1, 2] and plan.kept_bytes[0] == 120
    assert plan.units[0] == stage_units([1.0, 1.0], [1, 2], 2)


def test_the_planner_takes_measured_kept_times():
    """With measured costs a block's unit is (rebuilt, kept) seconds: a stage costs
    sum r - (r - c) k / d_s, slots go by time saved per byte, and a block whose kept micro-batch
    is no faster than its rebuild keeps nothing, even without a limit (on a device where keeping
    saves little the estimate's 3 against 4 would be a promise the run does not keep)."""
    windows = [2, 0]
    # block 0 saves 10 % when kept, block 1 nothing, block 2 (same bytes) 40 %
    units = [[(10.0, 9.0), (10.0, 10.0), (10.0, 6.0)], [(1.0, 1.0)]]
    plan = choose(units, [[8, 8, 8], [None]], windows, [None, None])
    assert plan.kept[0] == [2, 0, 2]
    assert plan.units[0] == 30.0 - 1.0 - 4.0 and plan.petra_units[0] == 30.0
    assert plan.units[1] == 0.75  # the last stage: 3/4 of its blocks' rebuilt time
    # one slot's budget: the block saving most per byte gets it
    plan = choose(units, [[8, 8, 8], [None]], windows, [8, None])
    assert plan.kept[0] == [0, 0, 1] and plan.units[0] == 30.0 - 2.0
    # a kept micro-batch slower than the rebuild: nothing kept anywhere
    slower = [[(10.0, 11.0)], [(1.0, 1.0)]]
    assert choose(slower, [[8], [None]], windows, [None, None]).kept == [[0], [0]]
    # an estimated unit u is the pair (4 u, 3 u)
    assert stage_units([2.0], [1], 2) == stage_units([(8.0, 6.0)], [1], 2) == 7.0


def test_measured_units_are_the_blocks_kept_and_rebuilt_times():
    costs = BlockCosts([1.0, 2.0], [3.0, 5.0], [3.0, 6.0], [0.0, 0.0], [0, 0], 0,
                       kept=[3.5, 7.0])
    assert measured_units(costs) == [(4.0, 3.5), (7.0, 7.0)]
    unmeasured = BlockCosts([1.0, 2.0], [3.0, 5.0], [3.0, 6.0], [0.0, 0.0], [0, 0], 0)
    assert measured_units(unmeasured) == [1.0, 1.75]


def planner_on(units, bytes_per_block, budgets):
    """plan_for(sizes) of balance_with_plan: `choose` on the blocks of each stage of the split."""
    def plan_for(sizes):
        J, start, u, z = len(sizes), 0, [], []
        for s, n in enumerate(sizes):
            u.append(units[start:start + n])
            z.append([None if s == J - 1 else b for b in bytes_per_block[start:start + n]])
            start += n
        return choose(u, z, [PetraSchedule(J).in_flight(s) for s in range(J)], budgets)
    return plan_for


def resplit_on(units):
    """resplit(weights) of balance_with_plan: balanced_partition of the weighted units."""
    return lambda weights: balanced_partition([u * w for u, w in zip(units, weights)], 2,
                                              last_costs=[0.75 * u for u in units])


def test_the_split_is_balanced_with_the_plans_costs():
    # 8 equal blocks on 2 stages: PETRA's balance gives stage 0 three blocks (4 units each; the
    # last stage's five cost 3 each: 12 against 15), and there stage 0 need keep nothing. A
    # stage 0 that keeps all d_0 = 2 of its micro-batches costs 3 a block, so four blocks each
    # (12 against 12) are faster, and the plan keeps them.
    units, sizes = [1.0] * 8, [3, 5]
    assert balanced_partition(units, 2) == sizes
    split, plan = balance_with_plan(sizes, planner_on(units, [10] * 8, [None, None]),
                                    resplit_on(units))
    assert split == [4, 4] and plan.kept[0] == [2, 2, 2, 2]
    assert max(plan.units) == 12.0 < max(planner_on(units, [10] * 8, [None, None])(sizes).units)
    # a budget of four kept micro-batches on stage 0 saves 4 x 0.5 units: four blocks (14)
    # still beat 15
    split, plan = balance_with_plan(sizes, planner_on(units, [10] * 8, [40, None]),
                                    resplit_on(units))
    assert split == [4, 4] and sum(plan.kept[0]) == 4 and plan.kept_bytes[0] == 40
    assert max(plan.units) == 14.0
    # nothing fits the budget: PETRA's own split
    split, plan = balance_with_plan(sizes, planner_on(units, [10] * 8, [5, None]),
                                    resplit_on(units))
    assert split == sizes and plan.kept[0] == [0, 0, 0]


def test_a_measured_split_is_balanced_with_the_plans_costs_too():
    """model.balance: measure with a budget (layout.choose_layout): the measured balance is
    redone with the plan's costs. Measured costs the test fixes: every block 1 forward + 3
    backward outside the last stage, 3 in it. PETRA's split then leaves stage 0 the faster one;
    without a limit stage 0 keeps its reversible blocks, costs less per block, takes more of
    them, and the slowest stage gets faster."""
    net = NetSpec("revnet18", 4, 10, image_size=8)
    n = len(net.blocks())
    costs = BlockCosts([1.0] * n, [3.0] * n, [3.0] * n, [0.0] * n, [0] * n, 0)

    def planned(budget, costs=costs, partition=None):
        return plan_layout(net, 2, partition=partition, budget=budget, batch_size=4,
                           costs=costs)
    petra = planned(0).split
    layout = planned("auto")
    assert layout.split[0] > petra[0] and any(layout.kept[0]) and layout.petra_split == petra
    before = planned("auto", partition=petra).plan  # the plan on PETRA's split, same costs
    assert max(layout.plan.units) < max(before.units)
    # a budget nothing fits: PETRA's measured split
    layout = planned(1)
    assert layout.split == petra and not any(map(any, layout.kept))
    # kept micro-batches measured at 3 of the 4 a rebuild costs: the same split and plan;
    # measured no faster than the rebuild: PETRA's split, nothing kept
    for kept, same in ((3.0, True), (4.0, False)):
        again = planned("auto", costs=dataclasses.replace(costs, kept=[kept] * n))
        free = planned("auto")
        if same:
            assert again.split == free.split and again.kept == free.kept
        else:
            assert again.split == petra and not any(map(any, again.kept))


@pytest.mark.parametrize("value,expect", [
    (-1, "model.memory_budget: must be 0 (PETRA), a number of bytes, a fraction"),
    (1.5, "model.memory_budget: must be 0 (PETRA), a number of bytes, a fraction"),
    ("lots", "model.memory_budget: must be 0 (PETRA), a number of bytes, a fraction"),
    (True, "model.memory_budget: must be 0 (PETRA), a number of bytes, a fraction"),
])
def test_budget_errors_are_one_clear_line(value, expect):
    with pytest.raises(ConfigError) as e:
        load_config(QUICKSTART, [f"model.memory_budget={value}"])
    assert expect in str(e.value) and "\n" not in str(e.value)


def test_budget_belongs_to_petra():
    with pytest.raises(ConfigError, match="model.memory_budget: kept blocks belong to method "
                                          "petra"):
        load_config(QUICKSTART, ["model.memory_budget=auto", "train.method=backprop"])
    for value, want in (("auto", None), ("0.5", None), ("1000000", 10**6), ("0", 0)):
        cfg = load_config(QUICKSTART, [f"model.memory_budget={value}"])
        got = budget_bytes(cfg.model.memory_budget)
        assert got == want if value != "0.5" else 0 < got


def test_budget_fraction_is_of_the_device_memory():
    assert budget_bytes(0.5) * 2 in (budget_bytes(1.0), budget_bytes(1.0) - 1)
    assert budget_bytes("auto") is None and budget_bytes(0) == 0 and budget_bytes(123) == 123


def test_dry_run_prints_the_plan(capsys):
    from petra_mpi.run.dryrun import report
    cfg = load_config(QUICKSTART, ["model.memory_budget=auto", "model.balance=estimate",
                                   "model.width=4", "data.batch_size=8"])
    report(cfg, 4)
    lines = capsys.readouterr().out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("kept blocks"))
    assert "model.memory_budget auto (no limit per stage)" in lines[start]
    rows = lines[start + 2:start + 6]
    assert [int(r.split()[0]) for r in rows] == [0, 1, 2, 3]
    assert any(float(r.split()[2]) > 0 for r in rows)  # some stage keeps
    ratio = float(lines[start + 6].split(": ")[1].split()[0])
    assert lines[start + 6].startswith("slowest stage") and 0.75 <= ratio < 1.0
    # the split it shows is the one training builds (balanced with the plan's costs)
    trained = choose_layout(cfg, 4, None, "cpu", torch.float32, (3, 32, 32), None)
    assert f"blocks per stage {trained.split}" in lines[start]
    assert lines[1] == f"blocks per stage {trained.split}: {trained.why}"  # and how it was made


def test_build_stages_applies_the_layouts_plan_on_every_rank_alike():
    """What training builds (run/trainer.py plans model.memory_budget): the planner's plan, the
    plan of its split, the same for the whole split and for each rank's own stage."""
    net = NetSpec("revnet18", 4, 10, image_size=8)
    layout = plan_layout(net, 4, budget="auto", batch_size=4)
    whole = build_stages(StageSpec(net), layout)
    assert whole[0].partition == layout.split  # balanced with the plan's costs
    plan = plan_stages(stages_of("revnet18", 4, 10, 4, image_size=8, partition=layout.split),
                       lambda n: torch.zeros(n, 3, 8, 8), 4, "auto",
                       block_costs(build_blocks("revnet18", 4, 10), 8))
    assert [s.kept for s in whole] == plan.kept == layout.kept and any(map(any, plan.kept))
    for r in range(4):
        (own,) = build_stages(StageSpec(net), layout, only=r)
        assert own.kept == plan.kept[r]

