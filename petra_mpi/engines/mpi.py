"""One rank per stage: the loop of the paper's Algorithm 1 over comm/transport.py.

Rank r runs stage r of J = world size. Its actions come from the schedule in order (backward,
forward, step of each tick); waiting on a neighbour's message is the only synchronisation. Rank 0
reads the data and sends each micro-batch's labels straight to the last rank.

With R replicas (world.split) the pipeline is the replica's own communicator, `world.pipe`, and
each stage also averages its gradients over `world.dp` before a step (replicas.py); stop votes
stay on the whole world, so every replica shortens a segment at the same tick.
"""
import sys
import time

import numpy as np
import torch

from ..comm.streams import STREAM_NAMES, open_streams
from ..comm.transport import RECEIVE_DEPTH, Inbox, Outbox, Transport, cuda_aware_mpi
from ..comm.compress import NO_COMPRESSION
from ..core.schedule import STOP_MARGIN, schedule_for
from .stopping import SegmentVotes
from .evaluation import EvalTotals
from .tick import run_action
from ..comm.watchdog import start_watchdog

# A stop keeps STOP_MARGIN micro-batches beyond what has entered: enough for the receives each
# stream has posted ahead (up to RECEIVE_DEPTH past the last one received), which must all come.
assert RECEIVE_DEPTH <= STOP_MARGIN

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
        self.inboxes = [b for b in self.streams.values() if isinstance(b, Inbox)]
        self.outboxes = [b for b in self.streams.values() if isinstance(b, Outbox)]
        self.compute_seconds = 0.0  # in the stage's own work (forward, backward, optimizer step)
        self.batches = self.on_loss = None  # the segment's, for the port (train_segment)
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
        return sum(box.sent_bytes for box in self.outboxes)

    def wait_seconds(self) -> float:
        """Time this rank spent blocked on MPI so far."""
        return sum(box.waited for box in self.streams.values())

    def _get(self, name):
        """The next message of stream `name`; the tracer records how long MPI made us wait."""
        box = self.streams[name]
        if not self.w.tracer.enabled:
            return box.get()
        before, start = box.waited, time.perf_counter()
        t = box.get()  # it waits before anything else: the wait starts at `start`
        self.w.tracer.wait(name, start, start + box.waited - before, box.last_bytes)
        return t

    def _put(self, name, t, evaluation=False):
        """Send t on stream `name` (evaluation: see Outbox.put); the tracer records the wait for
        earlier sends and the bytes as sent (compressed where compression is on)."""
        box = self.streams[name]
        if not self.w.tracer.enabled:
            box.put(t, evaluation)
            return
        before = box.waited
        nbytes = box.put(t, evaluation)  # it waits for earlier sends at its end
        end = time.perf_counter()
        self.w.tracer.wait(name, end - (box.waited - before), end, nbytes)

    def _expect(self, n):
        for box in self.inboxes:
            box.expect(n)

    # The port of tick.run_action: this rank's streams, for the segment's batches and on_loss.
    def input(self):
        return self._input(self.batches)

    def labels(self):
        return self._get("labels in")

    def gradient_pair(self):
        y = self._get("rebuilt in") if "rebuilt in" in self.streams else None
        return y, self._get("gradient in")

    def send_up(self, y):
        self._put("activation out", y)

    def send_down(self, x, grad_x):
        if "rebuilt out" in self.streams:
            self._put("rebuilt out", x)
        if "gradient out" in self.streams:
            self._put("gradient out", grad_x)

    def compute(self, work, *args):  # the stage's own work, apart from the waits on MPI
        start = time.perf_counter()
        out = work(*args)
        self.compute_seconds += time.perf_counter() - start
        return out

    def _input(self, batches):
        """The next micro-batch's input (rank 0 reads it and sends its labels to the last rank)."""
        if "activation in" in self.streams:
            return self._get("activation in"), None
        x, labels = next(batches)
        if "labels out" in self.streams:
            self._put("labels out", labels)
        return x, labels

    def train_segment(self, batches, n, on_loss=None, stop=None) -> int:
        """Algorithm 1 for this rank over a segment of n micro-batches (fill to drain); a stop
        request agreed by all ranks ends it early. Returns the micro-batches trained."""
        # Large messages move only while MPI is called: poll between blocks (docs/performance.md).
        poll = self.transport.poll if self.poll_between_blocks else None
        with self.w.stage.calling_between_blocks(poll):
            return self._segment(batches, n, on_loss, stop)

    def _segment(self, batches, n, on_loss, stop) -> int:
        w = self.w
        self.batches, self.on_loss = batches, on_loss  # what the port reads and calls
        w.begin_segment(n)
        self._expect(n)
        def vote():
            return post_stop_vote(self.world, self.transport, self.watchdog, stop, t)
        votes = None if stop is None else SegmentVotes(self.schedule, vote)
        t = 0
        while t < self.schedule.num_ticks(n):
            shorter = n if votes is None else votes.length(t, n)
            if shorter != n:
                for box in self.inboxes:  # every receive already posted still comes
                    box.shrink(n - shorter)
                w.begin_segment(shorter)
                n = shorter
            # w.tracer.plan passes the actions through (it records the tick when tracing is on)
            for action in w.tracer.plan(t, self.schedule.actions(w.index, t, n)):
                self.watchdog.beat(t, action.kind.value, action.microbatch)
                run_action(w, action, self)
            t += 1
        # A vote is posted only while 2 checks remain, so none is pending here; a request that
        # arrives later is seen by the trainer's stop check at the drain.
        assert votes is None or votes.pending is None
        w.settle()  # the segment's last step, when it waited for the replicas' average
        self._flush()
        self.watchdog.idle()
        return n

    def _flush(self):
        for name, box in self.streams.items():
            if isinstance(box, Outbox):  # the tracer records the wait for the last sends
                before = box.waited
                box.flush()
                end = time.perf_counter()
                self.w.tracer.wait(name, end - (box.waited - before), end, -1)

    @torch.no_grad()
    def evaluate(self, batches, m):
        """Forward-only pass over m batches by replica 0 (whose batch-norm running statistics
        are the model's; the other replicas return at once); the totals exist on its last rank
        (None elsewhere)."""
        if self.world.replica > 0:
            return None
        stage = self.w.stage
        for name in ("activation in", "labels in"):
            if name in self.streams:
                self.streams[name].expect(m)
        totals = EvalTotals() if self.w.is_last else None
        stage.eval()
        try:
            for i in range(m):
                self.watchdog.beat(i, "evaluate", i)
                x, labels = self._input(batches)
                out = stage.evaluate(x)
                if totals is None:
                    self._put("activation out", out, evaluation=True)
                else:
                    totals.add(out, self._get("labels in") if labels is None else labels)
        finally:
            stage.train()
        self._flush()
        self.watchdog.idle()
        return totals


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
