"""Point-to-point messages between neighbouring stages, whatever carries them: what every
transport shares (comm/mpi.py over MPI, comm/torch_dist.py over torch.distributed).

Inbox: a stream of tensors from one rank, with receives posted ahead (so transfers overlap
compute) into fresh buffers sized for the largest batch; the true batch size of each message
comes from its transport (MPI's status, a header under torch.distributed), so a smaller last
evaluation batch needs no agreement. Outbox: non-blocking sends; a tensor stays referenced until
its send completes. A box talks to its peer through a link (its transport's): link.irecv(buffer)
and link.isend(buffer) post a transfer of a buffer in storage order and return a request:

  request.test() -> bool        whether it has completed (completing it)
  request.wait(poll_sleep)      complete it (poll_sleep > 0: test, and sleep between tests)
  request.progress()            drive the library's progress without completing it
  request.received_bytes()      a completed receive's size in bytes

GPU tensors: where the library reads device memory (a CUDA-aware MPI, NCCL) the device buffers
go to it directly, otherwise they are staged through pinned host buffers. A library handed a
buffer knows nothing of CUDA streams, so a send is posted only once an event recorded on the
producing stream has completed. The host never blocks on the GPU: the send is posted by a later
poll, or while the rank waits for a message (Transport.wait: it tests its request and posts
sends as their events complete, whichever comes first, so a receive that arrives before the GPU
is done returns at once and the host queues the next work). Only where nothing else can move (a
stop vote, a send that must make room) does the rank poll the transport until the event
completes (Transport.wait_for), so transfers in flight keep moving. Device receive buffers are
allocated on a stream of their own, which no kernel uses, and handed to the compute stream with
record_stream: the caching allocator then reuses their memory only once the compute stream is
done with it, with no host synchronisation.

Layout: a message travels in the memory format its producer made it in (channels-last on CUDA
stages), agreed once per link at start-up, so neither side converts it. The library is handed
the tensor's memory in storage order (NHWC for channels-last: a view, not a copy) and the
receiver gets an NCHW view with channels-last strides of an NHWC buffer.

Progress: large MPI messages (rendezvous) move only while the library is inside an MPI call, so
the engine calls Transport.poll() between blocks; it drives every pending request's progress
and posts the GPU sends whose data are ready.

CPU receive buffers come from a pool and are reused once every tensor viewing them is gone,
instead of a fresh allocation (page faults on every large message) per message.

Compression (compress.py): a box given a codec sends one byte message per tensor, its scales
(int8 formats) first and then its codes in the layout's storage order. The scales go in the same
message rather than a second one so that a message is still matched, counted and waited for
alone; in front, so that the codes start on a boundary their dtype can be viewed at. The
receiver still learns the batch size from the byte count (the scales' size does not depend on it).

Waiting: MPI's blocking Wait spins a core until the message comes. Where many ranks share a core
(the emulated pipelines of `bench emulate`), PETRA_MPI_POLL_SLEEP=SECONDS makes a waiting rank
test its request and sleep that long between tests instead (Transport.poll_sleep).
"""
import contextlib
import os
import time
import weakref
from collections import deque

import numpy as np
import torch

from .channels import RECEIVE_DEPTH
from .compress import Packed

POLL_SLEEP_ENV = "PETRA_MPI_POLL_SLEEP"

CONTIGUOUS, CHANNELS_LAST = "contiguous", "channels_last"  # message layouts


def layout_of(t: torch.Tensor) -> str:
    """The layout a message of t travels in: channels-last for a 4-D tensor dense in that format
    and not in NCHW (where both hold, e.g. one pixel per channel, the two orders are the same)."""
    if (t.dim() == 4 and t.is_contiguous(memory_format=torch.channels_last)
            and not t.is_contiguous()):
        return CHANNELS_LAST
    return CONTIGUOUS


def in_layout(t: torch.Tensor, layout: str) -> torch.Tensor:
    """t dense in `layout` (a copy only where it is not already)."""
    fmt = torch.channels_last if layout == CHANNELS_LAST else torch.contiguous_format
    return t.contiguous(memory_format=fmt)


def storage_order(t: torch.Tensor, layout: str) -> torch.Tensor:
    """A C-contiguous view of t (dense in `layout`) over the same memory: what a transport reads
    or writes, since the libraries take contiguous buffers only (NHWC for channels-last)."""
    return t.permute(0, 2, 3, 1) if layout == CHANNELS_LAST else t


def empty_in_layout(shape, layout: str, allocate) -> torch.Tensor:
    """An NCHW-shaped tensor dense in `layout`, from `allocate(shape)` (a C-contiguous tensor)."""
    if layout == CHANNELS_LAST:
        n, c, h, w = shape
        return allocate((n, h, w, c)).permute(0, 3, 1, 2)
    return allocate(tuple(shape))


