"""A pipeline stage: consecutive blocks with PETRA's forward and backward rules (docs/design.md §1).

forward(x) runs without an autograd graph. backward(ỹ, δy) walks the blocks in reverse: a
reversible block rebuilds its input from its output with the current weights while recording the
graph of its branch (one forward of the branch, not two) in its own `backward_from_output(ỹ, δy)`,
since the coupling rule is the block's business (RevNet: models/blocks.py, RevViT: models/vit.py;
a block of one's own with an inverse alone is rebuilt by it, then its forward recomputed under
autograd), a buffered block pops its input from a
FIFO and recomputes its forward; one vector-Jacobian product per block gives the input gradient and
accumulates the parameter gradients into .grad. The last stage does forward, loss and backward at
once (no delay, so nothing is kept), with the graph of its whole part or, with rebuild_last, by
the rules above (last_stage.py).

Switches for the delayed-gradient baselines (paper Table 4):
- buffer_inputs: reversible blocks keep their input in the FIFO too, instead of rebuilding it.
- stash_weights: every in-flight micro-batch keeps the weights of its forward, and its backward
  computes the vector-Jacobian product with them (a rebuild still uses the current weights).

Kept blocks (a memory budget, memory_plan.py): `kept[i]` of the in-flight micro-batches of
block i keep the autograd graph of their forward instead of rebuilding (a reversible block) or
of buffering the input and recomputing (a buffered one: its graph holds the input). Micro-batch b
is kept by block i when b mod d_s < kept[i] (keeps_microbatch): backward first, a stage holds the
d_s consecutive micro-batches b - d_s + 1 ... b after forwarding b, so exactly kept[i] of them at
its peak. A kept forward runs the block under autograd with stashed copies of its weights (the
optimizer updates the live ones in place), and its backward back-propagates through that graph,
adds the copies' gradients into the live .grad and sends down the exact input: `delayed` with
buffer_inputs and stash_weights for that micro-batch, without the recomputation. Batch norm: the
kept forward records each batch norm's batch mean and variance (models.recorded_bn_stats), and
the backward updates the running statistics with them, so they are still updated once per
micro-batch, in the backward, in micro-batch order, from the statistics of the forward.
"""
import contextlib
from collections import deque
from dataclasses import dataclass

import torch
from torch.autograd.graph import get_gradient_edge, saved_tensors_hooks
from torch.func import functional_call
from torch import nn

from ..comm.compress import Codec, nbytes
from ..models import frozen_bn_stats, recorded_bn_stats
from .last_stage import LossAtOnce
from .schedule import PetraSchedule


class PollsBetweenBlocks:
    """A stage that can call a function between its blocks (the MPI engine polls its transport
    there: large messages move only while MPI is called, docs/performance.md)."""
    between_blocks = None

    @contextlib.contextmanager
    def calling_between_blocks(self, fn):
        """Call fn between blocks inside the `with`, as before it after."""
        previous, self.between_blocks = self.between_blocks, fn
        try:
            yield
        finally:
            self.between_blocks = previous


