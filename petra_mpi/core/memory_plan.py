"""The kept-blocks plan: under a per-stage memory budget, which blocks (reversible or buffered) keep
the graph of how many of their in-flight micro-batches (Stage.set_kept, docs/design.md §1).

Cost model, per micro-batch, in units of a block's forward (partition.block_costs estimates the
unit of every block), on a stage that holds d_s micro-batches in flight (its schedule's in-flight
count): a block that rebuilds (or a buffered block, which recomputes) costs 4, a
forward, a forward under autograd and a backward of twice a forward; a kept micro-batch costs 3,
the recomputation saved. A middle stage s costs sum_i u_i (4 - kept_i / d_s), keeping kept_i of
every d_s micro-batches; the last stage runs forward, loss and backward at once, 3 u_i per block,
whatever the plan. With measured costs (model.balance: measure) a block's unit is a pair, its
measured time rebuilt r_i and kept c_i (blockcost.py), and a middle stage costs
sum_i r_i - (r_i - c_i) kept_i / d_s: on a device where keeping saves less than a quarter, the
plan knows it, and a block that saves nothing keeps nothing. Each kept micro-batch of block i
holds bytes_i (Stage.kept_storages_per_microbatch: saved activations, stashed weights and the
input), less what it shares with the other blocks keeping the same micro-batch, held once (a
block's saved output that is the next block's input: the stem's ReLU).

The planner is greedy, not an exact knapsack: on each stage it fills the blocks in order of time
saved per byte, as many slots as the budget allows; that gives the slowest stage's best time
T. Then each stage keeps, in the same order, only as many slots as bring it down to T: a stage
that is not the slowest gains nothing from holding more. Which split it plans, and with which
costs, is the planner's (planner.py).
"""
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.autograd.graph import saved_tensors_hooks

from ..models import frozen_bn_stats

REBUILT_UNITS, KEPT_UNITS, LAST_UNITS = 4, 3, 3

# model.memory_budget: "auto" keeps without a limit; a float is a fraction of the device's memory
AUTO = "auto"


def budget_bytes(budget, device="cpu"):
    """model.memory_budget in bytes per stage: None for "auto" (no limit), a fraction (0 < f <= 1,
    a float) of the device's memory (a GPU's total memory, on CPU the machine's), else the int
    itself (0: PETRA)."""
    if budget == AUTO:
        return None
    if isinstance(budget, float):
        return int(budget * device_memory(device))
    return int(budget)


def device_memory(device) -> int:
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def block_times(unit) -> tuple:
    """(rebuilt, kept) time per micro-batch of a block whose unit is `unit`: an estimated
    forward's worth u gives (4 u, 3 u); a measured pair is itself."""
    if isinstance(unit, (tuple, list)):
        return tuple(unit)
    return REBUILT_UNITS * unit, KEPT_UNITS * unit


def stage_units(units, kept, window, last=False) -> float:
    """Predicted time per micro-batch of a stage, in the units' own scale (the module's notes)."""
    times = [block_times(u) for u in units]
    if last:
        return LAST_UNITS / REBUILT_UNITS * sum(r for r, _ in times)
    return sum(r - (r - c) * k / window for (r, c), k in zip(times, kept))


def microbatch_kept_bytes(keeps, sizes, shared=None) -> int:
    """Bytes one micro-batch holds in the graphs of the blocks it keeps (keeps[i]): each block's
    sizes[i], less the storages several of them share (shared: {blocks: bytes}), held once."""
    total = sum(z or 0 for k, z in zip(keeps, sizes) if k)
    for blocks, nbytes in (shared or {}).items():
        holders = sum(1 for i in blocks if keeps[i])
        total -= nbytes * max(holders - 1, 0)
    return total


def stage_kept_bytes(kept, sizes, shared=None) -> int:
    """Peak bytes of a stage's kept graphs under its plan `kept`: at the peak it holds one
    micro-batch of every residue r = b mod d_s, which keeps block i when r < kept[i]."""
    return sum(microbatch_kept_bytes([r < k for k in kept], sizes, shared)
               for r in range(max(kept, default=0)))


