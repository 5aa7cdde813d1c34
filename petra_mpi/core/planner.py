"""The layout of a net on J stages, from one planner: which blocks each stage holds (the split)
and, under a memory budget, which of them keep how many graphs (the kept plan).

plan_layout is the one entry. It costs the blocks (partition.block_costs' estimate, the times
blockcost.py measures on the run's device, or costs a benchmark measured), splits them
(a fixed split; one block per stage when J is the block count; else contiguous stages balanced
by those costs, partition.py) and, under model.memory_budget, plans the kept blocks on that split
(memory_plan.py) and, where the split is its to choose, balances it again with the plan's own
costs (balance_with_plan). It returns a Layout, which build_stages, the trainer, the dry run and
the benchmarks take whole.

The split is PETRA's whatever the method, so that methods compare on one split: its stores are
counted at PETRA's in-flight counts. The kept plan fills the in-flight counts of the method's
schedule (TickSchedule.in_flight).
"""
from dataclasses import dataclass

import torch

from .blockcost import BlockCosts, measure_block_costs
from .memory_plan import Plan, block_times, measured_units, plan_stages, stage_units
from .partition import LAST_FACTOR, balanced_partition, block_costs, check_split, split_blocks
from .schedule import PetraSchedule, schedule_for
from .stages import Stage


@dataclass
class Layout:
    """Where a net's blocks run: the split, the kept plan, the costs they were made with, why."""
    split: list[int]                       # blocks per stage
    kept: list[list[int]] | None = None    # per stage, per block: kept of every d_s; None: PETRA
    costs: object = None  # the measured BlockCosts, or the estimate per block; None: not costed
    why: str = "given"                     # how the split was chosen, in words
    plan: Plan | None = None               # the kept plan's predictions (under a budget)
    petra_split: list[int] | None = None   # PETRA's own split, before the plan rebalanced it

    def __post_init__(self):
        self.split = list(self.split)
        if self.petra_split is None:
            self.petra_split = self.split

    @property
    def num_stages(self) -> int:
        return len(self.split)


def plan_layout(net, num_stages: int, *, partition=None, budget=0, batch_size: int = 1,
                measure: bool = False, costs: BlockCosts | None = None,
                rebuild_last: bool = False, method: str = "petra", device="cpu",
                dtype=torch.float32) -> Layout:
    """The Layout of `net` (models.NetSpec) on num_stages stages.

    partition: a fixed split (model.partition); budget: model.memory_budget (0: nothing kept);
    batch_size: samples per micro-batch (kept bytes and measured times grow with it); measure:
    time the blocks on `device` in `dtype` where a split or a plan needs costs (model.balance:
    measure), or `costs`: BlockCosts measured already; else the estimate; rebuild_last:
    model.rebuild_last_stage (the measured balance then counts the last stage's blocks at their
    middle-stage costs; the plan's balance counts the last stage as measured); method: whose
    schedule's in-flight counts the plan fills. The global random generator is left as it was."""
    n = net.num_blocks
    fixed = list(partition) if partition else ([1] * n if num_stages == n else None)
    why = "model.partition" if partition else "one block per stage" if fixed else None
    if fixed:
        check_split(fixed, num_stages, n)
        if not budget:  # nothing to cost
            return Layout(fixed, None, costs, why)
    with torch.random.fork_rng(devices=()):
        blocks = net.blocks()
        if costs is None and measure:
            costs = measure_block_costs(blocks, net.input_shape, batch_size, net.num_classes,
                                        device=device, dtype=dtype, time_kept=bool(budget))
        estimate = (block_costs(blocks, net.image_size, net.zeros(1), every_op=bool(net.own))
                    if costs is None else None)
        balance = _Balance(blocks, num_stages, costs, estimate)
        petra = fixed or balance.split(rebuild_last=rebuild_last)
        why = why or f"balanced by {'estimated' if costs is None else 'measured'} cost"
        if not budget:
            return Layout(petra, None, costs or estimate, why)
        units = estimate if costs is None else measured_units(costs)
        plan_for = _KeptPlanner(blocks, schedule_for(method, num_stages), budget, batch_size,
                                units, net, device, dtype)
        if fixed:
            plan = plan_for(fixed)
            return Layout(fixed, plan.kept, costs or estimate, why, plan)
        split, plan = balance_with_plan(balance.split(), plan_for, balance.split)
        if split != petra:
            why += ", then with the kept blocks' costs"
        return Layout(split, plan.kept, costs or estimate, why, plan, petra)