class Stage(PollsBetweenBlocks, LossAtOnce, nn.Module):
    def __init__(self, blocks, index: int, num_stages: int, *, schedule=None,
                 buffer_inputs: bool = False, stash_weights: bool = False, kept=None,
                 partition=None, buffer_codec=None, rebuild_last: bool = False):
        """schedule: the TickSchedule of num_stages stages it runs under (default PETRA's),
        whose in_flight(index) is the stage's window d_s; partition: blocks per stage of the
        whole split (a checkpoint records where this stage's blocks sit in the network);
        buffer_codec: how the FIFOs keep their inputs (comm.buffers: packed at the push,
        unpacked at the pop; as they are by default); rebuild_last: the last stage rebuilds
        instead of keeping its graph (set_rebuild_last)."""
        super().__init__()
        self.partition = list(partition) if partition is not None else None
        self.buffer_codec = buffer_codec if buffer_codec is not None else Codec("none")
        self.blocks = nn.ModuleList(blocks)
        self.index, self.num_stages = index, num_stages
        self.is_first, self.is_last = index == 0, index == num_stages - 1
        self.stash_weights = stash_weights
        self.buffered = [not (b.reversible and not buffer_inputs) for b in blocks]
        self.fifos = [deque() for _ in blocks]   # inputs of buffered blocks, oldest first
        self.stashes = [deque() for _ in blocks]  # weights of in-flight micro-batches
        self.peak_fifo_bytes = self.peak_stash_bytes = 0  # for the memory report
        schedule = schedule or PetraSchedule(num_stages)
        if schedule.J != num_stages:
            raise ValueError(f"a schedule of {schedule.J} stages for a stage of {num_stages}")
        self.window = schedule.in_flight(index)  # d_s: micro-batches in flight after a forward
        self.graphs = [deque() for _ in blocks]  # kept micro-batches' graphs, oldest first
        self.kept_held = HeldStorages()  # what the kept graphs hold, each storage once
        self.peak_kept_bytes = 0
        self.set_kept(kept)
        self.set_rebuild_last(rebuild_last)

    @property
    def kept_bytes(self) -> int:
        return self.kept_held.bytes

    @property
    def stash_bytes(self) -> int:
        """The weights stashed for in-flight micro-batches now (stash_weights)."""
        return _queued_bytes(self.stashes)

    def reset_peaks(self):
        """Start the peak byte counts afresh from what the stage holds now (a benchmark measures
        runs one after another on one stage)."""
        self.peak_fifo_bytes = _queued_bytes(self.fifos)
        self.peak_stash_bytes = _queued_bytes(self.stashes)
        self.peak_kept_bytes = self.kept_bytes

    def set_kept(self, kept=None):
        """The plan: per block, how many of every d_s consecutive micro-batches keep their graph
        (None: none, PETRA), at most d_s, in a stage with a delay and without stash_weights."""
        kept = [0] * len(self.blocks) if kept is None else [int(k) for k in kept]
        if len(kept) != len(self.blocks):
            raise ValueError(f"stage {self.index}: a kept plan needs {len(self.blocks)} entries "
                             f"(one per block), got {kept}")
        for i, k in enumerate(kept):
            if k and not self.can_keep:
                raise ValueError(f"stage {self.index}, block {i}: the last stage and weight "
                                 f"stashing keep no graphs")
            if not 0 <= k <= self.window:
                raise ValueError(f"stage {self.index}, block {i}: keeps {k} micro-batches, but "
                                 f"0 to {self.window} are in flight")
        if any(self.graphs):
            raise ValueError("the plan changes only with nothing in flight")
        self.kept = kept

    @property
    def can_keep(self) -> bool:
        """Whether its blocks may keep graphs (all alike): a delay, and no weight stashing."""
        return self.window > 0 and not self.stash_weights

    @torch.no_grad()
    def kept_storages_per_microbatch(self, x):
        """(per block: the storages one kept micro-batch x holds, {data_ptr: bytes}, None for a
        block that cannot keep; the stage's output), as a kept forward of every block counts
        them: blocks that share a storage name it alike. Every graph lives until the end, so no
        address is reused; nothing is kept or updated."""
        held, graphs = [], []
        with frozen_bn_stats():
            for i, block in enumerate(self.blocks):
                if self.can_keep:
                    graphs.append(_kept_forward(block, x, -1, self._needs_grad_x(i)))
                    held.append(graphs[-1].storages)
                    x = graphs[-1].output
                else:
                    held.append(None)
                    x = block(x)
        return held, x

    def keeps_microbatch(self, i: int, b) -> bool:
        """Whether block i keeps the graph of micro-batch b (the rule both engines follow)."""
        if not self.kept[i]:
            return False
        if b is None:
            raise ValueError("a stage with kept blocks needs the micro-batch index")
        return b % self.window < self.kept[i]

    @property
    def input_dtype(self):
        """The dtype this stage's input must have when it is not the activations' (a language
        model's first stage takes token ids); None: the activations' dtype."""
        return getattr(self.blocks[0], "input_dtype", None) if self.is_first else None

    @property
    def needs_rebuilt_input(self) -> bool:
        """Whether backward uses the ỹ it is given (else only δy matters: a sender may skip ỹ):
        not when its last block is buffered, nor when that block keeps the graph of every
        micro-batch in flight (each backward starts from the graph, which holds the input). The
        MPI engine asks once, when it opens its streams: set the plan before."""
        return not self.buffered[-1] and not (self.window and self.kept[-1] >= self.window)

    @torch.no_grad()
    def forward(self, x, b=None):
        """The no-graph forward of micro-batch b (b matters only to kept blocks)."""
        with frozen_bn_stats():
            for i, (block, fifo, stash, buffered) in enumerate(zip(
                    self.blocks, self.fifos, self.stashes, self.buffered)):
                keeps = self.keeps_microbatch(i, b)
                if buffered and not keeps:  # a kept graph holds its input itself
                    fifo.append(self.buffer_codec.pack(x, defer_check=True))
                if self.stash_weights:
                    stash.append([p.detach().clone() for p in block.parameters()])
                if keeps:
                    graph = _kept_forward(block, x, b, self._needs_grad_x(i))
                    self.graphs[i].append(graph)
                    self.kept_held.add(graph.storages)
                    x = graph.output
                    graph.output = None  # the graph needs its edge, not the output's storage
                else:
                    x = block(x)
                if self.between_blocks is not None:
                    self.between_blocks()
        self.peak_fifo_bytes = max(self.peak_fifo_bytes, _queued_bytes(self.fifos))
        self.peak_stash_bytes = max(self.peak_stash_bytes, _queued_bytes(self.stashes))
        self.peak_kept_bytes = max(self.peak_kept_bytes, self.kept_bytes)
        return x

    def backward(self, y, grad_y, b=None):
        """From the stage output ỹ (or None when every block is buffered) and δy of micro-batch
        b, accumulate the parameter gradients and return (x̃, δx), the stage input and its
        gradient (δx is None for the network's input)."""
        for i in reversed(range(len(self.blocks))):
            if self.keeps_microbatch(i, b):
                y, grad_y = self._kept_backward(i, b, grad_y)
            else:
                y, grad_y = self._block_backward(i, y, grad_y)
            if self.between_blocks is not None:
                self.between_blocks()
        return y, grad_y

    def _needs_grad_x(self, i) -> bool:
        return not (self.is_first and i == 0)

    def _kept_backward(self, i, b, grad_y):
        graph = self.graphs[i].popleft()
        assert graph.microbatch == b, f"block {i} kept micro-batch {graph.microbatch}, not {b}"
        self.kept_held.remove(graph.storages)
        torch.autograd.backward(graph.edge, grad_tensors=grad_y)
        _add_grads(self.blocks[i].parameters(), graph.weights)
        for bn, mean, var in graph.batch_norms:  # the running statistics, once
            bn.update_running_stats(mean, var)
        return graph.input.detach(), graph.input.grad

    def _block_backward(self, i, y, grad_y):
        block = self.blocks[i]
        need_grad_x = self._needs_grad_x(i)
        stashed = self.stashes[i].popleft() if self.stash_weights else None
        own_backward = getattr(block, "backward_from_output", None)
        if not self.buffered[i] and stashed is None and own_backward is not None:
            return own_backward(y, grad_y, need_grad_x)
        if self.buffered[i]:
            x = self.buffer_codec.unpack_checked(self.fifos[i].popleft())
        else:  # rebuild with the current weights, differentiate with the stashed ones (or,
            # for a block with an inverse alone, the current ones: two forwards)
            with torch.no_grad(), frozen_bn_stats():  # the graph pass below updates the stats
                x = block.inverse(y)
        with _weights(block, stashed):
            x_leaf = x.detach().requires_grad_(need_grad_x)
            with torch.enable_grad():
                out = block(x_leaf)
            out.backward(grad_y)
        return x, x_leaf.grad

    @torch.no_grad()
    def evaluate(self, x):
        """Forward with running batch-norm statistics (the caller puts the stage in eval mode)."""
        for block in self.blocks:
            x = block(x)
        return x

    def clear(self):
        for q in self.fifos + self.stashes + self.graphs:
            q.clear()
        self.kept_held = HeldStorages()


