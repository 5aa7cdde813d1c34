"""The last stage's tick: forward, loss and backward of one micro-batch at once (docs/design.md
§1), in one of two ways (model.rebuild_last_stage):
- with its graph (the default): one forward of the whole stage under autograd, the loss, one
  backward. Cost: 3 forwards' worth per block; memory: the graph of the stage's whole part for
  its micro-batch, the most that any PETRA rank holds.
- rebuilt: the forward without a graph, as every other stage's (Stage.forward: a buffered block
  pushes its input to its FIFO, a reversible one keeps nothing), the loss and its gradient on the
  detached logits, then Stage.backward (a reversible block rebuilds its input from its output, a
  buffered one pops its input and recomputes: checkpointing). Cost: one more forward per
  micro-batch; memory: the buffered blocks' inputs of one micro-batch (and, while the backward
  runs, one block's graph). Batch norm: the forward leaves the running statistics alone
  (Stage.forward), the backward's graph pass updates them, once per micro-batch as before. The
  gradients equal the graph's up to the rounding of the reversible blocks' rebuilt inputs.
"""
import torch
import torch.nn.functional as F

from .trace import BACKWARD, FORWARD, LOSS, NULL_TRACER


class LossAtOnce:
    """Stage's last-stage action; rebuild_last says which way it runs (set_rebuild_last)."""
    rebuild_last = False

    def set_rebuild_last(self, on: bool):
        """Rebuild (True) or keep the graph (False) in forward_backward_loss: only on the last
        stage, and only with nothing in flight (a benchmark switches one built stage)."""
        if on and not self.is_last:
            raise ValueError(f"stage {self.index}: only the last stage runs the loss, so only "
                             f"it can rebuild instead of keeping its graph")
        if any(self.fifos):
            raise ValueError("rebuild_last changes only with nothing in flight")
        self.rebuild_last = bool(on)

    def forward_backward_loss(self, x, labels, tracer=NULL_TRACER, b=-1):
        """Last stage: forward, cross-entropy loss and backward at once. Returns (loss, logits, δx).
        The tracer (trace.py) times the three parts as spans of micro-batch b."""
        if self.rebuild_last:
            return self._rebuilt_forward_backward_loss(x, labels, tracer, b)
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

    def _rebuilt_forward_backward_loss(self, x, labels, tracer, b):
        with tracer.span(FORWARD, b):
            logits = self.forward(x, b)  # no graph; batch norm's running statistics untouched
        with tracer.span(LOSS, b):
            logits_leaf = logits.detach().requires_grad_()
            with torch.enable_grad():
                loss = F.cross_entropy(logits_leaf, labels)
            loss.backward()
        with tracer.span(BACKWARD, b):
            _, grad_x = self.backward(logits, logits_leaf.grad, b)
        return loss.detach(), logits, grad_x
