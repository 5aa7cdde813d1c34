"""One rank per stage: the paper's Algorithm 1 over comm/transport.py.

Rank r runs stage r of J = world size, through the segment driver both engines share
(engines/segment.py); what is this engine's own is its port, MPIPort below: each lowered action
of the schedule that sends or receives (core/schedule.py) goes to or comes from the MPI stream
its kind names, to or from the rank its peer names. Waiting on a neighbour's message is the only
synchronisation. Rank 0 reads the data and sends each micro-batch's labels straight to the last
rank.

With R replicas (world.split) the pipeline is the replica's own communicator, `world.pipe`, and
each stage also averages its gradients over `world.dp` before a step (replicas.py); stop votes
stay on the whole world, so every replica shortens a segment at the same tick.
"""
import functools
import sys
import time

import numpy as np

from ..comm.streams import STREAM_NAMES, open_streams
from ..comm.transport import Inbox, Outbox, Transport, cuda_aware_mpi
from ..comm.compress import NO_COMPRESSION
from ..core.schedule import ForwardOnlySchedule, Kind, schedule_for
from . import segment
from .evaluation import EvalTotals
from .tick import StageRun
from ..comm.watchdog import start_watchdog

STOP_VOTE = object()  # what the rank waits on (Transport.blocked) during a stop vote


class MPIEngine:
    def __init__(self, worker, method, world, dtype, input_shape, batch_size,
                 compression=NO_COMPRESSION, watchdog_s=0, poll_between_blocks=True,
                 labels_per_sample=1, poll_sleep=None):
        """watchdog_s: run.watchdog_s (0: none; None: automatic). poll_between_blocks: drive
        MPI's progress between the blocks of a stage (off only to measure what that brings);
        poll_sleep: the transport's (comm/transport.py).
        labels_per_sample: targets per input sample (a language model's context: one per
        token)."""
        self.w, self.method, self.world = worker, method, world
        self.poll_between_blocks = poll_between_blocks
        self.schedule = schedule_for(method, world.stages, worker.k)
        J = world.stages
        device = next(worker.stage.parameters()).device
        aware, why = cuda_aware_mpi() if device.type == "cuda" else (False, "")
        self.transport = t = Transport(device, aware, poll_sleep)
        line = f"transport {t.mode}" + (f" ({why})" if why else "")
        if world.replicas > 1:
            from ..comm.transport import device_collectives
            from ..comm.replicas import MPIMean, average_path
            allowed, why_avg = device_collectives() if t.mode == "cuda-aware" else (False, "")
            path = average_path(device.type, t.direct, allowed)
            worker.average_with(MPIMean(world.dp, t, path))
            line += f", replica average {path}" + (f" ({why_avg})" if why_avg else "")
        line += ", " + compression.describe()
        if world.rank == 0:
            ranks = f"{world.replicas} replicas x {J} stages" if world.replicas > 1 else f"{J} ranks"
            print(f"petra_mpi: {ranks}, {line}", file=sys.stderr, flush=True)
        self.streams = open_streams(world, t, worker, compression, dtype, input_shape,
                                    batch_size, labels_per_sample)
        self.port = MPIPort(worker, self.streams)
        self.evaluation = ForwardOnlySchedule(J)
        # ends this rank with a report when it hangs (watchdog.py)
        self.watchdog = start_watchdog(watchdog_s, world, self.pending_messages,
                                       self.schedule.num_ticks(1))

    def pending_messages(self):
        """(blocked, direction, stream, peer, count) of each stream with messages in flight, for
        the watchdog's report; blocked: the rank is waiting on that stream now. Reads no MPI."""
        blocked, rows = self.transport.blocked, []
        if blocked is STOP_VOTE:
            rows.append((True, "receive", "stop vote", "every rank", 1))
        for box in self.streams.values():
            receive = isinstance(box, Inbox)
            count = len(box.pending) + (1 if receive and box is blocked else 0)
            if count:
                peer = box.source if receive else box.dest
                rows.append((box is blocked, "receive" if receive else "send",
                             STREAM_NAMES[box.tag], self._name(peer), count))
        return rows

    def _name(self, stage):
        """'rank R (host)' of `stage` of this replica's pipeline."""
        rank = self.world.replica * self.world.stages + stage
        where = self.world.placement
        return f"rank {rank}" + (f" ({where[rank]['host']})" if where else "")

    def sent_bytes(self) -> int:
        """Bytes this rank sent so far (compressed size where compression is on)."""
        return sum(box.sent_bytes for box in self.streams.values() if isinstance(box, Outbox))

    def wait_seconds(self) -> float:
        """Time this rank spent blocked on MPI so far."""
        return sum(box.waited for box in self.streams.values())

    @property
    def compute_seconds(self) -> float:
        """Time this rank spent in its stage's own work (forward, backward, optimizer step)."""
        return self.port.compute_seconds

    def train_segment(self, batches, n, on_loss=None, stop=None) -> int:
        """Algorithm 1 for this rank over a segment of n micro-batches (fill to drain); a stop
        request agreed by all ranks ends it early. Returns the micro-batches trained."""
        run = StageRun(self.w, self.port, batches, on_loss)
        vote = None if stop is None else functools.partial(
            post_stop_vote, self.world, self.transport, self.watchdog, stop)
        # Large messages move only while MPI is called: poll between blocks (docs/performance.md).
        poll = self.transport.poll if self.poll_between_blocks else None
        with self.w.stage.calling_between_blocks(poll):
            return segment.train_segment(self.schedule, [run], n, vote, self.watchdog)

    def evaluate(self, batches, m):
        """Forward-only pass over m batches by replica 0 (whose batch-norm running statistics
        are the model's; the other replicas return at once); the totals exist on its last rank
        (None elsewhere)."""
        if self.world.replica > 0:
            return None
        totals = EvalTotals() if self.w.is_last else None
        report = None if totals is None else (lambda b, logits, labels: totals.add(logits, labels))
        run = StageRun(self.w, self.port, batches, report, evaluating=True)
        segment.evaluate(self.evaluation, [run], m, self.watchdog)
        return totals