_NUMPY_DTYPES = {torch.float32: np.float32, torch.float64: np.float64, torch.int64: np.int64,
                 torch.uint8: np.uint8}


def to_wire(packed, layout: str) -> torch.Tensor:
    """A compress.Packed tensor (dense in `layout`) as one flat byte tensor: scales, then codes
    in storage order."""
    codes = storage_order(in_layout(packed.codes, layout), layout).reshape(-1).view(torch.uint8)
    if packed.scale is None:
        return codes
    return torch.cat([packed.scale.reshape(-1).view(torch.uint8), codes])


def from_wire(wire: torch.Tensor, codec, shape, dtype, layout: str):
    """The compress.Packed tensor of `shape` (dense in `layout`) that to_wire made `wire` from."""
    head = codec.scale_bytes(shape, dtype)
    scale = wire[:head].view(dtype).reshape(codec.scale_shape(shape)) if head else None
    flat = wire[head:].view(codec.code_dtype)
    codes = empty_in_layout(shape, layout, lambda s: flat.reshape(s))
    return Packed(codes, scale, dtype)


def message_buffer(shape, dtype, layout: str = CONTIGUOUS, codec=None):
    """(shape, dtype, layout) of the buffer that holds the largest message of a stream of
    tensors of at most `shape`: the tensor itself, or with an active codec one byte buffer
    (scales, then codes)."""
    if codec is None or not codec.active:
        return tuple(shape), dtype, layout
    per_sample = int(np.prod(shape[1:], dtype=np.int64)) * codec.code_dtype.itemsize
    return (codec.scale_bytes(shape, dtype) + shape[0] * per_sample,), torch.uint8, CONTIGUOUS


def message_bytes(shape, dtype, layout: str = CONTIGUOUS, codec=None) -> int:
    """The size of message_buffer's buffer in bytes."""
    shape, dtype, _ = message_buffer(shape, dtype, layout, codec)
    return int(np.prod(shape, dtype=np.int64)) * dtype.itemsize


class HostPool:
    """Reusable CPU receive buffers. A buffer is lent as a fresh numpy view of it, wrapped by
    torch.from_numpy: torch's storage owns that view until the storage's last tensor (the one
    lent, or any slice, reshape or narrow of it, or a numpy array made from one) is freed. The
    pool keeps only a weak reference to the view, so once it is dead nothing can read the buffer
    and it may receive again. (No reference counting: Python versions count differently.)"""

    def __init__(self):
        self.slots = {}  # (shape, numpy dtype) -> [[array, weak reference to its lent view]]

    def tensor(self, shape, dtype) -> torch.Tensor:
        np_dtype = _NUMPY_DTYPES.get(dtype)
        if np_dtype is None:
            return torch.empty(shape, dtype=dtype)
        slots = self.slots.setdefault((tuple(shape), np_dtype), [])
        slot = next((s for s in slots if s[1]() is None), None)
        if slot is None:
            slot = [np.empty(shape, dtype=np_dtype), None]
            slots.append(slot)
        lent = slot[0].view()
        slot[1] = weakref.ref(lent)
        return torch.from_numpy(lent)


