"""One stage's work, shared by the single-process and the MPI engine: the three operations of
the schedule, with the optimizer step when the schedule calls for one. The engines only move
tensors between workers."""
from ..optim import StageOptimizer
from ..schedule import updates_after
from ..stages import Stage
from ..trace import BACKWARD, FORWARD, NULL_TRACER, STEP


class StageWorker:
    tracer = NULL_TRACER  # train.py sets a recording one when run.trace is on
    reducer = None  # averages the gradients over the replicas (replicas.py); None: one replica

    def __init__(self, stage: Stage, optimizer: StageOptimizer, accumulation: int = 1,
                 on_update=None):
        self.stage, self.optimizer, self.k = stage, optimizer, accumulation
        self.on_update = on_update  # called as on_update(worker) with the step's grads (summed
        # over the accumulated backwards, averaged over the replicas), just before the step
        self.n = 0  # micro-batches in the current segment
        self.step_due = None  # with replicas: the micro-batch whose step waits for its average

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
        self.settle()
        with self.tracer.span(FORWARD, b):
            return self.stage(x)

    def backward(self, b, y, grad_y):
        self.settle()
        with self.tracer.span(BACKWARD, b):
            x, grad_x = self.stage.backward(y, grad_y)
        self._accumulated(b)
        return x, grad_x

    def forward_backward(self, b, x, labels):
        self.settle()
        # the stage splits this op into forward, loss and backward spans
        loss, logits, grad_x = self.stage.forward_backward_loss(x, labels, self.tracer, b)
        self._accumulated(b)
        return loss, logits, grad_x

    def _accumulated(self, b):
        self.optimizer.accumulated()
        if not updates_after(b, self.n, self.k):
            return
        if self.reducer is None:
            self._step(b)
        else:  # the step waits for the average: until the weights are next used (settle)
            self.reducer.start(self)
            self.step_due = b

    def settle(self):
        """Finish the replicas' average in flight, if any, and take its step. Called before every
        operation and by the engines at the end of a segment, so the weights an operation sees
        are those of the schedule."""
        if self.step_due is None:
            return
        b, self.step_due = self.step_due, None
        with self.tracer.span(STEP, b):
            self.reducer.finish(self)
        self._step(b)

    def _step(self, b):
        if self.on_update is not None:
            self.on_update(self)
        with self.tracer.span(STEP, b):
            self.optimizer.step()
