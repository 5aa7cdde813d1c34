"""One stage's work, shared by the single-process and the MPI engine: the three operations of
the schedule, with the optimizer step when the schedule calls for one. The engines only move
tensors between workers."""
from ..optim import StageOptimizer
from ..schedule import updates_after
from ..stages import Stage
from ..trace import BACKWARD, FORWARD, NULL_TRACER, STEP


class StageWorker:
    tracer = NULL_TRACER  # train.py sets a recording one when run.trace is on

    def __init__(self, stage: Stage, optimizer: StageOptimizer, accumulation: int = 1,
                 on_update=None):
        self.stage, self.optimizer, self.k = stage, optimizer, accumulation
        self.on_update = on_update  # called as on_update(worker) with averaged-to-be grads, before a step
        self.n = 0  # micro-batches in the current segment

    @property
    def index(self):
        return self.stage.index

    @property
    def is_last(self):
        return self.stage.is_last

    def begin_segment(self, n: int):
        """Start (or shorten, on a stop request) a segment of n micro-batches."""
        self.n = n
        self.stage.train()

    def forward(self, b, x):
        with self.tracer.span(FORWARD, b):
            return self.stage(x)

    def backward(self, b, y, grad_y):
        with self.tracer.span(BACKWARD, b):
            x, grad_x = self.stage.backward(y, grad_y)
        self._accumulated(b)
        return x, grad_x

    def forward_backward(self, b, x, labels):
        # the stage splits this op into forward, loss and backward spans
        loss, logits, grad_x = self.stage.forward_backward_loss(x, labels, self.tracer, b)
        self._accumulated(b)
        return loss, logits, grad_x

    def _accumulated(self, b):
        self.optimizer.accumulated()
        if updates_after(b, self.n, self.k):
            if self.on_update is not None:
                self.on_update(self)
            with self.tracer.span(STEP, b):
                self.optimizer.step()
