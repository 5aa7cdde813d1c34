"""One lowered action of the schedule (core/schedule.py, TickSchedule.lowered), for both engines:
read the data, receive, compute, send or report. A stage's actions pass values to each other
through its StageRun: a receive keeps the input that the forward then takes, the forward keeps
the output that the send takes, and so on; a value taken that no earlier action kept, or one
left over at the end of the segment, is an error.

The engines differ only in their port, where a stage's messages come from and go to: queues
between the stages of one process (engines/local.py) or MPI streams to the neighbouring ranks
(engines/mpi.py). A port has:

  receive(action) -> tuple      the tensors of the message `action` receives from action.peer:
                                (x,) for RECV_F, (ỹ or None, δy) for RECV_B, (labels,) for RECV_L
  send(action, *tensors, evaluation=False)   the same, to action.peer (evaluation: a stochastic
                                codec rounds to the nearest)
  compute(work, *args)          runs the worker's work (the MPI engine times it)
  expect(receives)              a segment begins: {receive kind: count} it will receive
  shrink(fewer)                 a stop shortened it: {receive kind: count} fewer
  flush()                       the segment is over: complete the sends
"""
from ..core.schedule import Kind


class StageRun:
    """One stage's part of one segment: its worker and port, the data it reads (stage 0), where
    its results go (the last stage: report(b, *result)), and the values between its actions."""

    def __init__(self, worker, port, batches=None, report=None, evaluating=False):
        self.worker, self.port, self.batches, self.report = worker, port, batches, report
        self.evaluating = evaluating
        self.held = {}  # (what, micro-batch) -> value, from the action that made it to its user

    @property
    def stage(self) -> int:
        return self.worker.index

    def keep(self, what, b, value):
        assert (what, b) not in self.held, f"stage {self.stage}: two {what}s of micro-batch {b}"
        self.held[(what, b)] = value

    def take(self, what, b):
        try:
            return self.held.pop((what, b))
        except KeyError:
            raise RuntimeError(f"stage {self.stage}: no {what} of micro-batch {b}: the schedule "
                               f"uses it before an action makes it") from None

    def finish(self):
        assert not self.held, f"stage {self.stage}: left over at the drain: {sorted(self.held)}"


def run_action(run: StageRun, action):
    """Run one lowered action on `run`'s stage."""
    do = _ACTIONS.get(action.kind)
    if do is None:
        raise ValueError(f"stage {run.stage}: unknown action kind {action.kind!r}")
    do(run, action.microbatch, action)


def _load(run, b, action):  # stage 0 reads the micro-batch and its labels
    x, labels = next(run.batches)
    run.keep("input", b, x)
    run.keep("labels", b, labels)


def _receive_forward(run, b, action):
    (x,) = run.port.receive(action)
    run.keep("input", b, x)


def _receive_labels(run, b, action):
    (labels,) = run.port.receive(action)
    run.keep("labels", b, labels)


def _receive_backward(run, b, action):
    run.keep("output gradient", b, run.port.receive(action))  # (ỹ, δy)


def _forward(run, b, action):
    run.keep("output", b, run.port.compute(run.worker.forward, b, run.take("input", b)))


def _backward(run, b, action):
    x, grad_x = run.port.compute(run.worker.backward, b, *run.take("output gradient", b))
    if run.stage > 0:  # stage 0 sends nothing down
        run.keep("input gradient", b, (x, grad_x))


def _forward_backward(run, b, action):  # the last stage: forward, loss and backward at once
    x, labels = run.take("input", b), run.take("labels", b)
    loss, logits, grad_x = run.port.compute(run.worker.forward_backward, b, x, labels)
    if run.stage > 0:
        run.keep("input gradient", b, (x, grad_x))
    run.keep("result", b, (loss, logits, labels))


def _evaluate(run, b, action):  # the caller has put the stage in eval mode
    y = run.worker.stage.evaluate(run.take("input", b))
    if run.worker.is_last:
        run.keep("result", b, (y, run.take("labels", b)))
    else:
        run.keep("output", b, y)


def _step(run, b, action):
    run.port.compute(run.worker.step, b)


def _send_forward(run, b, action):
    run.port.send(action, run.take("output", b), evaluation=run.evaluating)


def _send_backward(run, b, action):
    run.port.send(action, *run.take("input gradient", b))


def _send_labels(run, b, action):
    run.port.send(action, run.take("labels", b))


def _report(run, b, action):  # training: (loss, logits, labels); evaluation: (logits, labels)
    result = run.take("result", b)
    if run.report is not None:
        run.report(b, *result)


_ACTIONS = {Kind.LOAD: _load, Kind.RECV_F: _receive_forward, Kind.RECV_L: _receive_labels,
            Kind.RECV_B: _receive_backward, Kind.FORWARD: _forward, Kind.BACKWARD: _backward,
            Kind.FORWARD_BACKWARD: _forward_backward, Kind.EVALUATE: _evaluate,
            Kind.STEP: _step, Kind.SEND_F: _send_forward, Kind.SEND_B: _send_backward,
            Kind.SEND_L: _send_labels, Kind.REPORT: _report}
