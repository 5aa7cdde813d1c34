"""Emulated stages: each rank's compute replaced by a wait of its cost, so that many ranks of a
pipeline run faithfully on a few cores (`bench emulate`, docs/benchmarks.md).

The stand-ins keep the interfaces of the real ones, so the real worker, engine and transport run
them unchanged: WaitingStage is a Stage (forward, backward, forward_backward_loss, evaluate) and
returns tensors of the real shapes, so the messages are real; WaitingOptimizer steps by waiting;
WaitingPlainStage is an nn.Module for torch.distributed.pipelining whose autograd forward and
backward wait. A wait sleeps in short slices and polls the transport between them, as a GPU
rank's host thread polls while its kernels run, and never spins a core.

Costs (a Profile: seconds per micro-batch per block) come from this machine (`measured`), a JSON
file (e.g. profiled on a GPU), the paper's Table 5 (`paper_profile`, derivation below) or its
total work spread evenly over the blocks (`balanced_profile`).
"""
import contextlib
import json
import time
from dataclasses import dataclass, field, replace

import torch
import torch.nn.functional as F
from torch import nn

from ..core.blockcost import BlockCosts
from ..models import build_blocks
from ..core.partition import block_costs as estimated_block_costs
from ..core.schedule import PetraSchedule
from ..core.stages import PollsBetweenBlocks

# Paper Table 5: time per micro-batch of 256 CIFAR-10 images with one block per GPU.
PAPER_TABLE5_MS = {"revnet18": {"backprop": 160.3, "petra": 53.4},
                   "revnet34": {"backprop": 235.6, "petra": 97.1}}
# Share of a plain backward that computes the weight gradients (zero-bubble's W), where a
# profile does not say: a convolution's input and weight gradients cost one forward each.
WEIGHT_SHARE = 0.5
# Longest sleep between two polls of the transport while a stage waits its cost: often enough to
# move large messages along, rarely enough that J ranks polling do not crowd two cores.
SLICE_S = 0.002
# A sleep ends about 0.1 ms late here (timer slack and wake-up), once per wait: a stage of
# several blocks would run late by that much per block. The last WAKE_S of a wait spins instead.
WAKE_S = 0.0002


@dataclass
class Profile:
    """Seconds per micro-batch of every block of `arch`. forward: the no-graph forward; rebuild:
    rebuilding the block's input (reversible: the inverse while recording the graph; buffered:
    the recomputed forward); backward: the vector-Jacobian product (weight part: `weight`);
    step: one optimizer step of the block. PETRA's backward is rebuild + backward, a plain
    network's (torch.distributed.pipelining) is backward after a forward with graph."""
    arch: str
    forward: list
    rebuild: list
    backward: list
    step: list = None
    weight: list = None
    source: str = ""
    notes: dict = field(default_factory=dict)

    def __post_init__(self):
        n = len(self.forward)
        self.step = list(self.step) if self.step is not None else [0.0] * n
        self.weight = (list(self.weight) if self.weight is not None
                       else [WEIGHT_SHARE * b for b in self.backward])
        if any(len(v) != n for v in (self.rebuild, self.backward, self.step, self.weight)):
            raise ValueError("every cost list of a profile needs one entry per block")

    def scaled(self, factor) -> "Profile":
        """Every cost times `factor`: the same shape of work, slower (more compute per operation
        next to what the emulating machine spends on each)."""
        def times(costs):
            return [factor * c for c in costs]
        return replace(self, forward=times(self.forward), rebuild=times(self.rebuild),
                       backward=times(self.backward), step=times(self.step),
                       weight=times(self.weight),
                       source=f"{self.source}, every cost x{factor:g}" if factor != 1
                       else self.source)

    def petra_costs(self, output_bytes, input_bytes) -> BlockCosts:
        """PETRA's per-block costs (as blockcost.measure_block_costs measures them)."""
        return BlockCosts(list(self.forward),
                          [r + b for r, b in zip(self.rebuild, self.backward)],
                          [f + b for f, b in zip(self.forward, self.backward)],
                          list(self.step), list(output_bytes), input_bytes)

    def plain_costs(self, output_bytes, input_bytes) -> BlockCosts:
        """A plain network's per-block costs (forward with graph, autograd backward)."""
        return BlockCosts(list(self.forward), list(self.backward),
                          [f + b for f, b in zip(self.forward, self.backward)],
                          list(self.step), list(output_bytes), input_bytes)