class HeldStorages:
    """The storages that kept graphs hold, each counted once however many graphs hold it
    (consecutive blocks of one micro-batch share some: a block's saved output is the next
    block's input). `bytes` is their sum."""

    def __init__(self):
        self.holders = {}  # data_ptr: [bytes, graphs holding it]
        self.bytes = 0

    def add(self, storages: dict):
        for ptr, size in storages.items():
            entry = self.holders.setdefault(ptr, [size, 0])
            entry[1] += 1
            if entry[1] == 1:  # its first holder
                self.bytes += size

    def remove(self, storages: dict):
        for ptr in storages:
            entry = self.holders[ptr]
            entry[1] -= 1
            if entry[1] == 0:  # its last holder left
                del self.holders[ptr]
                self.bytes -= entry[0]


def _add_grads(params, stashed):
    """Add the stashed copies' gradients into the live parameters' .grad."""
    for p, copy in zip(params, stashed):
        if copy.grad is None:
            continue
        if p.grad is None:
            p.grad = copy.grad
        else:
            p.grad += copy.grad


@dataclass
class KeptGraph:
    """What a kept micro-batch holds between its forward and its backward."""
    microbatch: int
    input: torch.Tensor        # the block's input, a leaf (its .grad is δx)
    output: torch.Tensor | None  # the output, until the stage has passed it on
    edge: object               # the output's gradient edge: the backward starts there
    weights: list              # stashed copies of the block's parameters, leaves
    batch_norms: list          # (module, batch mean, unbiased batch variance) per batch-norm call
    storages: dict             # what the graph holds, {data_ptr: bytes}: see _kept_forward

    @property
    def bytes(self) -> int:
        return sum(self.storages.values())