class Transport:
    """How tensors reach the library on this rank: CPU buffers, device buffers handed over
    directly, or pinned host staging; and the waits and polls of every box on it."""

    def __init__(self, device: torch.device, direct: bool, poll_sleep=None,
                 direct_name="cuda-aware"):
        """direct: the library reads device memory (a CUDA-aware MPI, NCCL); direct_name: what
        the run log calls that path. poll_sleep: seconds between tests of a request this rank
        waits for (None: the environment's PETRA_MPI_POLL_SLEEP, else 0: the library's blocking
        wait, which spins a core under MPI)."""
        self.device = device
        self.direct = device.type != "cuda" or direct
        self.direct_name = direct_name
        self.pool = HostPool() if device.type != "cuda" else None
        # device receive buffers come from this stream's share of the caching allocator
        self.receive_stream = (torch.cuda.Stream(device)
                               if device.type == "cuda" and self.direct else None)
        # every Inbox and Outbox on this transport, and the replicas' average (replicas.py):
        # poll() drives them all; those with a post_ready method may hold work not yet posted
        self.boxes = []
        self.blocked = None  # the box whose message the rank is waiting for now (the watchdog's)
        self.poll_sleep = (float(os.environ.get(POLL_SLEEP_ENV) or 0) if poll_sleep is None
                           else float(poll_sleep))

    @contextlib.contextmanager
    def waiting_on(self, what):
        """Inside, the rank waits on `what` (a box, or the engine's stop vote): the watchdog's
        report names it."""
        self.blocked = what
        try:
            yield
        finally:
            self.blocked = None

    def wait(self, request):
        """Complete `request`. Sends still waiting for their GPU data are posted as soon as
        their data are ready meanwhile (the neighbour this rank waits for may be waiting for one
        of them), but the rank never waits for that data: its receive may come first."""
        while self._unposted():
            if request.test():
                return
            self.poll()
            if self.poll_sleep > 0:
                time.sleep(self.poll_sleep)
        request.wait(self.poll_sleep)

    def _unposted(self) -> bool:
        """Whether a box holds work not yet handed to the library (boxes with a post_ready
        method keep it in `unposted`)."""
        return any(getattr(box, "unposted", None) for box in self.boxes)

    def poll(self):
        """Drive the library's progress and post the sends whose GPU data are ready (between
        blocks)."""
        for box in self.boxes:
            box.poll()

    def wait_for(self, event):
        """Return once the GPU has passed `event`, polling the transport meanwhile: blocking in
        event.synchronize() would stop every transfer in flight until the GPU catches up."""
        while not event.query():
            self.poll()

    @property
    def mode(self):
        if self.device.type != "cuda":
            return "cpu"
        return self.direct_name if self.direct else "pinned-host-staging"

    def send_buffer(self, t: torch.Tensor, layout: str = CONTIGUOUS):
        """(the C-contiguous tensor to hand to the library, what must stay alive until the send
        completes, a CUDA event that must complete before the send is posted or None). t is
        sent in `layout`: no copy when its producer made it so."""
        t = in_layout(t.detach(), layout)
        if t.device.type != "cuda":
            return storage_order(t, layout), t, None
        if not self.direct:
            host = empty_in_layout(t.shape, layout, lambda shape: torch.empty(
                shape, dtype=t.dtype, pin_memory=True))
            host.copy_(t, non_blocking=True)
            t = host
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(self.device))
        return storage_order(t, layout), t, ready

    def recv_buffer(self, shape, dtype, layout: str = CONTIGUOUS):
        """(the tensor the library writes into, dense in `layout`, its C-contiguous view to hand
        to the library)."""
        if self.device.type != "cuda":
            t = empty_in_layout(shape, layout, lambda s: self.pool.tensor(s, dtype))
        elif self.direct:
            # the library writes outside any stream: memory the compute stream freed may still
            # be read by its queued kernels, so take it from a stream no kernel runs on
            # (see hand_over)
            with torch.cuda.stream(self.receive_stream):
                t = empty_in_layout(shape, layout, lambda s: torch.empty(
                    s, dtype=dtype, device=self.device))
        else:
            t = empty_in_layout(shape, layout, lambda s: torch.empty(s, dtype=dtype,
                                                                      pin_memory=True))
        return t, storage_order(t, layout)

    def hand_over(self, t: torch.Tensor):
        """A received tensor, on this rank's device, for the compute stream."""
        if t.device.type != self.device.type:  # staged: one asynchronous copy up
            return t.to(self.device, non_blocking=True)
        if t.device.type == "cuda":
            # allocated on receive_stream: its memory goes back to that stream only once the
            # compute stream has passed the point where the tensor is freed
            t.record_stream(torch.cuda.current_stream(self.device))
        return t


class Inbox:
    """Receives tensors of at most `shape` over `link` (from its peer), posted ahead, in the
    layout the sender sends; with an active `codec` (compress.Codec), compressed messages that
    get() decodes. `name`: the stream's (the watchdog's report names it)."""
    direction = "receive"

    def __init__(self, link, transport, shape, dtype, depth=RECEIVE_DEPTH, layout=CONTIGUOUS,
                 codec=None, name=""):
        self.link, self.transport, self.name = link, transport, name
        self.shape, self.dtype, self.depth, self.layout = tuple(shape), dtype, depth, layout
        self.per_sample = int(np.prod(self.shape[1:], dtype=np.int64))
        self.codec = codec if codec is not None and codec.active else None
        self.buffer = message_buffer(self.shape, dtype, layout, self.codec)
        if self.codec is not None:  # one byte buffer: scales, then codes
            self.head = self.codec.scale_bytes(self.shape, dtype)
            self.sample_bytes = self.per_sample * self.codec.code_dtype.itemsize
        self.pending = deque()  # (request, tensor)
        self.remaining = 0
        self.waited = 0.0  # seconds blocked in the transport, for the pipeline benchmark
        self.received_bytes = self.last_bytes = 0  # what came over the wire
        transport.boxes.append(self)

    @property
    def peer(self) -> int:
        return self.link.peer

    def poll(self):
        if self.pending:
            self.pending[0][0].progress()

    def expect(self, count: int):
        """Announce the next `count` messages and post the first receives."""
        assert not self.pending and self.remaining == 0, "previous messages were not all received"
        self.remaining = count
        self._post()

    def shrink(self, fewer: int):
        """The sender will send `fewer` messages less than announced."""
        assert fewer <= self.remaining, "a receive for a message that will not come is posted"
        self.remaining -= fewer

    def _post(self):
        while self.remaining > 0 and len(self.pending) < self.depth:
            tensor, buf = self.transport.recv_buffer(*self.buffer)
            self.pending.append((self.link.irecv(buf), tensor))
            self.remaining -= 1

    def get(self) -> torch.Tensor:
        request, tensor = self.pending.popleft()
        start = time.perf_counter()
        with self.transport.waiting_on(self):
            self.transport.wait(request)
        self.waited += time.perf_counter() - start
        self._post()
        self.last_bytes = request.received_bytes()
        self.received_bytes += self.last_bytes
        if self.codec is not None:
            n = (self.last_bytes - self.head) // max(1, self.sample_bytes)
            wire = self.transport.hand_over(tensor[:self.last_bytes])
            return self.codec.unpack(from_wire(wire, self.codec, (n, *self.shape[1:]),
                                               self.dtype, self.layout))
        n = self.last_bytes // max(1, self.per_sample * self.dtype.itemsize)
        # the first n samples: the batch dimension is outermost in every layout's storage order
        return self.transport.hand_over(tensor[:n] if n != self.shape[0] else tensor)


