"""All stages in one process, following the same schedule as the MPI engine: the reference
implementation, and the engine for single-device users and tests."""
from collections import deque

import torch

from ..schedule import num_ticks, stop_count, tick_ops
from ..stopping import STOP_CHECK_TICKS
from .metrics import EvalTotals


class LocalEngine:
    def __init__(self, workers, method: str):
        self.workers, self.method = workers, method

    def train_segment(self, batches, n: int, on_loss=None, stop=None) -> int:
        """Train on the next n micro-batches of `batches` (an iterator of (x, labels)), from an
        empty pipeline to a full drain; a stop request ends the segment early. on_loss(b, loss,
        logits, labels) sees each result. Returns the number of micro-batches trained."""
        J = len(self.workers)
        for w in self.workers:
            w.begin_segment(n)
        inputs = [deque() for _ in range(J)]     # activations waiting at stage s
        grads = [deque() for _ in range(J)]      # (ỹ, δy) waiting at stage s
        labels = deque()
        t = 0
        while t < num_ticks(self.method, J, n):
            if stop is not None and stop.requested and t % STOP_CHECK_TICKS == 0:
                n = stop_count(self.method, J, t, n)
                for w in self.workers:
                    w.begin_segment(n)  # the last backward now steps the optimizer
            # Stage by stage: each op only needs what a neighbour produced at an earlier tick.
            for s, w in enumerate(self.workers):
                for op, b in w.tracer.plan(t, tick_ops(self.method, J, s, t, n)):
                    if op == "backward":
                        x, grad_x = w.backward(b, *grads[s].popleft())
                        if s > 0:
                            grads[s - 1].append((x, grad_x))
                        continue
                    if s == 0:
                        x, y = next(batches)
                        labels.append(y)
                    else:
                        x = inputs[s].popleft()
                    if op == "forward":
                        inputs[s + 1].append(w.forward(b, x))
                        continue
                    y = labels.popleft()
                    loss, logits, grad_x = w.forward_backward(b, x, y)
                    if on_loss is not None:
                        on_loss(b, loss, logits, y)
                    if s > 0:
                        grads[s - 1].append((x, grad_x))
            t += 1
        assert not any(inputs) and not any(grads) and not labels, "pipeline not drained"
        return n

    def any_stop(self, stop) -> bool:
        return stop is not None and stop.requested

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
