"""Measured per-block costs: what one micro-batch costs each block on the run's own device, dtype
and input shape, timed the way the stages will run it.

For every block three or four times are taken (median of a few repetitions after a warm-up):
- forward: the no-graph forward of a stage (batch norm with batch statistics, nothing kept);
- backward: a middle stage's backward step, i.e. the rebuild (reversible block) or the FIFO pop
  and recomputation (buffered block) plus one vector-Jacobian product; for the first block (the
  stem), stage 0's, which needs no gradient for the images;
- last: what the block costs inside the last stage, which runs forward, loss and backward at once
  (forward under autograd plus its backward; the head's cost includes the loss);
- kept, only when asked (time_kept: a run with model.memory_budget): forward plus backward of a
  micro-batch the block keeps in a middle stage (the forward under autograd through stashed
  weights, then the backward from its graph), which the kept-blocks plan sets against forward +
  backward (memory_plan.measured_units).
A middle stage costs sum(forward + backward) of its blocks per micro-batch, the last stage
sum(last). The blocks are deep-copied first, so timing neither moves a batch-norm statistic nor
leaves a gradient behind in the model that trains.
"""
import copy
import statistics
import time
from dataclasses import dataclass, field, replace

import torch
import torch.nn.functional as F

from ..comm.devices import synchronize, to_device
from .optim import LRSchedule, StageOptimizer
from .stages import Stage


@dataclass
class BlockCosts:
    forward: list[float]   # seconds per micro-batch
    backward: list[float]
    last: list[float]
    step: list[float]      # seconds per optimizer step of the block's parameters
    output_bytes: list[int]  # size of each block's output message for one micro-batch
    input_bytes: int = 0     # size of the first block's input (the images) for one micro-batch
    kept: list[float] = field(default_factory=list)  # seconds per kept micro-batch; [] unmeasured

    def stage_seconds(self, sizes) -> list[float]:
        """Seconds per micro-batch of each stage of a split (blocks per stage)."""
        out, i = [], 0
        for s, n in enumerate(sizes):
            blocks = range(i, i + n)
            if s == len(sizes) - 1:
                out.append(sum(self.last[b] for b in blocks))
            else:
                out.append(sum(self.forward[b] + self.backward[b] for b in blocks))
            i += n
        return out

    def with_rebuilt_last(self) -> "BlockCosts":
        """The costs when the last stage rebuilds instead of keeping its graph
        (model.rebuild_last_stage): each block there costs what it costs in a middle stage."""
        return replace(self, last=[f + b for f, b in zip(self.forward, self.backward)])

    def to_dict(self):
        return {"forward": self.forward, "backward": self.backward, "last": self.last,
                "step": self.step, "output_bytes": self.output_bytes,
                "input_bytes": self.input_bytes, "kept": self.kept}


def _median_seconds(fn, device, repeats, setup=None):
    """Median time of fn() over `repeats` runs after a warm-up; setup() runs untimed before each."""
    times = []
    for r in range(repeats + 1):
        if setup is not None:
            setup()
        synchronize(device)
        start = time.perf_counter()
        fn()
        synchronize(device)
        if r:  # the first run warms up the allocator and kernel selection
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def _copies_and_batch(blocks, input_shape, batch_size, num_classes, device, dtype):
    """Deep copies of the blocks (timing must not touch the model that trains) and a random
    batch with labels."""
    blocks = [to_device(copy.deepcopy(b), device, dtype).train() for b in blocks]
    g = torch.Generator().manual_seed(0)
    if len(input_shape) == 1:  # a language model's windows: token ids in, one label per token
        x = torch.randint(0, num_classes, (batch_size, *input_shape), generator=g).to(device)
        labels = torch.randint(0, num_classes, (x.numel(),), generator=g).to(device)
        return blocks, x, labels
    x = torch.randn(batch_size, *input_shape, generator=g, dtype=dtype).to(device)
    labels = torch.randint(0, num_classes, (batch_size,), generator=g).to(device)
    return blocks, x, labels


