"""A pipeline stage: consecutive blocks with PETRA's forward and backward rules (docs/design.md §1).

forward(x) runs without an autograd graph. backward(ỹ, δy) walks the blocks in reverse: a
reversible block rebuilds its input from its output with the current weights while recording the
graph of its branch (one forward of the branch, not two) in its own `backward_from_output(ỹ, δy)`,
since the coupling rule is the block's business (RevNet: models/blocks.py, RevViT: models/vit.py),
a buffered block pops its input from a
FIFO and recomputes its forward; one vector-Jacobian product per block gives the input gradient and
accumulates the parameter gradients into .grad. The last stage does forward, loss and backward at
once (no delay, so nothing is kept).

Switches for the delayed-gradient baselines (paper Table 4):
- buffer_inputs: reversible blocks keep their input in the FIFO too, instead of rebuilding it.
- stash_weights: every in-flight micro-batch keeps the weights of its forward, and its backward
  computes the vector-Jacobian product with them (a rebuild still uses the current weights).
"""
from collections import deque

import torch
import torch.nn.functional as F
from torch import nn

from .compress import Codec, nbytes
from .models import frozen_bn_stats
from .trace import BACKWARD, FORWARD, LOSS, NULL_TRACER


class Stage(nn.Module):
    # how the FIFOs keep their inputs (comm.buffers): packed at the push, unpacked at the pop
    buffer_codec = Codec("none")

    def __init__(self, blocks, index: int, num_stages: int, *, buffer_inputs: bool = False,
                 stash_weights: bool = False):
        super().__init__()
        self.blocks = nn.ModuleList(blocks)
        self.index, self.num_stages = index, num_stages
        self.is_first, self.is_last = index == 0, index == num_stages - 1
        self.stash_weights = stash_weights
        self.buffered = [not (b.reversible and not buffer_inputs) for b in blocks]
        self.fifos = [deque() for _ in blocks]   # inputs of buffered blocks, oldest first
        self.stashes = [deque() for _ in blocks]  # weights of in-flight micro-batches
        self.peak_fifo_bytes = self.peak_stash_bytes = 0  # for the memory report
        self.between_blocks = None  # called between blocks (the MPI engine polls its transport)

    @property
    def input_dtype(self):
        """The dtype this stage's input must have when it is not the activations' (a language
        model's first stage takes token ids); None: the activations' dtype."""
        return getattr(self.blocks[0], "input_dtype", None) if self.is_first else None

    @property
    def needs_rebuilt_input(self) -> bool:
        """Whether backward uses the ỹ it is given (else only δy matters: a sender may skip ỹ)."""
        return not self.buffered[-1]

    def in_flight(self) -> int:
        return max(len(f) for f in self.fifos) if any(self.buffered) else 0

    @torch.no_grad()
    def forward(self, x):
        with frozen_bn_stats():
            for block, fifo, stash, buffered in zip(self.blocks, self.fifos, self.stashes,
                                                    self.buffered):
                if buffered:
                    fifo.append(self.buffer_codec.pack(x))
                if self.stash_weights:
                    stash.append([p.detach().clone() for p in block.parameters()])
                x = block(x)
                if self.between_blocks is not None:
                    self.between_blocks()
        self.peak_fifo_bytes = max(self.peak_fifo_bytes, _queued_bytes(self.fifos))
        self.peak_stash_bytes = max(self.peak_stash_bytes, _queued_bytes(self.stashes))
        return x

    def backward(self, y, grad_y):
        """From the stage output ỹ (or None when every block is buffered) and δy, accumulate the
        parameter gradients and return (x̃, δx), the stage input and its gradient (δx is None for
        the network's input)."""
        for i in reversed(range(len(self.blocks))):
            y, grad_y = self._block_backward(i, y, grad_y)
            if self.between_blocks is not None:
                self.between_blocks()
        return y, grad_y

    def _block_backward(self, i, y, grad_y):
        block = self.blocks[i]
        need_grad_x = not (self.is_first and i == 0)
        stashed = self.stashes[i].popleft() if self.stash_weights else None
        if not self.buffered[i] and stashed is None:
            return block.backward_from_output(y, grad_y, need_grad_x)
        if self.buffered[i]:
            x = self.buffer_codec.unpack(self.fifos[i].popleft())
        else:  # rebuild with the current weights, differentiate with the stashed ones
            with torch.no_grad(), frozen_bn_stats():  # the graph pass below updates the stats
                x = block.inverse(y)
        with _weights(block, stashed):
            x_leaf = x.detach().requires_grad_(need_grad_x)
            with torch.enable_grad():
                out = block(x_leaf)
            out.backward(grad_y)
        return x, x_leaf.grad

    def forward_backward_loss(self, x, labels, tracer=NULL_TRACER, b=-1):
        """Last stage: forward, cross-entropy loss and backward at once. Returns (loss, logits, δx).
        The tracer (trace.py) times the three parts as spans of micro-batch b."""
        x_leaf = x.detach().requires_grad_(not self.is_first)
        with torch.enable_grad():
            with tracer.span(FORWARD, b):
                logits = x_leaf
                for block in self.blocks:
                    logits = block(logits)
            with tracer.span(LOSS, b):
                loss = F.cross_entropy(logits, labels)
        with tracer.span(BACKWARD, b):
            loss.backward()
        return loss.detach(), logits.detach(), x_leaf.grad

    @torch.no_grad()
    def evaluate(self, x):
        """Forward with running batch-norm statistics (the caller puts the stage in eval mode)."""
        for block in self.blocks:
            x = block(x)
        return x

    def clear(self):
        for q in self.fifos + self.stashes:
            q.clear()


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