def file_profile(path) -> Profile:
    """A profile from JSON: {"arch": ..., "forward": [...], "rebuild": [...], "backward": [...]}
    (seconds per micro-batch per block) and optionally "step" and "weight"."""
    with open(path) as f:
        d = json.load(f)
    known = {"arch", "forward", "rebuild", "backward", "step", "weight", "source", "notes"}
    unknown = set(d) - known
    if unknown:
        raise ValueError(f"{path}: unknown profile keys {sorted(unknown)}")
    return Profile(**{"source": f"file {path}", **d})


def measured_profile(arch, width, batch, num_classes=10, repeats=3) -> Profile:
    """This machine's costs, timed as `model.balance: measure` times them: PETRA's forward and
    backward (rebuild + VJP) per block, and the plain autograd backward of the same block."""
    from ..core.blockcost import measure_autograd_costs, measure_block_costs
    blocks = build_blocks(arch, width, num_classes)
    petra = measure_block_costs(blocks, (3, 32, 32), batch, num_classes, repeats=repeats)
    plain = measure_autograd_costs(blocks, (3, 32, 32), batch, num_classes, repeats=repeats)
    # the last stage's fused op is forward with graph + backward: its backward is the rest
    backward = [max(0.0, last - f) for last, f in zip(petra.last, plain.forward)]
    rebuild = [max(0.0, b - v) for b, v in zip(petra.backward, backward)]
    return Profile(arch, petra.forward, rebuild, backward, petra.step,
                   source=f"measured on this machine (width {width}, batch {batch})")


def paper_profile(arch) -> Profile:
    """Costs that reproduce the paper's Table 5 exactly at its stage count (one block per GPU,
    batch 256, width 64). Table 5 gives two numbers per network: reversible backprop's time per
    micro-batch B (every stage's work in series) and PETRA's P (the slowest stage's work). A
    block's work is shaped by the cost estimate the partitioner uses (partition.block_costs:
    MACs plus memory-bound element work), with a middle stage working 4 forwards (forward,
    rebuild, VJP of 2) and the last 3 (forward and VJP): the block the estimate ranks most
    expensive gets P, the others share B - P in proportion to their estimated work. Within a
    block: forward 1/4 and rebuild 1/4, backward 1/2, half of which computes the weight
    gradients; steps cost nothing (the paper's times include them)."""
    if arch not in PAPER_TABLE5_MS:
        raise ValueError(f"the paper's Table 5 has no {arch}; choose one of "
                         f"{sorted(PAPER_TABLE5_MS)}")
    total, slowest = (PAPER_TABLE5_MS[arch][m] / 1e3 for m in ("backprop", "petra"))
    estimate = estimated_block_costs(build_blocks(arch, 64, 10), 32)
    n = len(estimate)
    units = [4.0] * (n - 1) + [3.0]  # forwards' worth of work per stage
    work = [u * e for u, e in zip(units, estimate)]
    top = max(range(n), key=work.__getitem__)
    rest = sum(w for i, w in enumerate(work) if i != top)
    stage = [slowest if i == top else (total - slowest) * w / rest for i, w in enumerate(work)]
    forward = [s / u for s, u in zip(stage, units)]  # one forward's worth
    rebuild = [f if i < n - 1 else 0.0 for i, f in enumerate(forward)]
    return Profile(arch, forward, rebuild, [2 * f for f in forward],
                   source="paper Table 5 (see docs/benchmarks.md)",
                   notes={"table5_ms": PAPER_TABLE5_MS[arch], "slowest_block": top})