def _greedy(units, sizes, window, budget, target=None, shared=None) -> list[int]:
    """One stage: slots by time saved per byte, within `budget` bytes (None: no limit), stopping
    once the stage's time is at most `target`."""
    kept = [0] * len(units)
    saved = [r - c for r, c in map(block_times, units)]  # per kept slot, times d_s
    order = sorted((i for i, size in enumerate(sizes) if size is not None and saved[i] > 0),
                   key=lambda i: (-saved[i] / max(sizes[i], 1), i))
    for i in order:
        while kept[i] < window:
            if target is not None and stage_units(units, kept, window) <= target * (1 + 1e-12):
                return kept
            kept[i] += 1
            if budget is not None and stage_kept_bytes(kept, sizes, shared) > budget:
                kept[i] -= 1
                break
    return kept


@dataclass
class Plan:
    kept: list[list[int]]     # per stage, per block: kept micro-batches of every d_s
    kept_bytes: list[int]     # per stage: predicted peak bytes of the kept graphs
    units: list[float]        # per stage: predicted time per micro-batch (the units' scale)
    petra_units: list[float]  # the same with nothing kept
    most_kept: list[list[int]] = None  # per stage, per block: what the budget allows (untrimmed)
    block_units: list[list] = None  # per stage, per block: the unit the plan was made with
    windows: list[int] = None  # per stage: d_s, the micro-batches it holds in flight

    @property
    def relative_time(self) -> float:
        """The slowest stage's time per micro-batch over PETRA's."""
        return max(self.units) / max(self.petra_units)

    def petra_units_on(self, sizes) -> list[float]:
        """petra_units of another split (blocks per stage) of the same net and stages: each
        stage's predicted time per micro-batch with nothing kept, in the plan's units."""
        units = [u for stage in self.block_units for u in stage]
        out, i = [], 0
        for n, w in zip(sizes, self.windows):
            out.append(stage_units(units[i:i + n], [0] * n, w, last=not w))
            i += n
        return out


def choose(units, sizes, windows, budgets, shared=None) -> Plan:
    """units, sizes: per stage, per block (sizes[s][i] None: the block cannot keep); windows: d_s
    per stage (0: the last stage); budgets: bytes per stage (None: no limit); shared: per stage,
    the storages its blocks share (probe_kept; None: none)."""
    last = [w == 0 for w in windows]
    shared = shared or [None] * len(units)
    best = [_greedy(u, z, w, b, shared=g) if w else [0] * len(u)
            for u, z, w, b, g in zip(units, sizes, windows, budgets, shared)]
    target = max(stage_units(u, k, w, l) for u, k, w, l in zip(units, best, windows, last))
    kept = [_greedy(u, z, w, b, target, g) if w else [0] * len(u)
            for u, z, w, b, g in zip(units, sizes, windows, budgets, shared)]
    return Plan(kept, [stage_kept_bytes(k, z, g) for k, z, g in zip(kept, sizes, shared)],
                [stage_units(u, k, w, l) for u, k, w, l in zip(units, kept, windows, last)],
                [stage_units(u, [0] * len(u), w, l) for u, w, l in zip(units, windows, last)],
                best, units, list(windows))


def measured_units(costs) -> list:
    """The plan's unit per block from measured costs (blockcost.BlockCosts): the pair (rebuilt,
    kept) of its measured seconds per micro-batch in a middle stage, or, where the kept time
    was not measured, a forward's worth, a quarter of the rebuilt time (REBUILT_UNITS)."""
    if costs.kept:
        return [(f + b, k) for f, b, k in zip(costs.forward, costs.backward, costs.kept)]
    return [(f + b) / REBUILT_UNITS for f, b in zip(costs.forward, costs.backward)]


