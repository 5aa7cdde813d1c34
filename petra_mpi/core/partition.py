"""Splitting the block list into J contiguous stages: the estimated cost of each block, and the
split that minimises the slowest stage (the planner, planner.py, chooses what to balance)."""
from contextlib import nullcontext

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode


# Cost of writing one activation element, in multiply-accumulates: elementwise layers (batch norm,
# ReLU, additions) are memory-bound, so high-resolution blocks cost more than their MACs say.
# Fitted on CPU timings of RevNet18 blocks (forward + recomputation + backward).
ELEMENT_COST = 128


def block_costs(blocks, image_size: int, x=None, every_op: bool = False) -> list[float]:
    """Estimated cost of each block: multiply-accumulates of its convolutions and linear layers
    (and of leaf modules that count their own with a `macs(inputs, output)` method, such as
    attention) plus ELEMENT_COST per output element of every layer, from one batch-1 forward of
    `x` (default: zeros of an image of side `image_size`, or of a language model's context).
    every_op: count the multiply-accumulates of every operation the blocks run instead, whatever
    module or function runs it (torch's FLOP counter: convolutions of any kind, matrix products
    written in a forward): the estimate of blocks of one's own, of kinds the list above does
    not know."""
    costs, current = [], [0.0]

    def count(module, inputs, output):
        if every_op:
            pass  # FlopCounterMode below counts the products
        elif isinstance(module, nn.Conv2d):
            current[0] += module.weight.numel() * output.shape[-1] * output.shape[-2]
        elif isinstance(module, nn.Linear):  # once per row: per token in a transformer
            current[0] += module.weight.numel() * (output.numel() // output.shape[-1])
        elif hasattr(module, "macs"):  # weightless products, e.g. attention's q kᵀ and (·) v
            current[0] += module.macs(inputs, output)
        current[0] += ELEMENT_COST * output.numel()

    hooks = [m.register_forward_hook(count) for b in blocks for m in b.modules()
             if not list(m.children())]
    was_training = [b.training for b in blocks]
    try:
        # a language model's embedding takes a context of token ids, not an image
        context = getattr(blocks[0], "context", None)
        if x is None:
            x = (torch.zeros(1, context, dtype=torch.long) if context
                 else torch.zeros(1, 3, image_size, image_size))
        with torch.no_grad():
            for b in blocks:
                b.eval()
                current[0] = 0.0
                with FlopCounterMode(display=False) if every_op else nullcontext() as ops:
                    x = b(x)
                if every_op:  # FLOPs count a multiply and an add apart
                    current[0] += ops.get_total_flops() / 2
                costs.append(max(current[0], 1.0))
    finally:
        for h in hooks:
            h.remove()
        for b, t in zip(blocks, was_training):
            b.train(t)
    return costs


# Splits whose slowest stage is within this fraction of the fastest split's count as ties when
# measured costs are used (timings move more than that between runs); ties go to the split that
# stores least (see balanced_partition).
TIE_TOLERANCE = 0.03


# The last stage's work per block against the others': no rebuild (3 forwards' worth against 4).
LAST_FACTOR = 0.75


def balanced_partition(costs, num_stages: int, last_factor: float = LAST_FACTOR,
                       last_costs=None, stored=None, depths=None) -> list[int]:
    """Block counts per stage that minimise the most expensive stage (contiguous, none empty).

    `costs[b]` is what block b costs in any stage but the last, `last_costs[b]` what it costs in
    the last stage (measured: see blockcost.py). Without `last_costs` the last stage is counted
    at `last_factor` of `costs`: a stage's work per micro-batch is a forward, a recomputing
    forward and a backward (about 4 forward costs), and the last stage skips the recomputation
    (about 3). Ties go to the first split found, so equal costs give equal splits.

    `stored[b]`: bytes block b keeps per micro-batch in flight outside the last stage (the input
    of a non-reversible block), with `depths[j]`, how many micro-batches stage j holds (the
    schedule's in-flight count: its FIFO depth, the backward popping before the forward pushes).
    Given, the splits whose slowest stage is within TIE_TOLERANCE of the best are ties, and among
    them the one whose largest stage store is smallest wins (then the fastest); the last stage
    stores none. At J = 2 on RevNet18 this keeps a 16 MiB downsampling input out of stage 0's
    two-deep FIFO when the two best splits time within noise of each other."""
    n = len(costs)
    if not 1 <= num_stages <= n:
        raise ValueError(f"cannot split {n} blocks into {num_stages} stages: use 1 to {n}")
    if last_costs is None:
        last_costs = [c * last_factor for c in costs]
    prefix, last_prefix = _prefix(costs), _prefix(last_costs)
    stored_prefix = _prefix(stored or [0] * n)

    def cost(j, m, i):  # stage j (1-based) holding blocks m .. i-1
        return last_prefix[i] - last_prefix[m] if j == num_stages else prefix[i] - prefix[m]

    def store(j, m, i):
        if j == num_stages:
            return 0.0
        return (stored_prefix[i] - stored_prefix[m]) * depths[j - 1]

    best_cost, sizes = _minmax_split(n, num_stages, cost)
    if not stored or not any(stored):
        return sizes
    cap = best_cost * (1 + TIE_TOLERANCE)
    fast = lambda j, m, i: cost(j, m, i) <= cap  # noqa: E731
    least_store, _ = _minmax_split(n, num_stages, store, fast)
    _, sizes = _minmax_split(n, num_stages, cost,
                             lambda j, m, i: fast(j, m, i) and store(j, m, i) <= least_store)
    return sizes


def _prefix(values):
    out = [0.0]
    for v in values:
        out.append(out[-1] + v)
    return out


def _minmax_split(n, num_stages, value, allowed=lambda j, m, i: True):
    """(smallest possible max over stages of value(j, m, i), block counts per stage) over the
    contiguous splits of n blocks whose every stage is allowed; ties go to the first found."""
    # best[j][i]: minimal max-value of splitting the first i blocks into j stages
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(num_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0.0
    for j in range(1, num_stages + 1):
        for i in range(j, n - (num_stages - j) + 1):
            for m in range(j - 1, i):
                if not allowed(j, m, i):
                    continue
                v = max(best[j - 1][m], value(j, m, i))
                if v < best[j][i]:
                    best[j][i], cut[j][i] = v, m
    sizes, i = [], n
    for j in range(num_stages, 0, -1):
        sizes.append(i - cut[j][i])
        i = cut[j][i]
    return best[num_stages][n], sizes[::-1]


def check_split(sizes, num_stages: int, num_blocks: int):
    """A given split (model.partition, a checkpoint's): num_stages positive block counts summing
    to the net's blocks, else a ValueError saying so."""
    if len(sizes) != num_stages or sum(sizes) != num_blocks or min(sizes) < 1:
        raise ValueError(f"model.partition {list(sizes)} must have {num_stages} positive entries "
                         f"summing to {num_blocks} (the number of blocks)")


def split_blocks(blocks, sizes):
    out, i = [], 0
    for size in sizes:
        out.append(blocks[i:i + size])
        i += size
    return out
