"""Point-to-point transport between neighbouring stages over mpi4py.

Inbox: a stream of tensors from one rank under one tag, with receives posted ahead (so transfers
overlap compute) into fresh buffers sized for the largest batch; the true batch size of each
message comes from the MPI status, so a smaller last evaluation batch needs no header.
Outbox: non-blocking sends; a tensor stays referenced until its send completes.

GPU tensors: with a CUDA-aware MPI the device buffers go to MPI directly, otherwise they are
staged through pinned host buffers. MPI knows nothing of CUDA streams, so a send is posted only
once an event recorded on the producing stream has completed. The host never blocks on the GPU:
the send is posted by a later poll, or while the rank waits for a message (Transport.wait: it
tests its request and posts sends as their events complete, whichever comes first, so a receive
that arrives before the GPU is done returns at once and the host queues the next work). Only
where nothing else can move (a stop vote, a send that must make room) does the rank poll the
transport until the event completes (Transport.wait_for), so transfers in flight keep moving. Device receive buffers are allocated on a stream
of their own, which no kernel uses, and handed to the compute stream with record_stream: the
caching allocator then reuses their memory only once the compute stream is done with it, with no
host synchronisation.

Layout: a message travels in the memory format its producer made it in (channels-last on CUDA
stages), agreed once per link at start-up, so neither side converts it. MPI is handed the tensor's
memory in storage order (NHWC for channels-last: a view, not a copy) and the receiver gets an NCHW
view with channels-last strides of an NHWC buffer.

Progress: large messages (rendezvous) move only while the library is inside an MPI call, so the
engine calls Transport.poll() between blocks; it tests the pending requests (which drives MPI's
progress engine) and posts the GPU sends whose data are ready.

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
import ctypes
import os
import time
import weakref
from collections import deque

import numpy as np
import torch

from .compress import Packed

TAG_ACTIVATION, TAG_REBUILT, TAG_GRADIENT, TAG_LABELS = 11, 12, 13, 14
RECEIVE_DEPTH = 2  # receives posted ahead per stream
POLL_SLEEP_ENV = "PETRA_MPI_POLL_SLEEP"

_MPI_DTYPES = {torch.float32: "f", torch.float64: "d", torch.int64: "q", torch.uint8: "B"}


def cuda_aware_mpi() -> tuple[bool, str]:
    """(whether MPI can read device memory, how that was decided). PETRA_MPI_CUDA_AWARE=0/1
    overrides; else ask the library (MPIX_Query_cuda_support exists in Open MPI and MPICH)."""
    forced = os.environ.get("PETRA_MPI_CUDA_AWARE")
    if forced in ("0", "1"):
        return forced == "1", "PETRA_MPI_CUDA_AWARE"
    for path in _loaded_mpi_libraries():
        try:
            query = getattr(ctypes.CDLL(path), "MPIX_Query_cuda_support")
        except (OSError, AttributeError):
            continue
        query.restype = ctypes.c_int
        return bool(query()), f"MPIX_Query_cuda_support in {os.path.basename(path)}"
    return False, "no MPIX_Query_cuda_support in the MPI library"


def device_collectives() -> tuple[bool, str]:
    """(whether a non-blocking collective may be handed device memory, how that was decided).
    MPIX_Query_cuda_support speaks for point-to-point (and in Open MPI blocking collectives)
    only: Open MPI's non-blocking collectives (libnbc) reduce on the CPU over the raw device
    pointers. So only an explicit PETRA_MPI_DEVICE_COLLECTIVES=1 says yes."""
    if os.environ.get("PETRA_MPI_DEVICE_COLLECTIVES") == "1":
        return True, "PETRA_MPI_DEVICE_COLLECTIVES=1"
    return False, "non-blocking collectives on device memory not known to be safe"


def _loaded_mpi_libraries():
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if "libmpi" in line and ".so" in line}
    except OSError:
        return []
    return sorted(paths)


def _host_view(t: torch.Tensor):
    """A buffer object mpi4py can read or write for a contiguous CPU tensor (no copy)."""
    return t.numpy()


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
    """A C-contiguous view of t (dense in `layout`) over the same memory: what MPI reads or
    writes, since mpi4py takes contiguous buffers only (NHWC for channels-last)."""
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


def wait_for_request(request, poll_sleep, status=None):
    """Complete `request`: in MPI's Wait (poll_sleep 0), or by testing it and sleeping poll_sleep
    seconds between tests, so that a waiting rank leaves its core to the others."""
    if poll_sleep <= 0:
        request.Wait(status)
        return
    while not request.Test(status):
        time.sleep(poll_sleep)


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
    """How tensors reach MPI on this rank: CPU, CUDA-aware device buffers or pinned staging."""

    def __init__(self, device: torch.device, cuda_aware: bool, poll_sleep=None):
        """poll_sleep: seconds between tests of a request this rank waits for (None: the
        environment's PETRA_MPI_POLL_SLEEP, else 0: MPI's Wait, which spins a core)."""
        self.device = device
        self.direct = device.type != "cuda" or cuda_aware
        self.pool = HostPool() if device.type != "cuda" else None
        # device receive buffers come from this stream's share of the caching allocator
        self.receive_stream = (torch.cuda.Stream(device)
                               if device.type == "cuda" and self.direct else None)
        # every Inbox and Outbox on this transport, and the replicas' average (replicas.py):
        # poll() drives them all; those with a post_ready method may hold work not yet posted
        self.boxes = []
        self.blocked = None  # the box whose message the rank is waiting for now (watchdog.py)
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

    def wait(self, request, status=None):
        """Complete `request`. Sends still waiting for their GPU data are posted as soon as
        their data are ready meanwhile (the neighbour this rank waits for may be waiting for one
        of them), but the rank never waits for that data: its receive may come first."""
        while self._unposted():
            if request.Test(status):
                return
            self.poll()
            if self.poll_sleep > 0:
                time.sleep(self.poll_sleep)
        wait_for_request(request, self.poll_sleep, status)

    def _unposted(self) -> bool:
        """Whether a box holds work not yet handed to MPI (boxes with a post_ready method keep
        it in `unposted`)."""
        return any(getattr(box, "unposted", None) for box in self.boxes)

    def poll(self):
        """Drive MPI's progress and post the sends whose GPU data are ready (between blocks)."""
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
        return "cuda-aware" if self.direct else "pinned-host-staging"

    def send_buffer(self, t: torch.Tensor, layout: str = CONTIGUOUS):
        """(the object to hand to MPI, what must stay alive until the send completes, a CUDA
        event that must complete before the send is posted or None). t is sent in `layout`:
        no copy when its producer made it so."""
        t = in_layout(t.detach(), layout)
        if t.device.type != "cuda":
            return _host_view(storage_order(t, layout)), t, None
        if not self.direct:
            host = empty_in_layout(t.shape, layout, lambda shape: torch.empty(
                shape, dtype=t.dtype, pin_memory=True))
            host.copy_(t, non_blocking=True)
            t, buf = host, _host_view(storage_order(host, layout))
        else:
            buf = storage_order(t, layout)
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(self.device))
        return buf, t, ready

    def recv_buffer(self, shape, dtype, layout: str = CONTIGUOUS):
        """(the tensor MPI writes into, dense in `layout`, the object to hand to MPI)."""
        if self.device.type != "cuda":
            t = empty_in_layout(shape, layout, lambda s: self.pool.tensor(s, dtype))
            return t, _host_view(storage_order(t, layout))
        if self.direct:
            # MPI writes outside any stream: memory the compute stream freed may still be read
            # by its queued kernels, so take it from a stream no kernel runs on (see hand_over)
            with torch.cuda.stream(self.receive_stream):
                t = empty_in_layout(shape, layout, lambda s: torch.empty(
                    s, dtype=dtype, device=self.device))
            return t, storage_order(t, layout)
        t = empty_in_layout(shape, layout, lambda s: torch.empty(s, dtype=dtype, pin_memory=True))
        return t, _host_view(storage_order(t, layout))

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
    """Receives `count` tensors of at most `shape` from `source` under `tag`, posted ahead, in
    the layout the sender sends; with an active `codec` (compress.Codec), compressed messages
    that get() decodes."""

    def __init__(self, comm, transport, source, tag, shape, dtype, depth=RECEIVE_DEPTH,
                 layout=CONTIGUOUS, codec=None):
        self.comm, self.transport, self.source, self.tag = comm, transport, source, tag
        self.shape, self.dtype, self.depth, self.layout = tuple(shape), dtype, depth, layout
        self.per_sample = int(np.prod(self.shape[1:], dtype=np.int64))
        self.codec = codec if codec is not None and codec.active else None
        if self.codec is not None:  # one byte buffer: scales, then codes
            self.head = self.codec.scale_bytes(self.shape, dtype)
            self.sample_bytes = self.per_sample * self.codec.code_dtype.itemsize
            size = self.head + self.shape[0] * self.sample_bytes
            self.buffer = ((size,), torch.uint8, CONTIGUOUS)
        else:
            self.buffer = (self.shape, dtype, layout)
        self.pending = deque()
        self.remaining = 0
        self.waited = 0.0  # seconds blocked in MPI, for the pipeline benchmark
        self.received_bytes = self.last_bytes = 0  # what came over the wire
        transport.boxes.append(self)

    def poll(self):
        if self.pending:
            # Get_status drives MPI's progress engine without completing the request (a Test
            # that succeeded would free it, and with it the status that tells the batch size).
            self.pending[0][0].Get_status()

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
        from mpi4py import MPI
        while self.remaining > 0 and len(self.pending) < self.depth:
            tensor, buf = self.transport.recv_buffer(*self.buffer)
            req = self.comm.Irecv(buf, source=self.source, tag=self.tag)
            self.pending.append((req, tensor, MPI.Status()))
            self.remaining -= 1

    def get(self) -> torch.Tensor:
        req, tensor, status = self.pending.popleft()
        start = time.perf_counter()
        with self.transport.waiting_on(self):
            self.transport.wait(req, status)
        self.waited += time.perf_counter() - start
        self._post()
        if self.codec is not None:
            self.last_bytes = status.Get_count(_mpi_datatype(torch.uint8))
            self.received_bytes += self.last_bytes
            n = (self.last_bytes - self.head) // max(1, self.sample_bytes)
            wire = self.transport.hand_over(tensor[:self.last_bytes])
            return self.codec.unpack(from_wire(wire, self.codec, (n, *self.shape[1:]),
                                               self.dtype, self.layout))
        count = status.Get_count(_mpi_datatype(self.dtype))
        self.last_bytes = count * self.dtype.itemsize
        self.received_bytes += self.last_bytes
        n = count // max(1, self.per_sample)
        # the first n samples: the batch dimension is outermost in every layout's storage order
        return self.transport.hand_over(tensor[:n] if n != self.shape[0] else tensor)


