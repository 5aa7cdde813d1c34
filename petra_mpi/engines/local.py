"""All stages in one process, following the same schedule as the MPI engine: the reference
implementation, and the engine for single-device users and tests. Each action runs through the
same tick.run_action as the MPI engine's; here its messages wait in queues between the stages."""
from collections import deque

import torch

from ..comm.compress import NO_COMPRESSION
from ..core.schedule import schedule_for
from .stopping import SegmentVotes
from .evaluation import EvalTotals
from .tick import run_action


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
            from ..comm.replicas import link_local
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
        ports = self._ports(feeds, on_loss)
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
                self._tick(self.workers[r * J:(r + 1) * J], ports[r], t, n)
            t += 1
        for w in self.workers:
            w.settle()  # the last step of the segment, when it waited for the replicas' average
        assert all(p.links.empty() for stages in ports for p in stages), "pipeline not drained"
        return n

    def _ports(self, feeds, on_loss):
        """Per replica, one port per stage onto the replica's own links; on_loss sees replica 0."""
        J, ports = self.J, []
        for r, batches in enumerate(feeds):
            ranks, links = slice(r * J, (r + 1) * J), _Links(J)
            ports.append([_StagePort(s, self.workers[ranks], self.codecs[ranks], links, batches,
                                     on_loss if r == 0 else None) for s in range(J)])
        return ports

    def _tick(self, workers, ports, t, n):
        # Stage by stage: each action only needs what a neighbour produced at an earlier tick.
        for s, (w, port) in enumerate(zip(workers, ports)):
            # w.tracer.plan passes the actions through (it records the tick when tracing is on)
            for action in w.tracer.plan(t, self.schedule.actions(s, t, n)):
                run_action(w, action, port)

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


class _Links:
    """The messages between the stages of one replica's pipeline, in flight from one tick to a
    later one (the MPI engine's streams)."""
    def __init__(self, J):
        self.inputs = [deque() for _ in range(J)]  # activations waiting at stage s
        self.grads = [deque() for _ in range(J)]   # (ỹ, δy) waiting at stage s
        self.labels = deque()                      # labels waiting at the last stage

    def empty(self):
        return not any(q for q in (*self.inputs, *self.grads, self.labels))


class _StagePort:
    """Stage s's side of tick.run_action in one process: its messages go through the sender's
    codec round trip, as the MPI engine's go through the codec itself."""
    def __init__(self, s, workers, codecs, links, batches, on_loss):
        self.s, self.workers, self.codecs, self.links = s, workers, codecs, links
        self.batches, self.on_loss = batches, on_loss
        self.last = s == len(workers) - 1

    def input(self):
        if self.s > 0:
            return self.links.inputs[self.s].popleft(), None
        x, y = next(self.batches)  # stage 0 reads the data; the last stage needs its labels
        if not self.last:
            self.links.labels.append(y)
        return x, y

    def labels(self):
        return self.links.labels.popleft()

    def gradient_pair(self):
        return self.links.grads[self.s].popleft()

    def send_up(self, y):
        self.links.inputs[self.s + 1].append(self.codecs[self.s]["forward"].roundtrip(y))

    def send_down(self, x, grad_x):
        s = self.s
        if s == 0:
            return
        if self.workers[s - 1].stage.needs_rebuilt_input:  # as the MPI engine: ỹ only to a
            x = self.codecs[s]["rebuilt"].roundtrip(x)     # stage that uses it
        self.links.grads[s - 1].append((x, self.codecs[s]["gradient"].roundtrip(grad_x)))

    def compute(self, work, *args):
        return work(*args)
