"""One stage's work, shared by the single-process and the MPI engine: it executes the actions
of the schedule (forward, backward, forward_backward, step) on its stage. The engines only move
tensors between workers.

Parts that watch the work (the tracer, the diagnostics, a benchmark's memory meter) are given
to the worker when it is built: the tracer times each action, and every hook in `hooks` is
called before and after each action (WorkerHooks)."""
from .optim import StageOptimizer
from .schedule import Action, Kind
from .stages import Stage
from .trace import BACKWARD, FORWARD, NULL_TRACER, STEP


class WorkerHooks:
    """Override what you need. `before` sees an action's inputs (x: the stage input of a
    forward or forward_backward, with labels for the latter), `after` its stage-input result
    (x: the rebuilt input of a backward); both run with the weights the action uses."""

    def before(self, worker, action: Action, x=None, labels=None):
        pass

    def after(self, worker, action: Action, x=None):
        pass


class StageWorker:
    def __init__(self, stage: Stage, optimizer: StageOptimizer, accumulation: int = 1, *,
                 tracer=NULL_TRACER, hooks=(), reducer=None):
        self.stage, self.optimizer, self.k = stage, optimizer, accumulation
        self.tracer = tracer    # trace.Tracer when run.trace is on
        self.hooks = list(hooks)
        self.reducer = reducer  # averages the gradients over the replicas (replicas.py)
        self.step_due = None  # with replicas: the micro-batch whose step waits for its average

    @property
    def index(self):
        return self.stage.index

    @property
    def is_last(self):
        return self.stage.is_last

    def average_with(self, reducer):
        """Average every step's gradients over the replicas with `reducer` (replicas.py)."""
        self.reducer = reducer

    def accumulate_over(self, k: int):
        """Step after every k backwards from now on (a benchmark reuses one worker for runs of
        several k)."""
        self.k = k

    def trace_with(self, tracer):
        """Record with `tracer` from now on (a benchmark traces one segment of many)."""
        self.tracer = tracer

    def begin_segment(self):
        """A training segment starts (the schedule's actions say when to step)."""
        self.stage.train()

    def _before(self, kind, b, x=None, labels=None):
        self.settle()
        if self.hooks:
            action = Action(kind, self.index, b)
            for h in self.hooks:
                h.before(self, action, x, labels)

    def _after(self, kind, b, x=None):
        for h in self.hooks:
            h.after(self, Action(kind, self.index, b), x)

    def forward(self, b, x):
        self.settle()  # a pending step first: the prediction starts from the stepped weights
        # weight prediction (if on): the forward, and its hooks, see the weights its gradient
        # will meet
        with self.optimizer.predicted_weights():
            self._before(Kind.FORWARD, b, x)
            with self.tracer.span(FORWARD, b):
                y = self.stage(x, b)  # b: which micro-batches a kept block keeps
            self._after(Kind.FORWARD, b)
        return y

    def backward(self, b, y, grad_y):
        self._before(Kind.BACKWARD, b)
        with self.tracer.span(BACKWARD, b):
            x, grad_x = self.stage.backward(y, grad_y, b)
        self.optimizer.accumulated()
        self._after(Kind.BACKWARD, b, x)
        return x, grad_x

    def forward_backward(self, b, x, labels):
        self._before(Kind.FORWARD_BACKWARD, b, x, labels)
        # the stage splits this action into forward, loss and backward spans
        loss, logits, grad_x = self.stage.forward_backward_loss(x, labels, self.tracer, b)
        self.optimizer.accumulated()
        self._after(Kind.FORWARD_BACKWARD, b)
        return loss, logits, grad_x

    def step(self, b):
        """The schedule's step action, after the backward of micro-batch b. With replicas the
        step waits for the gradients' average: until the weights are next used (settle)."""
        self._before(Kind.STEP, b)
        if self.reducer is None:
            self._step(b)
        else:
            self.reducer.start(self)
            self.step_due = b
        self._after(Kind.STEP, b)

    def settle(self):
        """Finish the replicas' average in flight, if any, and take its step. Called before every
        action and by the engines at the end of a segment, so the weights an action sees
        are those of the schedule."""
        if self.step_due is None:
            return
        b, self.step_due = self.step_due, None
        with self.tracer.span(STEP, b):
            self.reducer.finish(self)
        self._step(b)

    def _step(self, b):
        with self.tracer.span(STEP, b):
            self.optimizer.step()
