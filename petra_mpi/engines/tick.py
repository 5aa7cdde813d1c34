"""One action of the schedule, for both engines: what a stage receives, computes and sends.

The engines differ only in where a stage's messages come from and go to: queues between the
stages of one process (engines/local.py) or MPI streams to the neighbouring ranks (engines/mpi.py).
Each gives run_action a port with:

  input() -> (x, labels)        the micro-batch's input; stage 0 reads it from the data, with its
                                labels (passed on to the last stage), elsewhere labels is None
  labels() -> labels            the last stage's labels, when it is not stage 0
  gradient_pair() -> (ỹ, δy)    from the next stage for a backward (ỹ None where it is not sent)
  send_up(y)                    the activation, to the next stage
  send_down(x̃, δx)              to the previous stage (nothing on stage 0)
  compute(work, *args)          runs the worker's work (the MPI engine times it)
  on_loss                       None, or on_loss(b, loss, logits, labels) for each result

The order of the port's calls is the order of the MPI engine's receives and sends in time.
"""
from ..core.schedule import Kind


def run_action(worker, action, port):
    """One action of the schedule on `worker`'s stage: receive its inputs, compute, send."""
    b = action.microbatch
    if action.kind is Kind.STEP:
        port.compute(worker.step, b)
    elif action.kind is Kind.BACKWARD:
        x, grad_x = port.compute(worker.backward, b, *port.gradient_pair())
        port.send_down(x, grad_x)
    elif action.kind is Kind.FORWARD:
        x, _ = port.input()
        port.send_up(port.compute(worker.forward, b, x))
    else:  # last stage: forward, loss and backward at once
        x, labels = port.input()
        labels = port.labels() if labels is None else labels
        loss, logits, grad_x = port.compute(worker.forward_backward, b, x, labels)
        port.send_down(x, grad_x)
        if port.on_loss is not None:  # after the send: .item() and logging wait here
            port.on_loss(b, loss, logits, labels)