def balanced_profile(arch) -> Profile:
    """The paper's total work (Table 5's reversible-backprop time per micro-batch) shared evenly:
    every middle stage of one block works 4 forwards' worth, the last 3, all forwards equal. With
    no dominant stage, the pipelines' bubble is what separates the schedules (docs/benchmarks.md)."""
    n = len(paper_profile(arch).forward)  # and the paper's error for an arch it lacks
    f = PAPER_TABLE5_MS[arch]["backprop"] / 1e3 / (4 * (n - 1) + 3)
    return Profile(arch, [f] * n, [f] * (n - 1) + [0.0], [2 * f] * n,
                   source="the paper's Table 5 total, every block the same (balanced)",
                   notes={"table5_ms": PAPER_TABLE5_MS[arch]})


def estimated_profile(arch, batch, image_size=224, width=64, num_classes=1000,
                      imagenet_stem=True, reference="revnet34") -> Profile:
    """Costs of a network or an input size Table 5 does not give (RevNet-50, ImageNet): Table 5's
    reversible-backprop time of `reference` (micro-batches of 256 CIFAR-10 images, width 64, every
    stage's work in series: a middle stage 4 forwards' worth, the last 3) over the partitioner's
    cost estimate of that work (partition.block_costs) gives the paper's seconds per unit of the
    estimate and sample; every block of `arch` at `image_size` then works its own estimate at that
    rate for `batch` samples. Within a block as balanced_profile: forward 1, rebuild 1 (the last
    block none), backward 2."""
    ref = estimated_block_costs(build_blocks(reference, 64, 10), 32)
    units = [4.0] * (len(ref) - 1) + [3.0]
    rate = (PAPER_TABLE5_MS[reference]["backprop"] / 1e3
            / (256 * sum(u * e for u, e in zip(units, ref))))
    estimate = estimated_block_costs(build_blocks(arch, width, num_classes, imagenet_stem),
                                     image_size)
    forward = [rate * batch * e for e in estimate]
    return Profile(arch, forward, forward[:-1] + [0.0], [2 * f for f in forward],
                   source=f"Table 5's {reference} rate x the cost estimate of {arch} at "
                          f"{image_size} px, batch {batch}",
                   notes={"seconds_per_unit_sample": rate, "reference": reference})


# ---------------------------------------------------------------------------------------------
# Shapes and held bytes of the real network, from one batch-1 probe

@dataclass
class BlockShapes:
    inputs: list       # per block, the input shape without the batch dimension
    outputs: list
    reversible: list   # whether the block rebuilds its input (else it buffers it)
    saved: list        # bytes autograd saves per sample in a forward with graph (plain training)


