"""All stages in one process, following the same schedule as the MPI engine: the reference
implementation, and the engine for single-device users and tests."""
from collections import deque

import torch

from ..compress import NO_COMPRESSION
from ..schedule import Kind, schedule_for
from ..stopping import SegmentVotes
from .evaluation import EvalTotals


class LocalEngine:
    def __init__(self, workers, method: str, replicas: int = 1, compression=NO_COMPRESSION):
        """workers: R replicas of a J-stage pipeline in rank order (replica · J + stage); with
        R > 1 each stage's gradients are averaged over its replicas at every step, as R · J
        ranks would under mpirun (replicas.py). compression (compress.Compression): every message
        between stages goes through its codec's round trip, as the MPI engine's do."""
        self.workers, self.method, self.replicas = workers, method, replicas
        self.J = len(workers) // replicas
        self.schedule = schedule_for(method, self.J, workers[0].k)
        # per worker, the codecs of what it sends: {direction: Codec}
        self.codecs = [{d: compression.codec(d, i % self.J, i // self.J)
                        for d in ("forward", "rebuilt", "gradient")} for i in range(len(workers))]
        if replicas > 1:
            from ..mpi.replicas import link_local
            link_local(workers, replicas)

    def train_segment(self, batches, n: int, on_loss=None, stop=None) -> int:
        """Train on the next n micro-batches of `batches` (an iterator of (x, labels); with
        replicas, a list of one iterator per replica), from an empty pipeline to a full drain; a
        stop request ends the segment early, at the tick and length the MPI engine would
        (stopping.SegmentVotes). on_loss(b, loss, logits, labels) sees each result
        of replica 0. Returns the number of micro-batches trained."""
        J, R = self.J, self.replicas
        feeds = list(batches) if R > 1 else [batches]
        assert len(feeds) == R, "one iterator of micro-batches per replica"
        for w in self.workers:
            w.begin_segment(n)
        # per replica: activations waiting at stage s, (ỹ, δy) waiting at stage s, labels
        queues = [([deque() for _ in range(J)], [deque() for _ in range(J)], deque())
                  for _ in range(R)]
        def read_stop():  # the MPI engine's all-reduce over the ranks: here the request itself
            level = stop.requested
            return lambda: level
        votes = None if stop is None else SegmentVotes(self.schedule, read_stop)
        t = 0
        while t < self.schedule.num_ticks(n):
            shorter = n if votes is None else votes.length(t, n)
            if shorter != n:
                n = shorter
                for w in self.workers:
                    w.begin_segment(n)  # the last backward now steps the optimizer
            # Every replica through tick t before tick t + 1: a stage's average needs all of them.
            for r in range(R):
                self._tick(self.workers[r * J:(r + 1) * J], self.codecs[r * J:(r + 1) * J],
                           *queues[r], feeds[r], t, n, on_loss if r == 0 else None)
            t += 1
        for w in self.workers:
            w.settle()  # the last step of the segment, when it waited for the replicas' average
        assert not any(q for inputs, grads, labels in queues for q in (*inputs, *grads, labels)), \
            "pipeline not drained"
        return n

    def _tick(self, workers, codecs, inputs, grads, labels, batches, t, n, on_loss):
        def send_down(s, x, grad_x):  # as the MPI engine: ỹ only to a stage that uses it
            if workers[s - 1].stage.needs_rebuilt_input:
                x = codecs[s]["rebuilt"].roundtrip(x)
            grads[s - 1].append((x, codecs[s]["gradient"].roundtrip(grad_x)))
        # Stage by stage: each action only needs what a neighbour produced at an earlier tick.
        for s, w in enumerate(workers):
            for action in w.tracer.plan(t, self.schedule.actions(s, t, n)):
                b = action.microbatch
                if action.kind is Kind.STEP:
                    w.step(b)
                    continue
                if action.kind is Kind.BACKWARD:
                    x, grad_x = w.backward(b, *grads[s].popleft())
                    if s > 0:
                        send_down(s, x, grad_x)
                    continue
                if s == 0:
                    x, y = next(batches)
                    labels.append(y)
                else:
                    x = inputs[s].popleft()
                if action.kind is Kind.FORWARD:
                    inputs[s + 1].append(codecs[s]["forward"].roundtrip(w.forward(b, x)))
                    continue
                y = labels.popleft()
                loss, logits, grad_x = w.forward_backward(b, x, y)
                if on_loss is not None:
                    on_loss(b, loss, logits, y)
                if s > 0:
                    send_down(s, x, grad_x)

    @torch.no_grad()
    def evaluate(self, batches, m=None) -> EvalTotals:
        """Forward-only pass of replica 0 (its batch-norm running statistics are the model's)."""
        totals = EvalTotals()
        pipeline = self.workers[:self.J]
        for w in pipeline:
            w.stage.eval()
        try:
            for x, y in batches:
                for w, codecs in zip(pipeline, self.codecs):
                    x = w.stage.evaluate(x)
                    if not w.is_last:  # the MPI engine sends it: rounded to the nearest
                        x = codecs["forward"].roundtrip(x, evaluation=True)
                totals.add(x, y)
        finally:
            for w in pipeline:
                w.stage.train()
        return totals