def _kept_forward(block, x, b, need_grad_x) -> KeptGraph:
    """Run `block` on x under autograd with stashed copies of its weights, recording what the
    graph saves. Its bytes: the distinct storages of the saved tensors, the stashed weights and
    the input, less the block's own parameters and buffers (a stage holds them anyway)."""
    names = [n for n, _ in block.named_parameters()]
    live = list(block.parameters())
    weights = [p.detach().clone().requires_grad_(p.requires_grad) for p in live]
    x_leaf = x.detach().requires_grad_(need_grad_x)
    saved, batch_norms = [], []

    def pack(t):
        saved.append(t)
        return t

    with torch.enable_grad(), saved_tensors_hooks(pack, lambda t: t), \
            recorded_bn_stats(batch_norms):
        out = functional_call(block, dict(zip(names, weights)), (x_leaf,))
    own = {t.untyped_storage().data_ptr() for t in (*live, *block.buffers())}
    held = {}
    for t in (*saved, *weights, x_leaf, *(t for _, *stats in batch_norms for t in stats)):
        storage = t.untyped_storage()
        if storage.data_ptr() not in own:
            held[storage.data_ptr()] = storage.nbytes()
    return KeptGraph(b, x_leaf, out.detach(), get_gradient_edge(out), weights, batch_norms,
                     held)


def _queued_bytes(queues) -> int:
    return sum(nbytes(item) for q in queues for item in q)


class _weights:
    """Temporarily swap a block's parameters for stashed copies (no-op for None)."""

    def __init__(self, block, stashed):
        self.params, self.stashed = list(block.parameters()), stashed

    def __enter__(self):
        if self.stashed is not None:
            self.current = [p.data for p in self.params]
            for p, s in zip(self.params, self.stashed):
                p.data = s

    def __exit__(self, *exc):
        if self.stashed is not None:
            for p, c in zip(self.params, self.current):
                p.data = c