class _Balance:
    """Contiguous stages balanced by the blocks' costs: measured (BlockCosts: a middle stage's
    forward + backward, the last stage's own, ties broken by the inputs stored) or estimated
    (the last stage at LAST_FACTOR of a middle one)."""

    def __init__(self, blocks, num_stages, costs=None, estimate=None):
        self.J, self.costs, self.estimate = num_stages, costs, estimate
        self.reversible = [b.reversible for b in blocks]

    def split(self, weights=None, rebuild_last=False) -> list[int]:
        """The balanced split; weights[b] scales block b's cost outside the last stage (a kept
        block costs less than a rebuilt one); rebuild_last: count the measured last stage at
        its blocks' middle-stage costs."""
        weights = weights or [1.0] * len(self.reversible)
        costs = self.costs
        if costs is None:
            return balanced_partition([c * w for c, w in zip(self.estimate, weights)], self.J,
                                      last_costs=[LAST_FACTOR * c for c in self.estimate])
        if rebuild_last:
            costs = costs.with_rebuilt_last()
        middle = [(f + b) * w for f, b, w in zip(costs.forward, costs.backward, weights)]
        inputs = [costs.input_bytes] + costs.output_bytes[:-1]
        stored = [0 if rev else size for rev, size in zip(self.reversible, inputs)]
        petra = PetraSchedule(self.J)  # the split is PETRA's, whatever the method
        return balanced_partition(middle, self.J, last_costs=costs.last, stored=stored,
                                  depths=[petra.in_flight(s) for s in range(self.J)])


class _KeptPlanner:
    """plan(split) -> the kept plan of the net's blocks split as `split` (memory_plan.plan_stages),
    probed on CPU in the run's dtype (deterministic: every rank computes the same), each stage
    holding its schedule's in-flight count."""

    def __init__(self, blocks, schedule, budget, batch_size, units, net, device, dtype):
        self.blocks, self.schedule, self.budget = blocks, schedule, budget
        self.batch_size, self.units, self.net = batch_size, units, net
        self.device, self.dtype = device, dtype

    def __call__(self, split) -> Plan:
        for block in self.blocks:
            block.to(self.dtype)
        J = len(split)
        probes = [Stage(part, s, J, schedule=self.schedule)
                  for s, part in enumerate(split_blocks(self.blocks, split))]
        return plan_stages(probes, lambda n: self.net.zeros(n, self.dtype), self.batch_size,
                           self.budget, self.units, self.device)


def balance_with_plan(sizes, plan_for, resplit, rounds: int = 4):
    """(split, Plan): a split balanced with its own plan's costs. PETRA's balance (`sizes`)
    counts every block at 4 units, but a block that keeps k of every d_s micro-batches costs
    4 - k / d_s: a stage that can keep is faster than the split assumed, and may take more
    blocks. So re-split by the costs of what each stage's budget lets it keep (Plan.most_kept;
    resplit(weights) -> sizes, each block's cost outside the last stage scaled by its weight,
    the last stage's cost resplit's own), plan that split (plan_for(sizes) -> Plan), and keep
    it while the slowest stage gets faster."""
    plan = plan_for(sizes)
    for _ in range(rounds):
        weights = []
        for s, kept in enumerate(plan.most_kept[:-1]):
            weights += [stage_units([u], [k], plan.windows[s]) / block_times(u)[0]
                        for u, k in zip(plan.block_units[s], kept)]
        # the last stage keeps nothing (no delay): a block of it moved into a middle stage is
        # counted at the best any block keeps there (the new split's plan, checked below,
        # decides)
        weights += [min(weights, default=1.0)] * len(plan.most_kept[-1])
        again = resplit(weights)
        if again == sizes:
            break
        other = plan_for(again)
        if max(other.units) >= max(plan.units):
            break
        sizes, plan = again, other
    return sizes, plan