def _each_block(blocks, input_shape, batch_size, num_classes, device, dtype, repeats,
                time_block) -> BlockCosts:
    """Both measurements' loop: block i timed on the output of block i - 1, as training feeds it.
    time_block(i, block, x, labels, is_head, grad_y, timed) -> ((forward, backward, last, kept)
    seconds, each from timed(fn, setup=None), kept None where not measured; `fused`, one
    training pass of the block, after which the optimizer step is timed)."""
    device = torch.device(device)
    blocks, x, labels = _copies_and_batch(blocks, input_shape, batch_size, num_classes, device,
                                          dtype)
    costs = BlockCosts([], [], [], [], [], x.numel() * x.element_size())

    def timed(fn, setup=None):
        return _median_seconds(fn, device, repeats, setup=setup)
    for i, block in enumerate(blocks):
        with torch.no_grad():
            y = block(x)
        (forward, backward, last, kept), fused = time_block(i, block, x, labels,
                                                            i == len(blocks) - 1,
                                                            torch.randn_like(y), timed)
        if kept is not None:
            costs.kept.append(kept)
        optimizer = StageOptimizer(block, LRSchedule(0.0, 1))
        for part, seconds in zip((costs.forward, costs.backward, costs.last, costs.step),
                                 (forward, backward, last,
                                  timed(optimizer.step,
                                        setup=lambda: (fused(), optimizer.accumulated())))):
            part.append(seconds)
        costs.output_bytes.append(y.numel() * y.element_size())
        block.zero_grad(set_to_none=True)
        x = y
    return costs


def measure_block_costs(blocks, input_shape, batch_size, num_classes, *, device="cpu",
                        dtype=torch.float32, repeats=3, time_kept=False) -> BlockCosts:
    """Time every block (see the module docstring) on a random batch of `input_shape`."""
    def time_block(i, block, x, labels, is_head, grad_y, timed):
        # Timed where training runs it: the first block on stage 0, whose backward computes no
        # gradient for the images; any other on a middle stage, whose backward must send one.
        # The forward feeds the FIFO of a buffered block, the backward pops it.
        stage = Stage([block], index=0 if i == 0 else 1, num_stages=3)
        with torch.no_grad():
            y = stage(x)
        stage.clear()

        def fwd():
            stage(x)
            stage.clear()

        def kept():  # one micro-batch kept by the block, forward then backward
            stage.set_kept([stage.window])
            try:
                stage.backward(stage(x, 0), grad_y, 0)
            finally:
                stage.set_kept(None)
                stage.clear()

        def fused():
            leaf = x.detach().requires_grad_(i > 0)  # no gradient for the images either
            out = block(leaf)
            if is_head:
                F.cross_entropy(out, labels).backward()
            else:
                out.backward(grad_y)
        return (timed(fwd), timed(lambda: stage.backward(y, grad_y), setup=lambda: stage(x)),
                timed(fused), timed(kept) if time_kept else None), fused
    return _each_block(blocks, input_shape, batch_size, num_classes, device, dtype, repeats,
                       time_block)


def measure_net_costs(net, batch_size, *, device="cpu", dtype=torch.float32,
                      time_kept=False) -> BlockCosts:
    """measure_block_costs of a fresh copy of the net `net` (models.NetSpec) on its input."""
    return measure_block_costs(net.blocks(), net.input_shape, batch_size, net.num_classes,
                               device=device, dtype=dtype, time_kept=time_kept)


def measure_autograd_costs(blocks, input_shape, batch_size, num_classes, *, device="cpu",
                           dtype=torch.float32, repeats=3) -> BlockCosts:
    """Per-block costs of ordinary autograd training (what 1F1B or GPipe run): forward with
    graph, its backward (last = both), the optimizer step."""
    def time_block(i, block, x, labels, is_head, grad_y, timed):
        graph = {}

        def fwd():  # token ids (a language model's first block) take no gradient
            leaf = x.detach().requires_grad_(x.is_floating_point())
            out = block(leaf)
            graph["out"] = F.cross_entropy(out, labels) if is_head else out

        def bwd():
            graph.pop("out").backward(None if is_head else grad_y)
        forward, backward = timed(fwd), timed(bwd, setup=fwd)
        return (forward, backward, forward + backward, None), lambda: (fwd(), bwd())
    return _each_block(blocks, input_shape, batch_size, num_classes, device, dtype, repeats,
                       time_block)