def probe_shapes(arch, width, num_classes=10, image_size=32, imagenet_stem=False) -> BlockShapes:
    blocks = build_blocks(arch, width, num_classes, imagenet_stem)
    # 2 samples: batch norm needs more than one in training
    x = torch.zeros(2, 3, image_size, image_size)
    inputs, outputs, saved = [], [], []
    for block in blocks:
        storages = {}

        def pack(t, storages=storages):
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t
        params = {p.untyped_storage().data_ptr() for p in block.parameters()}
        leaf = x.detach().requires_grad_(True)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            y = block(leaf)
        inputs.append(tuple(x.shape[1:]))
        outputs.append(tuple(y.shape[1:]))
        saved.append(sum(b for p, b in storages.items() if p not in params) // 2)
        x = y.detach()
    return BlockShapes(inputs, outputs, [b.reversible for b in blocks], saved)


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


# ---------------------------------------------------------------------------------------------
# Waiting

class Clock:
    """Waits that leave the core free: sleep in slices of at most SLICE_S, calling `poll` (the
    transport) between them, and spin through the last WAKE_S so as to end on time. `busy` sums
    the seconds waited (the emulated compute)."""

    def __init__(self, scale=1.0):
        self.scale, self.busy, self.poll = scale, 0.0, None

    def wait(self, seconds):
        seconds *= self.scale
        if seconds <= 0:
            return
        start = time.perf_counter()
        end = start + seconds
        while True:
            left = end - time.perf_counter()
            if left <= 0:
                break
            if left <= WAKE_S:
                continue  # spin: a sleep this short would end as late again
            time.sleep(min(left - WAKE_S, SLICE_S))
            if self.poll is not None:
                self.poll()
        self.busy += time.perf_counter() - start


class WaitingStage(PollsBetweenBlocks, nn.Module):
    """A Stage whose operations wait their cost and return zero tensors of the real shapes.
    `costs`: (forward, backward, fused) seconds per micro-batch of each of its blocks (fused:
    the block's share of the last stage's forward, loss and backward); `rebuild`: the part of
    each block's backward that rebuilds its input. Held activations: the inputs of its buffered
    blocks for every micro-batch in flight, as the real FIFOs, and the graphs of its kept
    micro-batches (set_kept; a kept buffered block's graph instead of its input), as Stage
    holds them."""

    def __init__(self, index, num_stages, shapes: BlockShapes, first_block, costs, batch,
                 num_classes=10, clock=None, rebuild=None):
        super().__init__()
        self.index, self.num_stages = index, num_stages
        self.is_first, self.is_last = index == 0, index == num_stages - 1
        blocks = range(first_block, first_block + len(costs))
        self.costs, self.clock = costs, clock or Clock()
        self.rebuild = list(rebuild) if rebuild is not None else [0.0] * len(costs)
        self.window = PetraSchedule(num_stages).in_flight(index)  # d_s, as Stage's
        self.in_shape = (batch, *shapes.inputs[first_block])
        self.out_shape = (batch, *shapes.outputs[blocks[-1]])
        self.num_classes = num_classes
        self.needs_rebuilt_input = shapes.reversible[blocks[-1]]
        self.input_dtype = None  # images: the activations' dtype
        # per block: the input a buffered block holds per micro-batch in flight (unless kept)
        self.fifo_bytes = [0 if shapes.reversible[b] else 4 * batch * _numel(shapes.inputs[b])
                           for b in blocks]
        self.held = self.peak_held_bytes = 0
        self.set_kept()
        self.anchor = nn.Parameter(torch.zeros(1))  # engines find the device from a parameter
        self.forward_starts = []  # wall clock of every forward (rank 0: the tick rate)

    def set_kept(self, kept=None, kept_bytes=None, shared=None):
        """A kept plan (memory_plan.Plan.kept[s]: per block, kept micro-batches of every d_s),
        the bytes one kept micro-batch of each block holds and what its blocks share
        (memory_plan.probe_kept). A kept micro-batch's backward skips the block's rebuild, and
        it holds those bytes from its forward to its backward, a shared storage once
        (memory_plan.microbatch_kept_bytes); which micro-batches keep is
        Stage.keeps_microbatch's rule."""
        self.shared = shared
        self.kept = [0] * len(self.costs) if kept is None else [int(k) for k in kept]
        self.kept_bytes = ([0] * len(self.costs) if kept_bytes is None
                           else [z or 0 for z in kept_bytes])
        if len(self.kept) != len(self.costs) or len(self.kept_bytes) != len(self.costs):
            raise ValueError(f"stage {self.index}: a kept plan needs one entry per block")
        if any(not 0 <= k <= self.window for k in self.kept):
            raise ValueError(f"stage {self.index}: keeps 0 to {self.window} micro-batches, "
                             f"got {self.kept}")

    def reset_peak(self):
        self.peak_held_bytes = self.held

    def steady_held_bytes(self) -> int:
        """What the stage holds once its d_s micro-batches are in flight (backward first, then
        forward, in every tick of a segment longer than d_s): the peak its forwards count."""
        return sum(self._holds(b) for b in range(self.window))

    def _keeps(self, i, b) -> bool:
        return bool(self.kept[i]) and b is not None and b % self.window < self.kept[i]

    def _holds(self, b) -> int:
        """Bytes micro-batch b holds from its forward to its backward: a kept block's graph
        (its input included), a buffered block's input."""
        from ..core.memory_plan import microbatch_kept_bytes
        keeps = [self._keeps(i, b) for i in range(len(self.kept))]
        return (microbatch_kept_bytes(keeps, self.kept_bytes, self.shared)
                + sum(z for k, z in zip(keeps, self.fifo_bytes) if not k))

    def _wait(self, seconds):
        self.clock.poll = self.between_blocks
        for s in seconds:
            self.clock.wait(s)
            if self.between_blocks is not None:
                self.between_blocks()

    def forward(self, x, b=None):  # b: the micro-batch, as Stage.forward takes it
        self.forward_starts.append(time.perf_counter())
        self._wait(c[0] for c in self.costs)  # a kept forward costs a forward (memory_plan)
        self.held += self._holds(b)
        self.peak_held_bytes = max(self.peak_held_bytes, self.held)
        return torch.empty((x.shape[0], *self.out_shape[1:]))  # contents do not matter

    def backward(self, y, grad_y, b=None):
        kept = [self._keeps(i, b) for i in range(len(self.costs))]
        self._wait(c[1] - (r if k else 0.0) for c, r, k in zip(self.costs, self.rebuild, kept))
        self.held -= self._holds(b)
        shape = (grad_y.shape[0], *self.in_shape[1:])
        return torch.empty(shape), (None if self.is_first else torch.empty(shape))

    def forward_backward_loss(self, x, labels, tracer=None, b=-1):
        self._wait(c[2] for c in self.costs)
        logits = torch.zeros(x.shape[0], self.num_classes)
        return F.cross_entropy(logits, labels), logits, (None if self.is_first
                                                         else torch.empty_like(x))

    def evaluate(self, x):
        return torch.zeros((x.shape[0], *self.out_shape[1:]))


class WaitingOptimizer:
    """StageOptimizer's interface: a step waits `seconds`."""

    def __init__(self, seconds, clock):
        self.seconds, self.clock = seconds, clock

    def accumulated(self):
        pass

    def step(self):
        self.clock.wait(self.seconds)

    def predicted_weights(self):
        """No weight prediction: the forward's weights are the current ones."""
        return contextlib.nullcontext()


class _WaitInput(torch.autograd.Function):
    """Forward: wait, return zeros of the output shape; backward: wait the input-gradient part."""

    @staticmethod
    def forward(ctx, x, stage):
        ctx.stage = stage
        stage.clock.wait(stage.forward_s)
        stage.in_flight += 1
        stage.peak_in_flight = max(stage.peak_in_flight, stage.in_flight)
        return x.new_empty((x.shape[0], *stage.out_shape[1:]))

    @staticmethod
    def backward(ctx, grad):
        stage = ctx.stage
        stage.clock.wait(stage.input_grad_s)
        return grad.new_empty((grad.shape[0], *stage.in_shape[1:])), None


class _WaitWeight(torch.autograd.Function):
    """A zero added to the output that depends on the weights: its backward is the weight
    gradient's part (zero-bubble's W), and the micro-batch's activations are freed after it."""

    @staticmethod
    def forward(ctx, weight, stage, batch):
        ctx.stage = stage
        return weight.new_zeros((batch, *stage.out_shape[1:]))

    @staticmethod
    def backward(ctx, grad):
        stage = ctx.stage
        stage.clock.wait(stage.weight_grad_s)
        stage.in_flight -= 1
        return torch.zeros(1), None, None


class WaitingPlainStage(nn.Module):
    """One rank's module for torch.distributed.pipelining: forward with graph and backward wait
    the plain network's costs of its blocks. Peak held activations: what autograd would save for
    every micro-batch between its forward and its weight gradient. `checkpointed`: activation
    checkpointing around every block (peers.py's 1f1b_checkpointed): a micro-batch holds only its
    blocks' inputs, its backward first recomputes the forward (one forward more), and while it
    does, one block's saved activations are held on top."""

    def __init__(self, shapes: BlockShapes, blocks, forward_s, backward_s, weight_s, batch,
                 clock=None, checkpointed=False):
        super().__init__()
        self.clock = clock or Clock()
        self.in_shape = (batch, *shapes.inputs[blocks[0]])
        self.out_shape = (batch, *shapes.outputs[blocks[-1]])
        self.forward_s, self.input_grad_s = forward_s, backward_s - weight_s
        # the recomputation goes with the weight part: stage 0, whose input needs no gradient,
        # runs only that one
        self.weight_grad_s = weight_s + (forward_s if checkpointed else 0.0)
        if checkpointed:
            self.held_per_microbatch = sum(4 * batch * _numel(shapes.inputs[b]) for b in blocks)
            self.recomputed = batch * max(shapes.saved[b] for b in blocks)
        else:
            self.held_per_microbatch = batch * sum(shapes.saved[b] for b in blocks)
            self.recomputed = 0
        self.in_flight = self.peak_in_flight = 0
        self.weight = nn.Parameter(torch.zeros(1))

    @property
    def peak_held_bytes(self) -> int:
        # 1F1B's backward runs with its most micro-batches in flight: the recomputation's
        # activations come on top of them
        return (self.peak_in_flight * self.held_per_microbatch
                + (self.recomputed if self.peak_in_flight else 0))

    def reset_peak(self):
        self.peak_in_flight = self.in_flight

    def forward(self, x):
        return _WaitInput.apply(x, self) + _WaitWeight.apply(self.weight, self, x.shape[0])


# ---------------------------------------------------------------------------------------------
# Kept blocks (model.memory_budget): the plan training would make, with the profile's costs

def kept_sizes(arch, width, batch, sizes, num_classes=10, image_size=32,
               imagenet_stem=False) -> tuple[list[list], list[dict]]:
    """Per stage of the split `sizes`: per block, the bytes one kept micro-batch of `batch`
    samples holds (saved activations, stashed weights, input; None: the block cannot keep), and
    the storages its blocks share, measured on the real stages as training's planner measures
    them (memory_plan.probe_kept)."""
    from ..engines.build import StageSpec, build_stages
    from ..core.memory_plan import probe_kept
    from ..core.planner import Layout
    from ..models import NetSpec
    net = NetSpec(arch, width, num_classes, imagenet_stem)
    stages = build_stages(StageSpec(net), Layout(sizes))
    return probe_kept(stages, lambda n: torch.zeros(n, 3, image_size, image_size), batch)


def kept_plan(profile: Profile, sizes, block_bytes, budgets, shared=None):
    """memory_plan's plan (memory_plan.choose) for the split `sizes` under `budgets` (bytes of
    kept graphs per stage, None: no limit), with each block's unit its forward in the profile:
    the planner's model, in which a rebuild costs a forward and a backward two, is then the
    profile's own wherever the profile says so (the paper's does)."""
    from ..core.memory_plan import choose
    units, i = [], 0
    for n in sizes:
        units.append(list(profile.forward[i:i + n]))
        i += n
    petra = PetraSchedule(len(sizes))
    return choose(units, block_bytes, [petra.in_flight(s) for s in range(petra.J)], budgets,
                  shared)


def fifo_bytes(shapes: BlockShapes, sizes, batch) -> list[int]:
    """Per stage: the bytes PETRA's FIFOs hold at their peak (the inputs of its buffered blocks,
    for the d_s micro-batches in flight of a segment longer than d_s), as WaitingStage counts."""
    out, i = [], 0
    J = len(sizes)
    for s, n in enumerate(sizes):
        per_microbatch = sum(4 * batch * _numel(shapes.inputs[b]) for b in range(i, i + n)
                             if not shapes.reversible[b])
        out.append(per_microbatch * PetraSchedule(J).in_flight(s))
        i += n
    return out
