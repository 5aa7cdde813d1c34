"""One rank per stage: the paper's Algorithm 1 over the run's transport (comm.transport: MPI, or
torch.distributed).

Rank r runs stage r of J = world size, through the segment driver both engines share
(engines/segment.py); what is this engine's own is its port, MPIPort below: each lowered action
of the schedule that sends or receives (core/schedule.py) goes to or comes from the streams of its
channels (comm/channels.py), to or from the rank its peer names. Waiting on a neighbour's message
is the only synchronisation. Rank 0 reads the data and sends each micro-batch's labels straight
to the last rank.

With R replicas (World.split) the pipeline is the replica's own group, and each stage also
averages its gradients over its data-parallel group before a step (comm/replicas.py); stop votes
stay on the whole world, so every replica shortens a segment at the same tick.
"""
import functools
import sys
import time

import torch

from ..comm.channels import CHANNELS, of_action
from ..comm.compress import NO_COMPRESSION
from ..comm.transport import CONTIGUOUS, in_layout, layout_of
from ..core.schedule import ForwardOnlySchedule, Kind, schedule_for
from . import segment
from .evaluation import EvalTotals
from .segment import NO_HEARTBEAT
from .tick import StageRun

STOP_VOTE = object()  # what the rank waits on (Transport.blocked) during a stop vote


class MPIEngine:
    def __init__(self, worker, method, world, dtype, input_shape, batch_size,
                 compression=NO_COMPRESSION, heartbeat=NO_HEARTBEAT, poll_between_blocks=True,
                 labels_per_sample=1, poll_sleep=None):
        """heartbeat: what watches the loops (the run's watchdog, run/watchdog.py).
        poll_between_blocks: drive the transport's progress between the blocks of a stage (off
        only to measure what that brings); poll_sleep: the transport's (comm/transport.py).
        labels_per_sample: targets per input sample (a language model's context: one per
        token)."""
        self.w, self.method, self.world = worker, method, world
        self.heartbeat = heartbeat
        self.poll_between_blocks = poll_between_blocks
        self.schedule = schedule_for(method, world.stages, worker.k)
        J = world.stages
        device = next(worker.stage.parameters()).device
        self.streams = world.open_streams(
            device=device, compression=compression, dtype=dtype, poll_sleep=poll_sleep,
            input_spec=((batch_size, *input_shape), CONTIGUOUS),
            output_spec=functools.partial(output_spec, worker.stage, device=device, dtype=dtype),
            uses_rebuilt=worker.stage.needs_rebuilt_input,
            labels_shape=(batch_size * labels_per_sample,))
        self.transport = self.streams.transport
        line = self.streams.line
        if world.replicas > 1:
            mean, average = world.replica_mean(self.streams)
            worker.average_with(mean)
            line += ", " + average
        line += ", " + compression.describe()
        if world.rank == 0:
            ranks = f"{world.replicas} replicas x {J} stages" if world.replicas > 1 else f"{J} ranks"
            print(f"petra_mpi: {ranks}, {line}", file=sys.stderr, flush=True)
        self.port = MPIPort(worker, self.streams)
        self.evaluation = ForwardOnlySchedule(J)

    def pending_messages(self):
        """(blocked, direction, stream, peer, count) of each stream with messages in flight, for
        the watchdog's report; blocked: the rank is waiting on that stream now. Calls no
        library."""
        rows = self.streams.pending(self._name)
        if self.transport.blocked is STOP_VOTE:
            rows.insert(0, (True, "receive", "stop vote", "every rank", 1))
        return rows

    def _name(self, stage):
        """'rank R (host)' of `stage` of this replica's pipeline."""
        rank = self.world.replica * self.world.stages + stage
        where = self.world.placement
        return f"rank {rank}" + (f" ({where[rank]['host']})" if where else "")

    def sent_bytes(self) -> int:
        """Bytes this rank sent so far (compressed size where compression is on)."""
        return self.streams.sent_bytes()

    def wait_seconds(self) -> float:
        """Time this rank spent blocked on its transport so far."""
        return self.streams.waited()

    @property
    def compute_seconds(self) -> float:
        """Time this rank spent in its stage's own work (forward, backward, optimizer step)."""
        return self.port.compute_seconds

    def train_segment(self, batches, n, on_loss=None, stop=None) -> int:
        """Algorithm 1 for this rank over a segment of n micro-batches (fill to drain); a stop
        request agreed by all ranks ends it early. Returns the micro-batches trained."""
        run = StageRun(self.w, self.port, batches, on_loss)
        vote = None if stop is None else functools.partial(
            post_stop_vote, self.world, self.transport, self.heartbeat, stop)
        # Large MPI messages move only while MPI is called: poll between blocks
        # (docs/performance.md).
        poll = self.transport.poll if self.poll_between_blocks else None
        with self.w.stage.calling_between_blocks(poll):
            return segment.train_segment(self.schedule, [run], n, vote, self.heartbeat)

    def evaluate(self, batches, m):
        """Forward-only pass over m batches by replica 0 (whose batch-norm running statistics
        are the model's; the other replicas return at once); the totals exist on its last rank
        (None elsewhere)."""
        if self.world.replica > 0:
            return None
        totals = EvalTotals() if self.w.is_last else None
        report = None if totals is None else (lambda b, logits, labels: totals.add(logits, labels))
        run = StageRun(self.w, self.port, batches, report, evaluating=True)
        segment.evaluate(self.evaluation, [run], m, self.heartbeat)
        return totals


