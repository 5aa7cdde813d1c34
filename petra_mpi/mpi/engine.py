"""One rank per stage: the loop of the paper's Algorithm 1 over mpi/transport.py.

Rank r runs stage r of J = world size. Its operations come from the schedule in order (forward
then backward of each tick); waiting on a neighbour's message is the only synchronisation. Rank 0
reads the data and sends each micro-batch's labels straight to the last rank.

With R replicas (world.split) the pipeline is the replica's own communicator, `world.pipe`, and
each stage also averages its gradients over `world.dp` before a step (replicas.py); stop votes
stay on the whole world, so every replica shortens a segment at the same tick.
"""
import sys
import time

import numpy as np
import torch

from .transport import (CONTIGUOUS, RECEIVE_DEPTH, TAG_ACTIVATION, TAG_GRADIENT, TAG_LABELS,
                    TAG_REBUILT, Inbox, Outbox, Transport, cuda_aware_mpi, in_layout, layout_of)
from ..compress import NO_COMPRESSION
from ..schedule import num_ticks, stop_count, tick_ops
from ..stopping import STOP_CHECK_TICKS
from ..engine.evaluation import EvalTotals
from ..watchdog import NoWatchdog

STOP_VOTE = "stop vote"  # what Transport.blocked holds while a rank waits for the vote
STREAM_NAMES = {TAG_ACTIVATION: "activation", TAG_REBUILT: "rebuilt input",
                TAG_GRADIENT: "gradient", TAG_LABELS: "labels"}


