"""The MPI transport (comm.transport: mpi, the default): a group of ranks over an mpi4py
communicator, and the links of its streams (Irecv/Isend under each channel's tag).

mpi4py is imported only here and only when a launcher started the process, so single-process runs
need no MPI library at all. A receive learns its message's size from MPI's status (Get_count), so
a short last batch needs no header. Device buffers go to MPI directly when the library reads
device memory (MPIX_Query_cuda_support, or PETRA_MPI_CUDA_AWARE=0|1), else through pinned host
buffers (transport.py).
"""
import ctypes
import os
import sys
import time

import numpy as np
import torch

from .replicas import average_path
from .transport import Transport
from .world import LaunchError


def start(srun_tasks: int = 1):
    """The group of every rank MPI started, or None when it started one rank alone (then
    srun_tasks > 1, an srun step of several tasks, is an error: each would train alone)."""
    try:
        from mpi4py import MPI
    except ImportError as e:
        raise LaunchError(f"comm.transport mpi needs mpi4py, which cannot be imported here ({e}): "
                          f"pip install mpi4py, or run with --set comm.transport=torch") from None
    if MPI.COMM_WORLD.Get_size() == 1:
        if srun_tasks > 1:  # else each task would train the whole net on its own
            raise LaunchError(f"started by srun as one of {srun_tasks} tasks, but MPI sees a "
                              f"single rank: give srun the PMI of your MPI (srun --mpi=pmix "
                              f"or --mpi=pmi2; `srun --mpi=list` shows them)")
        return None
    return MPIGroup(MPI.COMM_WORLD)


def abort():
    """End every rank of the job (MPI_Abort), where MPI has started."""
    if "mpi4py.MPI" in sys.modules:
        from mpi4py import MPI
        MPI.COMM_WORLD.Abort(1)


def library_error(e) -> str | None:
    """One line for an MPI error (most often a neighbour that is being aborted), else None."""
    if "mpi4py.MPI" not in sys.modules:
        return None
    from mpi4py import MPI
    if not isinstance(e, MPI.Exception):
        return None
    return f"MPI error ({e.Get_error_string().splitlines()[0]})"