class MPIPort:
    """This rank's port (engines/tick.py): each message of a lowered action over the streams of
    its channels (comm/channels.py), to or from the rank of its peer; the tracer records how long
    the transport made it wait."""

    def __init__(self, worker, streams):
        self.w, self.streams = worker, streams
        self.compute_seconds = 0.0  # in the stage's own work (forward, backward, optimizer step)

    def _boxes(self, action):
        """The streams of `action`'s message, in the order its channels travel (None for an
        optional one this rank lacks), each checked against the action's peer: the schedule says
        where a message goes."""
        boxes = []
        for c in of_action(action.kind.value):
            name = c.outbox if action.kind.value == c.send else c.inbox
            box = self.streams.get(name) if c.optional else self.streams[name]
            if box is not None:
                assert box.peer == action.peer, \
                    f"{name} is with stage {box.peer}, not {action.peer}"
            boxes.append((name, box))
        return boxes

    def receive(self, action):
        return tuple(None if box is None else self._get(name, box)
                     for name, box in self._boxes(action))

    def send(self, action, *tensors, evaluation=False):
        for (name, box), t in zip(self._boxes(action), tensors):
            if box is not None:
                self._put(name, box, t, evaluation)

    def compute(self, work, *args):  # the stage's own work, apart from the transport's waits
        start = time.perf_counter()
        out = work(*args)
        self.compute_seconds += time.perf_counter() - start
        return out

    def expect(self, receives):
        """Post the first receives of the segment's messages, as many per stream as its kind."""
        for kind, box in self._inboxes():
            box.expect(receives[kind])

    def shrink(self, fewer):
        for kind, box in self._inboxes():  # every receive already posted still comes
            box.shrink(fewer[kind])

    def _inboxes(self):
        """(receive kind, box) of each stream this rank receives on."""
        return [(Kind(c.receive), self.streams[c.inbox]) for c in CHANNELS
                if c.inbox in self.streams]

    def flush(self):
        for name, box in self.streams.items():
            if box.direction == "send":  # the tracer records the wait for the last sends
                before = box.waited
                box.flush()
                end = time.perf_counter()
                self.w.tracer.wait(name, end - (box.waited - before), end, -1)

    def _get(self, name, box):
        """The next message of `box`; the tracer records how long the transport made us
        wait."""
        if not self.w.tracer.enabled:
            return box.get()
        before, start = box.waited, time.perf_counter()
        t = box.get()  # it waits before anything else: the wait starts at `start`
        self.w.tracer.wait(name, start, start + box.waited - before, box.last_bytes)
        return t

    def _put(self, name, box, t, evaluation):
        """Send t on `box` (evaluation: see Outbox.put); the tracer records the wait for
        earlier sends and the bytes as sent (compressed where compression is on)."""
        if not self.w.tracer.enabled:
            box.put(t, evaluation)
            return
        before = box.waited
        nbytes = box.put(t, evaluation)  # it waits for earlier sends at its end
        end = time.perf_counter()
        self.w.tracer.wait(name, end - (box.waited - before), end, nbytes)


def post_stop_vote(world, transport, heartbeat, stop, tick):
    """Posts this rank's stop flag to a non-blocking vote of every rank (World.post_vote);
    returns the wait for its result, which SegmentVotes reads one check later: all ranks see
    the same result at the same tick and shorten the segment identically, with no extra waiting
    in the common case."""
    request = world.post_vote(int(stop.requested))

    def result():
        with transport.waiting_on(STOP_VOTE):
            transport.wait(request)
        heartbeat.agreed(tick)  # every rank is past the ticks before `tick`
        return request.value()
    return result


@torch.no_grad()
def output_spec(stage, in_shape, in_fmt, device, dtype):
    """(output shape, output layout) of `stage` for an input of in_shape in in_fmt: a probe of
    one sample in evaluation mode, which touches no running statistics."""
    was_training = stage.training
    stage.eval()
    try:
        probe = torch.zeros((1, *in_shape[1:]), device=device, dtype=stage.input_dtype or dtype)
        out = stage.evaluate(in_layout(probe, in_fmt))
        return (in_shape[0], *out.shape[1:]), layout_of(out)
    finally:
        stage.train(was_training)