class MPIEngine:
    def __init__(self, worker, method, world, dtype, input_shape, batch_size,
                 compression=NO_COMPRESSION):
        self.w, self.method, self.world = worker, method, world
        comm, r, J = world.pipe, world.stage, world.stages

        def codec(direction, sender):  # of what `sender` sends; a receiver only decodes with it
            return compression.codec(direction, sender, world.replica)
        device = next(worker.stage.parameters()).device
        aware, why = cuda_aware_mpi() if device.type == "cuda" else (False, "")
        self.transport = t = Transport(device, aware)
        line = f"transport {t.mode}" + (f" ({why})" if why else "")
        if world.replicas > 1:
            from .transport import device_collectives
            from .replicas import MPIMean, average_path
            allowed, why_avg = device_collectives() if t.mode == "cuda-aware" else (False, "")
            path = average_path(device.type, t.direct, allowed)
            worker.reducer = MPIMean(world.dp, t, path)
            line += f", replica average {path}" + (f" ({why_avg})" if why_avg else "")
        line += ", " + compression.describe()
        if world.rank == 0:
            ranks = f"{world.replicas} replicas x {J} stages" if world.replicas > 1 else f"{J} ranks"
            print(f"petra_mpi: {ranks}, {line}", file=sys.stderr, flush=True)
        # Shapes and layouts are agreed once: each rank learns its input's from the previous one,
        # and every message of a link (activation forward, rebuilt input and gradient back)
        # travels in the layout its producer makes (channels-last on CUDA), so nobody converts.
        in_shape, in_fmt = (((batch_size, *input_shape), CONTIGUOUS) if r == 0
                            else comm.recv(source=r - 1, tag=1))
        out_shape, out_fmt = self._output_spec(in_shape, in_fmt, device, dtype)
        if r < J - 1:
            comm.send((out_shape, out_fmt), dest=r + 1, tag=1)
        # A stage whose last block is buffered ignores ỹ, so its successor need not send it.
        wants_rebuilt = comm.sendrecv(worker.stage.needs_rebuilt_input, dest=(r + 1) % J,
                                      source=(r - 1) % J)
        self.send_rebuilt = r > 0 and wants_rebuilt
        self.inputs = (Inbox(comm, t, r - 1, TAG_ACTIVATION, in_shape, dtype, layout=in_fmt,
                             codec=codec("forward", r - 1)) if r > 0 else None)
        self.outputs = (Outbox(comm, t, r + 1, TAG_ACTIVATION, layout=out_fmt,
                               codec=codec("forward", r)) if r < J - 1 else None)
        self.rebuilt_in = (Inbox(comm, t, r + 1, TAG_REBUILT, out_shape, dtype, layout=out_fmt,
                                 codec=codec("rebuilt", r + 1))
                           if r < J - 1 and worker.stage.needs_rebuilt_input else None)
        self.grads_in = (Inbox(comm, t, r + 1, TAG_GRADIENT, out_shape, dtype, layout=out_fmt,
                               codec=codec("gradient", r + 1)) if r < J - 1 else None)
        self.rebuilt_out = (Outbox(comm, t, r - 1, TAG_REBUILT, layout=in_fmt,
                                   codec=codec("rebuilt", r)) if self.send_rebuilt else None)
        self.grads_out = (Outbox(comm, t, r - 1, TAG_GRADIENT, layout=in_fmt,
                                 codec=codec("gradient", r)) if r > 0 else None)
        # with one stage (J = 1, replicas only) the labels never leave the rank
        self.labels_out = (Outbox(comm, t, J - 1, TAG_LABELS, depth=J + 2)
                           if r == 0 and J > 1 else None)
        self.labels_in = (Inbox(comm, t, 0, TAG_LABELS, (batch_size,), torch.int64)
                          if r == J - 1 and J > 1 else None)
        self.compute_seconds = 0.0  # in the stage's own work (forward, backward, optimizer step)
        self.watchdog = NoWatchdog()  # train.py starts the real one (watchdog.start_watchdog)

    @torch.no_grad()
    def _output_spec(self, in_shape, in_fmt, device, dtype):
        """(output shape, output layout) of this stage for an input of in_shape in in_fmt."""
        stage = self.w.stage
        was_training = stage.training
        stage.eval()  # running statistics: a shape probe must not touch anything
        try:
            probe = torch.zeros((1, *in_shape[1:]), device=device, dtype=dtype)
            out = stage.evaluate(in_layout(probe, in_fmt))
            return (in_shape[0], *out.shape[1:]), layout_of(out)
        finally:
            stage.train(was_training)

    def _boxes(self):
        return [b for b in (self.inputs, self.rebuilt_in, self.grads_in, self.labels_in,
                            self.outputs, self.rebuilt_out, self.grads_out, self.labels_out) if b]

    def pending_messages(self):
        """(blocked, direction, stream, peer, count) of each stream with messages in flight, for
        the watchdog's report; blocked: the rank is waiting on that stream now. Reads no MPI."""
        blocked, rows = self.transport.blocked, []
        if blocked is STOP_VOTE:
            rows.append((True, "receive", "stop vote", "every rank", 1))
        for box in self.transport.boxes:  # the boxes themselves (the tracer may wrap ours)
            if not isinstance(box, (Inbox, Outbox)):
                continue  # the replicas' average
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
        return sum(box.sent_bytes for box in self._boxes() if hasattr(box, "sent_bytes"))

    def wait_seconds(self) -> float:
        """Time this rank spent blocked on MPI so far."""
        return sum(box.waited for box in self._boxes())

    def _expect(self, n):
        for box in (self.inputs, self.rebuilt_in, self.grads_in, self.labels_in):
            if box is not None:
                box.expect(n)

    def _input(self, batches):
        """The next micro-batch's input (rank 0 reads it and sends its labels to the last rank)."""
        if self.inputs is not None:
            return self.inputs.get(), None
        x, labels = next(batches)
        if self.labels_out is not None:
            self.labels_out.put(labels)
        return x, labels

    def train_segment(self, batches, n, on_loss=None, stop=None) -> int:
        """Algorithm 1 for this rank over a segment of n micro-batches (fill to drain); a stop
        request agreed by all ranks ends it early. Returns the micro-batches trained."""
        w, J = self.w, self.world.stages
        w.begin_segment(n)
        # Large messages move only while MPI is called: poll between blocks (docs/performance.md).
        w.stage.between_blocks = self.transport.poll
        self._expect(n)
        self.vote = None
        t = 0
        while t < num_ticks(self.method, J, n):
            if stop is not None and t % STOP_CHECK_TICKS == 0:
                n = self._vote(t, n, stop)
            # w.tracer.plan passes the ops through (it records the tick when tracing is on)
            for op, b in w.tracer.plan(t, tick_ops(self.method, J, w.index, t, n)):
                self.watchdog.beat(t, op, b)
                if op == "forward":
                    x, _ = self._input(batches)
                    start = time.perf_counter()
                    y = w.forward(b, x)
                    self.compute_seconds += time.perf_counter() - start
                    self.outputs.put(y)
                elif op == "backward":
                    y = self.rebuilt_in.get() if self.rebuilt_in else None
                    grad_y = self.grads_in.get()
                    start = time.perf_counter()
                    x, grad_x = w.backward(b, y, grad_y)
                    self.compute_seconds += time.perf_counter() - start
                    self._send_down(x, grad_x)
                else:  # last stage: forward, loss and backward at once
                    x, labels = self._input(batches)
                    labels = self.labels_in.get() if labels is None else labels
                    start = time.perf_counter()
                    loss, logits, grad_x = w.forward_backward(b, x, labels)
                    self.compute_seconds += time.perf_counter() - start
                    self._send_down(x, grad_x)
                    if on_loss is not None:  # after the send: .item() and logging wait here
                        on_loss(b, loss, logits, labels)
            t += 1
        # A vote is posted only while 2 checks remain, so none is pending here; a request that
        # arrives later is seen by any_stop at the drain.
        assert self.vote is None
        w.settle()  # the segment's last step, when it waited for the replicas' average
        self._flush()
        self.watchdog.idle()
        return n

    def _vote(self, t, n, stop):
        """Every STOP_CHECK_TICKS ticks each rank contributes its stop flag to a non-blocking
        all-reduce and reads the previous one: all ranks see the same result at the same tick
        and shorten the segment identically, with no extra waiting in the common case."""
        from mpi4py import MPI
        if self.vote is not None:
            request, flag = self.vote
            self.transport.post_all()
            self.transport.blocked = STOP_VOTE
            request.Wait()
            self.transport.blocked = None
            self.vote = None
            if flag[0]:
                # what has entered, plus what a rank may already have posted receives for
                shorter = stop_count(self.method, self.world.stages, t, n, RECEIVE_DEPTH + 1)
                for box in (self.inputs, self.rebuilt_in, self.grads_in, self.labels_in):
                    if box is not None:
                        box.shrink(n - shorter)
                self.w.begin_segment(shorter)
                return shorter
        if t + 2 * STOP_CHECK_TICKS < num_ticks(self.method, self.world.stages, n):
            flag = np.array([int(stop.requested)], dtype=np.int32)
            self.vote = (self.world.comm.Iallreduce(MPI.IN_PLACE, flag, op=MPI.MAX), flag)
        return n

    def any_stop(self, stop) -> bool:
        """At a drain point: whether any rank was asked to stop (a blocking all-reduce)."""
        from mpi4py import MPI
        return bool(self.world.comm.allreduce(int(stop is not None and stop.requested),
                                              op=MPI.MAX))

    def _send_down(self, x, grad_x):
        if self.rebuilt_out is not None:
            self.rebuilt_out.put(x)
        if self.grads_out is not None:
            self.grads_out.put(grad_x)

    def _flush(self):
        for box in (self.outputs, self.rebuilt_out, self.grads_out, self.labels_out):
            if box is not None:
                box.flush()

    @torch.no_grad()
    def evaluate(self, batches, m):
        """Forward-only pass over m batches by replica 0 (whose batch-norm running statistics
        are the model's; the other replicas return at once); the totals exist on its last rank
        (None elsewhere)."""
        if self.world.replica > 0:
            return None
        stage = self.w.stage
        for box in (self.inputs, self.labels_in):
            if box is not None:
                box.expect(m)
        totals = EvalTotals() if self.w.is_last else None
        stage.eval()
        try:
            for i in range(m):
                self.watchdog.beat(i, "evaluate", i)
                x, labels = self._input(batches)
                out = stage.evaluate(x)
                if totals is None:
                    self.outputs.put(out, evaluation=True)
                else:
                    totals.add(out, self.labels_in.get() if labels is None else labels)
        finally:
            stage.train()
        self._flush()
        self.watchdog.idle()
        return totals
