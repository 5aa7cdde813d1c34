"""All stages in one process: the reference implementation of the tick, and the engine for
single-device users and tests.

At each tick, stage by stage, every stage runs its actions of the schedule lowered with their
messages (core/schedule.py, TickSchedule.lowered), the paper's Algorithm 1:
- receive the (ỹ, δy) its successor sent at an earlier tick, backward, send (x̃, δx) down;
- receive its input (stage 0: read the data and send the labels to the last stage), forward,
  send the activation up; the last stage: forward, loss and backward at once, send (x, δx)
  down, then hand the loss to on_loss;
- the optimizer step, when one is due.
The tick loop (engines/segment.py) and each action (engines/tick.py) are the MPI engine's too;
what is this engine's own is its port below: a message waits in a queue between two stages of
one process, after the round trip of the sender's codec (as the MPI engine's messages go
through the codec itself), and arrives with its micro-batch, which the receive checks.
"""
from collections import Counter, defaultdict, deque

from ..comm.channels import CHANNELS, of_action
from ..comm.compress import NO_COMPRESSION
from ..core.schedule import RECEIVER, ForwardOnlySchedule, schedule_for
from . import segment
from .evaluation import EvalTotals
from .tick import StageRun


class LocalEngine:
    def __init__(self, workers, method: str, replicas: int = 1, compression=NO_COMPRESSION):
        """workers: R replicas of a J-stage pipeline in rank order (replica · J + stage); with
        R > 1 each stage's gradients are averaged over its replicas at every step, as R · J
        ranks would under mpirun (replicas.py). compression (compress.Compression): every message
        between stages goes through its codec's round trip, as the MPI engine's do."""
        self.workers, self.method, self.replicas = workers, method, replicas
        self.J = len(workers) // replicas
        self.schedule = schedule_for(method, self.J, workers[0].k)
        self.evaluation = ForwardOnlySchedule(self.J)
        # per worker, the codecs of what it sends: {direction: Codec} (comm/channels.py)
        directions = {c.codec for c in CHANNELS if c.codec}
        self.codecs = [{d: compression.codec(d, i % self.J, i // self.J) for d in directions}
                       for i in range(len(workers))]
        if replicas > 1:
            from ..comm.replicas import link_local
            link_local(workers, replicas)

    def train_segment(self, batches, n: int, on_loss=None, stop=None) -> int:
        """Train on the next n micro-batches of `batches` (an iterator of (x, labels); with
        replicas, a list of one iterator per replica), from an empty pipeline to a full drain; a
        stop request ends the segment early, at the tick and length the MPI engine would
        (stopping.SegmentVotes). on_loss(b, loss, logits, labels) sees each result
        of replica 0. Returns the number of micro-batches trained."""
        feeds = list(batches) if self.replicas > 1 else [batches]
        assert len(feeds) == self.replicas, "one iterator of micro-batches per replica"
        runs = self._runs(feeds, on_loss)
        return segment.train_segment(self.schedule, runs, n,
                                     None if stop is None else _read_at_once(stop))

    def evaluate(self, batches, m: int) -> EvalTotals:
        """Forward-only pass of replica 0 over m batches (its batch-norm running statistics are
        the model's)."""
        totals = EvalTotals()
        runs = self._runs([batches], lambda b, logits, labels: totals.add(logits, labels),
                          evaluating=True)
        segment.evaluate(self.evaluation, runs, m)
        return totals

    def _runs(self, feeds, report, evaluating=False):
        """One StageRun per stage of the first len(feeds) replicas, in rank order, each replica
        on links of its own; stage 0 of replica r reads feeds[r]; replica 0 reports."""
        J, runs = self.J, []
        for r, batches in enumerate(feeds):
            ranks, links = slice(r * J, (r + 1) * J), _Links()
            for s, (worker, codecs) in enumerate(zip(self.workers[ranks], self.codecs[ranks])):
                port = _QueuePort(s, self.workers[ranks], codecs, links)
                runs.append(StageRun(worker, port, batches if s == 0 else None,
                                     report if r == 0 else None, evaluating))
        return runs


def _read_at_once(stop):
    """The stop vote of one process: the request itself, read where the MPI engine posts its
    all-reduce over the ranks (mpi.post_stop_vote), and applied where that one completes."""
    def read(tick):
        level = stop.requested
        return lambda: level
    return read


class _Links:
    """The messages in flight between the stages of one replica's pipeline (the MPI engine's
    streams): per (receive kind, sender, receiver), a queue of (micro-batch, tensors)."""

    def __init__(self):
        self.queues = defaultdict(deque)

    def put(self, kind, sender, receiver, b, tensors):
        self.queues[(kind, sender, receiver)].append((b, tensors))

    def take(self, kind, sender, receiver):
        return self.queues[(kind, sender, receiver)].popleft()

    def waiting_at(self, receiver) -> list:
        """The (kind, sender) of each message sent to `receiver` and not received."""
        return [(kind, sender) for (kind, sender, to), q in self.queues.items()
                if to == receiver and q]


class _QueuePort:
    """One stage's port (engines/tick.py) onto the queues of its replica's links: it receives
    from and sends to the stage each action names, and receives exactly what expect()
    announced."""

    def __init__(self, stage, pipeline, codecs, links):
        """pipeline: the replica's workers by stage; codecs: this stage's, of what it sends."""
        self.stage, self.pipeline, self.codecs, self.links = stage, pipeline, codecs, links
        self.expected = Counter()  # receive kind -> messages still to come in this segment

    def receive(self, action):
        assert self.expected[action.kind] > 0, f"a {action.kind.value} beyond those expected"
        self.expected[action.kind] -= 1
        b, tensors = self.links.take(action.kind, action.peer, action.stage)
        assert b == action.microbatch, \
            f"stage {action.stage}: {action.kind.value} {action.microbatch} got micro-batch {b}"
        return tensors

    def send(self, action, *tensors, evaluation=False):
        self.links.put(RECEIVER[action.kind], action.stage, action.peer, action.microbatch,
                       self._encoded(action, tensors, evaluation))

    def _encoded(self, action, tensors, evaluation):
        """What the receiver gets: each tensor after the round trip of this stage's codec of
        its channel; an optional channel's only where the receiver uses it (as the MPI engine's
        streams carry no other)."""
        wanted = self.pipeline[action.peer].stage.needs_rebuilt_input
        return tuple(None if c.optional and not wanted else
                     self.codecs[c.codec].roundtrip(t, evaluation) if c.codec else t
                     for c, t in zip(of_action(action.kind.value), tensors))

    def compute(self, work, *args):
        return work(*args)

    def expect(self, receives):
        assert not +self.expected, "previous messages were not all received"
        self.expected = Counter(receives)

    def shrink(self, fewer):
        self.expected.subtract(fewer)
        assert all(count >= 0 for count in self.expected.values()), "received more than sent"

    def flush(self):
        """The segment is over: every message sent to this stage was received."""
        assert not +self.expected and not self.links.waiting_at(self.stage), \
            f"stage {self.stage}: pipeline not drained"