# The streams that carry each kind of message, in the order they are sent (and received); a
# stream in OPTIONAL is absent where the receiver has no use for it (comm/streams.py).
STREAMS = {Kind.SEND_F: ("activation out",), Kind.RECV_F: ("activation in",),
           Kind.SEND_B: ("rebuilt out", "gradient out"),
           Kind.RECV_B: ("rebuilt in", "gradient in"),
           Kind.SEND_L: ("labels out",), Kind.RECV_L: ("labels in",)}
OPTIONAL = {"rebuilt out", "rebuilt in"}


class MPIPort:
    """This rank's port (engines/tick.py): each message of a lowered action over the streams of
    its kind, to or from the rank of its peer; the tracer records how long MPI made it wait."""

    def __init__(self, worker, streams):
        self.w, self.streams = worker, streams
        self.compute_seconds = 0.0  # in the stage's own work (forward, backward, optimizer step)

    def _boxes(self, action):
        """The streams of `action`'s message (None for an optional one this rank lacks), each
        checked against the action's peer: the schedule says where a message goes."""
        boxes = []
        for name in STREAMS[action.kind]:
            box = self.streams.get(name) if name in OPTIONAL else self.streams[name]
            if box is not None:
                peer = box.source if isinstance(box, Inbox) else box.dest
                assert peer == action.peer, f"{name} is with stage {peer}, not {action.peer}"
            boxes.append((name, box))
        return boxes

    def receive(self, action):
        return tuple(None if box is None else self._get(name, box)
                     for name, box in self._boxes(action))

    def send(self, action, *tensors, evaluation=False):
        for (name, box), t in zip(self._boxes(action), tensors):
            if box is not None:
                self._put(name, box, t, evaluation)

    def compute(self, work, *args):  # the stage's own work, apart from the waits on MPI
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
        return [(kind, self.streams[name]) for kind in (Kind.RECV_F, Kind.RECV_B, Kind.RECV_L)
                for name in STREAMS[kind] if name in self.streams]

    def flush(self):
        for name, box in self.streams.items():
            if isinstance(box, Outbox):  # the tracer records the wait for the last sends
                before = box.waited
                box.flush()
                end = time.perf_counter()
                self.w.tracer.wait(name, end - (box.waited - before), end, -1)

    def _get(self, name, box):
        """The next message of `box`; the tracer records how long MPI made us wait."""
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


def post_stop_vote(world, transport, watchdog, stop, tick):
    """Posts this rank's stop flag to a non-blocking all-reduce over every rank; returns the
    wait for its result, which SegmentVotes reads one check later: all ranks see the same
    result at the same tick and shorten the segment identically, with no extra waiting in
    the common case."""
    from mpi4py import MPI
    flag = np.array([int(stop.requested)], dtype=np.int32)
    request = world.comm.Iallreduce(MPI.IN_PLACE, flag, op=MPI.MAX)

    def result():
        with transport.waiting_on(STOP_VOTE):
            transport.wait(request)
        watchdog.agreed(tick)  # every rank is past the ticks before `tick`
        return int(flag[0])
    return result
