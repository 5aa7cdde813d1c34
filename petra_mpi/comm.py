"""Point-to-point transport between neighbouring stages over mpi4py.

Inbox: a stream of tensors from one rank under one tag, with receives posted ahead (so transfers
overlap compute) into fresh buffers sized for the largest batch; the true batch size of each
message comes from the MPI status, so a smaller last evaluation batch needs no header.
Outbox: non-blocking sends; a tensor stays referenced until its send completes.

GPU tensors: with a CUDA-aware MPI the device buffers go to MPI directly, otherwise they are
staged through pinned host buffers. MPI knows nothing of CUDA streams, so a send is posted only
once an event recorded on the producing stream has completed (the host never waits for the
stream: the send is posted by a later poll).

Progress: large messages (rendezvous) move only while the library is inside an MPI call, so the
engine calls Transport.poll() between blocks; it tests the pending requests (which drives MPI's
progress engine) and posts the GPU sends whose data are ready.

CPU receive buffers come from a pool and are reused once every tensor viewing them is gone,
instead of a fresh allocation (page faults on every large message) per message.
"""
import ctypes
import os
import sys
import time
from collections import deque

import numpy as np
import torch

TAG_ACTIVATION, TAG_REBUILT, TAG_GRADIENT, TAG_LABELS = 11, 12, 13, 14
RECEIVE_DEPTH = 2  # receives posted ahead per stream

_MPI_DTYPES = {torch.float32: "f", torch.float64: "d", torch.int64: "q"}


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


_NUMPY_DTYPES = {torch.float32: np.float32, torch.float64: np.float64, torch.int64: np.int64}


class HostPool:
    """Reusable CPU receive buffers. Each is a numpy array wrapped by torch.from_numpy: torch's
    storage holds a reference to the array until its last view is freed, so an array that only
    the pool references is free to receive again."""

    def __init__(self):
        self.arrays = {}  # (shape, numpy dtype) -> arrays

    def tensor(self, shape, dtype) -> torch.Tensor:
        np_dtype = _NUMPY_DTYPES.get(dtype)
        if np_dtype is None:
            return torch.empty(shape, dtype=dtype)
        arrays = self.arrays.setdefault((tuple(shape), np_dtype), [])
        for array in arrays:
            if sys.getrefcount(array) == 3:  # the list, this loop's name, getrefcount's argument
                return torch.from_numpy(array)
        arrays.append(np.empty(shape, dtype=np_dtype))
        return torch.from_numpy(arrays[-1])


class Transport:
    """How tensors reach MPI on this rank: CPU, CUDA-aware device buffers or pinned staging."""

    def __init__(self, device: torch.device, cuda_aware: bool):
        self.device = device
        self.direct = device.type != "cuda" or cuda_aware
        self.pool = HostPool() if device.type != "cuda" else None
        self.boxes = []  # every Inbox and Outbox on this transport, for poll()

    def poll(self):
        """Drive MPI's progress and post the sends whose GPU data are ready (between blocks)."""
        for box in self.boxes:
            box.poll()

    def post_all(self):
        """Post every send still waiting for its GPU data: called before this rank blocks, since
        the neighbour it waits for may itself be waiting for one of them."""
        for box in self.boxes:
            if isinstance(box, Outbox):
                box._post(wait=True)

    @property
    def mode(self):
        if self.device.type != "cuda":
            return "cpu"
        return "cuda-aware" if self.direct else "pinned-host-staging"

    def send_buffer(self, t: torch.Tensor):
        """(the object to hand to MPI, what must stay alive until the send completes, a CUDA
        event that must complete before the send is posted or None)."""
        t = t.detach().contiguous()
        if t.device.type != "cuda":
            return _host_view(t), t, None
        if not self.direct:
            host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            host.copy_(t, non_blocking=True)
            t, buf = host, _host_view(host)
        else:
            buf = t
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(self.device))
        return buf, t, ready

    def recv_buffer(self, shape, dtype):
        """(the tensor MPI writes into, the object to hand to MPI)."""
        if self.device.type != "cuda":
            t = self.pool.tensor(shape, dtype)
            return t, _host_view(t)
        if self.direct:
            t = torch.empty(shape, dtype=dtype, device=self.device)
            torch.cuda.current_stream(self.device).synchronize()
            return t, t
        t = torch.empty(shape, dtype=dtype, pin_memory=True)
        return t, _host_view(t)

    def to_device(self, t: torch.Tensor):
        return t if t.device == self.device else t.to(self.device, non_blocking=True)


class Inbox:
    """Receives `count` tensors of at most `shape` from `source` under `tag`, posted ahead."""

    def __init__(self, comm, transport, source, tag, shape, dtype, depth=RECEIVE_DEPTH):
        self.comm, self.transport, self.source, self.tag = comm, transport, source, tag
        self.shape, self.dtype, self.depth = tuple(shape), dtype, depth
        self.per_sample = int(np.prod(self.shape[1:], dtype=np.int64))
        self.pending = deque()
        self.remaining = 0
        self.waited = 0.0  # seconds blocked in MPI, for the pipeline benchmark
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
            tensor, buf = self.transport.recv_buffer(self.shape, self.dtype)
            req = self.comm.Irecv(buf, source=self.source, tag=self.tag)
            self.pending.append((req, tensor, MPI.Status()))
            self.remaining -= 1

    def get(self) -> torch.Tensor:
        req, tensor, status = self.pending.popleft()
        self.transport.post_all()
        start = time.perf_counter()
        req.Wait(status)
        self.waited += time.perf_counter() - start
        self._post()
        n = status.Get_count(_mpi_datatype(self.dtype)) // max(1, self.per_sample)
        return self.transport.to_device(tensor[:n] if n != self.shape[0] else tensor)


class Outbox:
    """Non-blocking sends to `dest` under `tag`; at most `depth` in flight (posted or waiting for
    their GPU data). Sends are posted in order: MPI matches messages of one tag in posting order."""

    def __init__(self, comm, transport, dest, tag, depth=2):
        self.comm, self.transport, self.dest, self.tag, self.depth = comm, transport, dest, tag, depth
        self.unposted = deque()  # (buffer, tensor kept alive, CUDA event) not yet handed to MPI
        self.pending = deque()   # (request, tensor kept alive)
        self.waited = 0.0
        transport.boxes.append(self)

    def put(self, t: torch.Tensor):
        self.unposted.append(self.transport.send_buffer(t))
        self._post(wait=False)
        self._drain(self.depth)

    def poll(self):
        self._post(wait=False)
        if self.pending:
            self.pending[0][0].Get_status()

    def flush(self):
        self._drain(0)

    def _post(self, wait: bool):
        while self.unposted:
            buf, keep, ready = self.unposted[0]
            if ready is not None and not ready.query():
                if not wait:
                    return
                ready.synchronize()
            self.unposted.popleft()
            self.pending.append((self.comm.Isend(buf, dest=self.dest, tag=self.tag), keep))

    def _drain(self, keep: int):
        start = time.perf_counter()
        if len(self.unposted) + len(self.pending) > keep:
            self._post(wait=True)
        while len(self.pending) > keep:
            self.pending.popleft()[0].Wait()
        self.waited += time.perf_counter() - start


def _mpi_datatype(dtype):
    from mpi4py import MPI
    return MPI.Datatype.fromcode(_MPI_DTYPES[dtype])
