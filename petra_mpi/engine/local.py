"""All stages in one process, following the same schedule as the MPI engine: the reference
implementation, and the engine for single-device users and tests."""
from collections import deque

import torch

from ..schedule import backward_microbatch, forward_microbatch, num_ticks
from .metrics import EvalTotals


class LocalEngine:
    def __init__(self, workers, method: str):
        self.workers, self.method = workers, method

    def train_segment(self, batches, n: int, on_loss=None):
        """Train on the next n micro-batches of `batches` (an iterator of (x, labels)), from an
        empty pipeline to a full drain. on_loss(b, loss, logits, labels) sees each result."""
        J = len(self.workers)
        for w in self.workers:
            w.begin_segment(n)
        inputs = [deque() for _ in range(J)]     # activations waiting at stage s
        grads = [deque() for _ in range(J)]      # (ỹ, δy) waiting at stage s
        labels = deque()
        for t in range(num_ticks(self.method, J, n)):
            for s, w in enumerate(self.workers):
                b = forward_microbatch(self.method, J, s, t, n)
                if b is None:
                    continue
                if s == 0:
                    x, y = next(batches)
                    labels.append(y)
                else:
                    x = inputs[s].popleft()
                if w.is_last:
                    y = labels.popleft()
                    loss, logits, grad_x = w.forward_backward(b, x, y)
                    if on_loss is not None:
                        on_loss(b, loss, logits, y)
                    if s > 0:
                        grads[s - 1].append((x, grad_x))
                else:
                    inputs[s + 1].append(w.forward(b, x))
            for s, w in enumerate(self.workers[:-1]):
                b = backward_microbatch(self.method, J, s, t, n)
                if b is None:
                    continue
                x, grad_x = w.backward(b, *grads[s].popleft())
                if s > 0:
                    grads[s - 1].append((x, grad_x))
        assert not any(inputs) and not any(grads) and not labels, "pipeline not drained"

    @torch.no_grad()
    def evaluate(self, batches, m=None) -> EvalTotals:
        totals = EvalTotals()
        for w in self.workers:
            w.stage.eval()
        try:
            for x, y in batches:
                for w in self.workers:
                    x = w.stage.evaluate(x)
                totals.add(x, y)
        finally:
            for w in self.workers:
                w.stage.train()
        return totals