def plan_stages(stages, make_input, batch: int, budget, units, device="cpu") -> Plan:
    """The plan for `stages` (all of the net, in order, each holding its window d_s in flight)
    under model.memory_budget `budget` (or a list of them, one per stage), for micro-batches of
    `batch` samples; make_input(n) gives a network input of n samples; `units`: per block of the
    net, its unit (partition.block_costs' estimate, or measured_units). Their bytes are measured
    on 2 and 3 samples and extended to `batch` as an affine function of it (activations grow
    with the batch, weights do not), so the probe stays small. Set it with
    stage.set_kept(plan.kept[s])."""
    limits = ([budget_bytes(b, device) for b in budget] if isinstance(budget, (list, tuple))
              else [budget_bytes(budget, device)] * len(stages))
    per_stage, i = [], 0
    for s in stages:
        per_stage.append(units[i:i + len(s.blocks)])
        i += len(s.blocks)
    sizes, shared = probe_kept(stages, make_input, batch)
    return choose(per_stage, sizes, [s.window for s in stages], limits, shared)


def probe_kept(stages, make_input, batch: int) -> tuple[list[list], list[dict]]:
    """(sizes, shared) of a kept micro-batch of `batch` samples, measured on 2 and 3 samples and
    extended as an affine function of the batch. Per stage: sizes, per block, the bytes its
    graph holds (None: the block cannot keep); shared, {blocks: bytes} of the storages that the
    graphs of several of its blocks hold, counted in each one's size (microbatch_kept_bytes)."""
    two, three = (kept_bytes(stages, make_input(n)) for n in (2, 3))

    def extend(a, b):
        return a + (batch - 2) * (b - a)
    sizes = [[None if a is None else extend(a, b) for a, b in zip(z2, z3)]
             for (z2, _), (z3, _) in zip(two, three)]
    shared = [{k: extend(g2.get(k, 0), g3.get(k, 0)) for k in sorted(g2.keys() | g3.keys())}
              for (_, g2), (_, g3) in zip(two, three)]
    return sizes, shared


def kept_bytes(stages, x) -> list[tuple]:
    """Per stage (sizes, shared) of one kept micro-batch x, as probe_kept's."""
    out = []
    for s in stages:
        held, x = s.kept_storages_per_microbatch(x)
        holders = {}  # data_ptr -> [bytes, the blocks whose graphs hold it]
        for i, storages in enumerate(held):
            for ptr, nbytes in (storages or {}).items():
                holders.setdefault(ptr, [nbytes, ()])[1] += (i,)
        shared = {}
        for nbytes, blocks in holders.values():
            if len(blocks) > 1:
                shared[blocks] = shared.get(blocks, 0) + nbytes
        out.append(([None if h is None else sum(h.values()) for h in held], shared))
    return out


def last_stage_graph_bytes(stage, x, batch: int) -> int:
    """Bytes the graph of the last stage `stage` holds for a micro-batch of `batch` samples
    between its forward and its backward (model.rebuild_last_stage off): the distinct storages
    autograd saves for its forward and loss, less its parameters and buffers, measured on 2 and 3
    copies of the one-sample input x and extended as an affine function of the batch (as
    probe_kept). Rebuilding, the stage holds its buffered blocks' inputs of one micro-batch
    instead (Stage.forward's FIFO entries). Nothing is kept or updated."""
    two, three = (_saved_bytes(stage, torch.cat([x] * n)) for n in (2, 3))
    return two + (batch - 2) * (three - two)


def _saved_bytes(stage, x) -> int:
    own = {t.untyped_storage().data_ptr() for t in (*stage.parameters(), *stage.buffers())}
    held = {}  # data_ptr -> bytes; every saved tensor lives until the end: no address reused

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in own:
            held[storage.data_ptr()] = storage.nbytes()
        return t
    was_training = stage.training
    stage.train()  # batch statistics, as training runs it
    try:
        with torch.enable_grad(), frozen_bn_stats(), saved_tensors_hooks(pack, lambda t: t):
            logits = x
            for block in stage.blocks:
                logits = block(logits)
            loss = F.cross_entropy(logits, torch.zeros(len(logits), dtype=torch.long))
    finally:
        stage.train(was_training)
    del loss
    return sum(held.values())