class Outbox:
    """Non-blocking sends to `dest` under `tag` in `layout`; at most `depth` in flight (posted or
    waiting for their GPU data). Sends are posted in order: MPI matches messages of one tag in
    posting order. With an active `codec` (compress.Codec) each tensor is compressed first, on
    the producing stream, into one byte message (to_wire)."""

    def __init__(self, comm, transport, dest, tag, depth=2, layout=CONTIGUOUS, codec=None):
        self.comm, self.transport, self.dest, self.tag, self.depth = comm, transport, dest, tag, depth
        self.layout = layout
        self.codec = codec if codec is not None and codec.active else None
        self.unposted = deque()  # (buffer, tensor kept alive, CUDA event) not yet handed to MPI
        self.pending = deque()   # (request, tensor kept alive)
        # GPU int8 and fp16 messages: a host copy of each unposted message's guard (its scales,
        # its largest fp16 value), checked for inf and NaN once its event has completed, just
        # before it is posted (compress.NonFiniteError)
        self.scales = deque()
        self.waited = 0.0
        self.sent_bytes = 0  # what went over the wire
        transport.boxes.append(self)

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
            self.pending[0][0].Get_status()

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
            self.pending.append((self.comm.Isend(buf, dest=self.dest, tag=self.tag), keep))

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


def _mpi_datatype(dtype):
    from mpi4py import MPI
    return MPI.Datatype.fromcode(_MPI_DTYPES[dtype])