class Outbox:
    """Non-blocking sends over `link` (to its peer) in `layout`; at most `depth` in flight
    (posted or waiting for their GPU data). Sends are posted in order: a stream's messages are
    matched in posting order. With an active `codec` (compress.Codec) each tensor is compressed
    first, on the producing stream, into one byte message (to_wire). `name`: the stream's."""
    direction = "send"

    def __init__(self, link, transport, depth=2, layout=CONTIGUOUS, codec=None, name=""):
        self.link, self.transport, self.depth, self.name = link, transport, depth, name
        self.layout = layout
        self.codec = codec if codec is not None and codec.active else None
        self.unposted = deque()  # (buffer, tensor kept alive, CUDA event) not yet posted
        self.pending = deque()   # (request, tensor kept alive)
        # GPU int8 and fp16 messages: a host copy of each unposted message's guard (its scales,
        # its largest fp16 value), checked for inf and NaN once its event has completed, just
        # before it is posted (compress.NonFiniteError)
        self.scales = deque()
        self.waited = 0.0
        self.sent_bytes = 0  # what went over the wire
        transport.boxes.append(self)

    @property
    def peer(self) -> int:
        return self.link.peer

    def put(self, t: torch.Tensor, evaluation: bool = False) -> int:
        """Send t (evaluation: a stochastic codec rounds to the nearest). Returns its bytes."""
        if self.codec is not None:
            packed = self.codec.pack(in_layout(t.detach(), self.layout), evaluation)
            if packed.codes.is_cuda:  # one entry per message (None: nothing to check)
                guard, host = self.codec.guard(packed), None
                if guard is not None:  # queued before the event
                    host = torch.empty(guard.shape, dtype=guard.dtype, pin_memory=True)
                    host.copy_(guard, non_blocking=True)
                self.scales.append(host)
            t = to_wire(packed, self.layout)
            self.unposted.append(self.transport.send_buffer(t, CONTIGUOUS))
        else:
            self.unposted.append(self.transport.send_buffer(t, self.layout))
        nbytes = t.numel() * t.element_size()
        self.sent_bytes += nbytes
        self.post_ready(wait=False)
        self._drain(self.depth)
        return nbytes

    def poll(self):
        self.post_ready(wait=False)
        if self.pending:
            self.pending[0][0].progress()

    def flush(self):
        self._drain(0)

    def post_ready(self, wait: bool):
        """Post the sends whose data are ready, in order; with `wait`, all of them, polling the
        transport until their GPU data are."""
        while self.unposted:
            buf, keep, ready = self.unposted[0]
            if ready is not None and not ready.query():
                if not wait:
                    return
                self.transport.wait_for(ready)
                continue  # look again: a poll while waiting may have posted it already
            self.unposted.popleft()
            guard = self.scales.popleft() if self.scales else None
            if guard is not None:  # its event has completed: so has the copy queued before it
                self.codec.check_guard(guard)
            self.pending.append((self.link.isend(buf), keep))

    def _drain(self, keep: int):
        """Return once at most `keep` sends are in flight: the oldest posted send completing
        frees a place (later ones are posted meanwhile as their GPU data become ready); only
        with none posted does the rank wait for GPU data."""
        start = time.perf_counter()
        with self.transport.waiting_on(self):
            while len(self.unposted) + len(self.pending) > keep:
                if self.pending:
                    self.transport.wait(self.pending[0][0])
                    self.pending.popleft()
                else:  # nothing posted: the oldest send's GPU data must come first
                    self.transport.wait_for(self.unposted[0][2])
                    self.post_ready(wait=False)
        self.waited += time.perf_counter() - start