class MPIGroup:
    """Some ranks of the job over one MPI communicator (comm/world.py's World holds them)."""

    def __init__(self, comm):
        self.comm = comm
        self.rank, self.size = comm.Get_rank(), comm.Get_size()

    def node(self, cpus):
        """(node-local rank, ranks on this node, their CPU sets) given this rank's CPU set."""
        from mpi4py import MPI
        node = self.comm.Split_type(MPI.COMM_TYPE_SHARED)
        try:
            return node.Get_rank(), node.Get_size(), node.allgather(cpus)
        finally:
            node.Free()

    def subgroups(self, rank_lists, lanes=False):
        """The group of the list of ranks (of this group) holding this rank, None where none
        does; collective. `lanes` (the group carries a pipeline) matters to transports that
        match messages by order, not by tag: MPI has tags."""
        from mpi4py import MPI
        mine = next((i for i, ranks in enumerate(rank_lists) if self.rank in ranks), None)
        key = rank_lists[mine].index(self.rank) if mine is not None else 0
        sub = self.comm.Split(MPI.UNDEFINED if mine is None else mine, key)
        return None if mine is None else MPIGroup(sub)

    def bcast(self, obj, root=0):
        return self.comm.bcast(obj, root=root)

    def gather(self, obj, root=0):
        return self.comm.gather(obj, root=root)

    def allgather(self, obj):
        return self.comm.allgather(obj)

    def send_object(self, obj, dest):
        self.comm.send(obj, dest=dest, tag=1)

    def recv_object(self, source):
        return self.comm.recv(source=source, tag=1)

    def barrier(self, poll_sleep=None):
        """Every rank here; poll_sleep: test and sleep between tests instead of MPI's Barrier,
        which spins a core per waiting rank (MPICH)."""
        if poll_sleep is None:
            self.comm.Barrier()
        else:
            wait_for_request(self.comm.Ibarrier(), poll_sleep)

    def send_bytes(self, array, dest, poll_sleep=0.0):
        wait_for_request(self.comm.Isend(array, dest=dest), poll_sleep)

    def receive_bytes(self, array, source, poll_sleep=0.0):
        wait_for_request(self.comm.Irecv(array, source=source), poll_sleep)

    def allreduce_max(self, value: int) -> int:
        """The maximum of every rank's value. The buffer form: mpi4py's pickle-based allreduce
        keeps the GIL while it waits, which would silence the watchdog thread of a rank whose
        neighbour never comes to the vote."""
        from mpi4py import MPI
        values = np.array([value], dtype=np.int32)
        self.comm.Allreduce(MPI.IN_PLACE, values, op=MPI.MAX)
        return int(values[0])

    def iallreduce_max(self, value: int):
        """A request for the maximum of every rank's value (request.value() once complete)."""
        from mpi4py import MPI
        values = np.array([value], dtype=np.int32)
        return MPIRequest(self.comm.Iallreduce(MPI.IN_PLACE, values, op=MPI.MAX), values=values)

    def iallreduce_sum(self, t):
        """A request summing tensor t over the ranks in place (a CPU tensor, or a device one
        where the library reads device memory)."""
        from mpi4py import MPI
        return MPIRequest(self.comm.Iallreduce(MPI.IN_PLACE, _buffer(t), op=MPI.SUM))

    def link(self, peer, channel, nbytes):
        """The stream of `channel` with rank `peer` (MPI tells a receive its size: nbytes, the
        largest message, is not needed)."""
        return MPILink(self.comm, peer, channel.tag)

    def transport(self, device, poll_sleep=None):
        """This rank's Transport on `device`, and what the run log says of it."""
        aware, why = cuda_aware_mpi() if device.type == "cuda" else (False, "")
        t = Transport(device, aware, poll_sleep)
        return t, f"transport {t.mode}" + (f" ({why})" if why else "")

    def average_path(self, transport):
        """How the replicas' average reaches MPI (replicas.average_path), and why."""
        allowed, why = device_collectives() if transport.mode == "cuda-aware" else (False, "")
        return average_path(transport.device.type, transport.direct, allowed), why


def _buffer(t):
    """What mpi4py is handed for a tensor: a numpy view of a CPU tensor (no copy), else the
    tensor (a CUDA-aware mpi4py reads it through its CUDA array interface); other objects (the
    tests' stand-ins) as they are."""
    return t.numpy() if isinstance(t, torch.Tensor) and not t.is_cuda else t


class MPILink:
    """The stream of one channel (its tag) with one peer rank."""

    def __init__(self, comm, peer, tag):
        self.comm, self.peer, self.tag = comm, peer, tag

    def irecv(self, buf):
        from mpi4py import MPI
        status = MPI.Status()
        return MPIRequest(self.comm.Irecv(_buffer(buf), source=self.peer, tag=self.tag), status)

    def isend(self, buf):
        return MPIRequest(self.comm.Isend(_buffer(buf), dest=self.peer, tag=self.tag))


class MPIRequest:
    """An MPI request as transport.py's boxes use one; `values`: an all-reduce's result."""

    def __init__(self, request, status=None, values=None):
        self.request, self.status, self.values = request, status, values

    def value(self) -> int:
        return int(self.values[0])

    def test(self) -> bool:
        return self.request.Test(self.status)

    def wait(self, poll_sleep=0.0):
        wait_for_request(self.request, poll_sleep, self.status)

    def progress(self):
        # Get_status drives MPI's progress engine without completing the request (a Test
        # that succeeded would free it, and with it the status that tells the size)
        self.request.Get_status()

    def received_bytes(self) -> int:
        from mpi4py import MPI
        return self.status.Get_count(MPI.BYTE)


def wait_for_request(request, poll_sleep, status=None):
    """Complete `request`: in MPI's Wait (poll_sleep 0), or by testing it and sleeping poll_sleep
    seconds between tests, so that a waiting rank leaves its core to the others."""
    if poll_sleep <= 0:
        request.Wait(status)
        return
    while not request.Test(status):
        time.sleep(poll_sleep)


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
