"""The torch.distributed transport (comm.transport: torch): gloo between CPU ranks, NCCL between
GPUs (gloo still carries the small messages the host reads: headers, votes, the start-up's
objects), started by torchrun, or by mpirun or srun (MPI then only tells the ranks where to meet).

Messages: non-blocking isend/irecv. Neither library tells a receive how much arrived, and NCCL
needs the receive to be the size of the send, so every message goes as a header (its size in
bytes, on the CPU) and a body of the stream's largest size (a short last batch padded: the
receiver reads the header). NCCL matches messages by order, not by tag, so each channel of a
pipeline has a process group of its own (a lane): a lane carries one kind of message one way,
and a receive posted ahead waits behind nothing else.
"""
import datetime
import gc
import os
import socket
import time

import torch
import torch.distributed as dist

from .channels import BY_KEY
from .transport import Transport
from .world import LaunchError, started_by_torchrun

# How long a collective or a message may keep a rank waiting before torch.distributed gives up: as
# good as for ever, as under MPI; the watchdog (run.watchdog_s, run.startup_s) says when a rank
# is lost, with the report of who waited on whom.
TIMEOUT = datetime.timedelta(days=7)


def backend() -> str:
    """gloo, with NCCL for CUDA tensors where this torch has it and sees a GPU; LaunchError where
    torch.distributed or gloo is missing."""
    if not dist.is_available() or not dist.is_gloo_available():
        raise LaunchError("comm.transport torch needs torch.distributed with gloo, which this "
                          "torch build lacks: run with comm.transport mpi, or install a torch "
                          "built with distributed support")
    if torch.cuda.is_available() and dist.is_nccl_available():
        return "cpu:gloo,cuda:nccl"
    return "gloo"


def start(srun_tasks: int = 1):
    """The group of every rank (None for one rank alone): under torchrun from its environment,
    under mpirun or srun at an address rank 0 tells the others over MPI."""
    name = backend()
    if started_by_torchrun():
        if int(os.environ.get("WORLD_SIZE", "1")) == 1:
            return None
        _import_holders_of_the_world()
        dist.init_process_group(name, timeout=TIMEOUT)
    else:
        from .mpi import start as start_mpi
        launcher = start_mpi(srun_tasks)
        if launcher is None:
            return None
        init_over(launcher, name)
    return TorchGroup(dist.group.WORLD, list(range(dist.get_world_size())),
                      _lanes(list(range(dist.get_world_size()))))


def _import_holders_of_the_world():
    """Import now the torch modules that keep the world group as a default argument (read when
    they are imported: torch.optim imports them with its first optimizer), so that they keep
    None: imported once the group exists they would hold it for ever, and end() could not end
    it."""
    import torch.distributed.nn.functional  # noqa: F401


def init_over(group, name="gloo"):
    """Start torch.distributed over the ranks of `group` (an MPI group): rank 0 picks a free port
    and tells the others its address (127.0.0.1 when every rank shares its host)."""
    hosts = group.allgather(socket.gethostname())
    address = None
    if group.rank == 0:
        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        host = "127.0.0.1" if len(set(hosts)) == 1 else hosts[0]
        address = (os.environ.get("MASTER_ADDR", host), port)
    _import_holders_of_the_world()
    host, port = group.bcast(address)
    store = dist.TCPStore(host, port, group.size, group.rank == 0, timeout=TIMEOUT)
    dist.init_process_group(name, store=store, rank=group.rank, world_size=group.size,
                            timeout=TIMEOUT)


def end():
    """Destroy every process group of this process, once its holders have let go of theirs: the
    last reference gone (the collection below finds those in cycles), a gloo group's destructor
    joins its threads, with the GIL released, so each has dropped its last work's tensors while
    the interpreter still runs. A tensor of a Python program released on such a thread needs
    the GIL; once the interpreter ends the thread that asks for it exits, and the process
    aborts ("terminate called without an active exception") after a finished run."""
    if dist.is_initialized():
        dist.destroy_process_group()
    gc.collect()


def library_error(e) -> str | None:
    """One line for an error of torch.distributed (most often a neighbour that ended), else
    None."""
    if not isinstance(e, dist.DistError):
        return None
    said = str(e).strip().splitlines() or [type(e).__name__]
    return f"torch.distributed error ({said[0]})"


def _lanes(ranks) -> dict:
    """One process group per channel over `ranks` (every rank of the job calls it, in order)."""
    return {key: dist.new_group(ranks) for key in BY_KEY}


CPU = torch.device("cpu")


class TorchGroup:
    """Some ranks of the job over a torch.distributed process group (World holds them); rank
    numbers are the group's. `lanes`: a process group per channel, where it carries a pipeline."""

    def __init__(self, pg, ranks, lanes=None):
        self.pg, self.ranks, self.lanes = pg, ranks, lanes or {}
        self.rank, self.size = ranks.index(dist.get_rank()), len(ranks)

    def node(self, cpus):
        """(node-local rank, ranks on this node, their CPU sets), by host name."""
        rows = self.allgather((socket.gethostname(), cpus))
        here = [r for r, (host, _) in enumerate(rows) if host == rows[self.rank][0]]
        return here.index(self.rank), len(here), [rows[r][1] for r in here]

    def subgroups(self, rank_lists, lanes=False):
        """The group of the list of ranks holding this rank, None where none does; with `lanes`
        (it carries a pipeline), a lane per channel. Collective over every rank of the job
        (torch's new_group)."""
        mine = None
        for ranks in rank_lists:
            members = [self.ranks[r] for r in ranks]
            pg, sub_lanes = dist.new_group(members), _lanes(members) if lanes else {}
            if self.rank in ranks:
                mine = TorchGroup(pg, members, sub_lanes)
        return mine

    def bcast(self, obj, root=0):
        box = [obj]
        dist.broadcast_object_list(box, group=self.pg, device=CPU, group_src=root)
        return box[0]

    def gather(self, obj, root=0):
        out = [None] * self.size if self.rank == root else None
        dist.gather_object(obj, out, group=self.pg, group_dst=root)
        return out

    def allgather(self, obj):
        out = [None] * self.size
        dist.all_gather_object(out, obj, group=self.pg)
        return out

    def send_object(self, obj, dest):
        dist.send_object_list([obj], group=self.pg, device=CPU, group_dst=dest)

    def recv_object(self, source):
        box = [None]
        dist.recv_object_list(box, group=self.pg, device=CPU, group_src=source)
        return box[0]

    def barrier(self, poll_sleep=None):
        """An all-reduce on the CPU (gloo's waits sleep; NCCL's barrier would take a GPU)."""
        TorchRequest([dist.all_reduce(torch.zeros(1), group=self.pg, async_op=True)]).wait(
            poll_sleep or 0.0)

    def send_bytes(self, array, dest, poll_sleep=0.0):
        TorchRequest([dist.isend(torch.from_numpy(array), group=self.pg, group_dst=dest)]).wait(
            poll_sleep)

    def receive_bytes(self, array, source, poll_sleep=0.0):
        TorchRequest([dist.irecv(torch.from_numpy(array), group=self.pg,
                                 group_src=source)]).wait(poll_sleep)

    def allreduce_max(self, value: int) -> int:
        values = torch.tensor([value], dtype=torch.int32)
        dist.all_reduce(values, op=dist.ReduceOp.MAX, group=self.pg)  # leaves the GIL
        return int(values[0])

    def iallreduce_max(self, value: int):
        values = torch.tensor([value], dtype=torch.int32)
        work = dist.all_reduce(values, op=dist.ReduceOp.MAX, group=self.pg, async_op=True)
        return TorchRequest([work], values)

    def iallreduce_sum(self, t):
        return TorchRequest([dist.all_reduce(t, group=self.pg, async_op=True)], keep=t)

    def link(self, peer, channel, nbytes):
        """The stream of `channel` with rank `peer`, whose largest message is nbytes long."""
        return TorchLink(self.lanes.get(channel.key, self.pg), peer, channel.tag, nbytes)

    def transport(self, device, poll_sleep=None):
        """This rank's Transport on `device`, and what the run log says of it."""
        if device.type == "cuda" and not dist.is_nccl_available():
            raise LaunchError("comm.transport torch on a GPU needs NCCL, which this torch build "
                              "lacks: run with comm.transport mpi")
        t = Transport(device, True, poll_sleep, direct_name="nccl")
        return t, f"transport torch.distributed {'nccl' if device.type == 'cuda' else 'gloo'}"

    def average_path(self, transport):
        """How the replicas' average reaches the library: the CPU bucket over gloo, the device
        one over NCCL."""
        return transport.mode, ""


def _as_bytes(buf):
    """The bytes of a C-contiguous tensor, as a view."""
    return buf.reshape(-1).view(torch.uint8)


class TorchLink:
    """The stream of one channel with one peer rank: a header (the size) and a full-size body
    per message."""

    def __init__(self, pg, peer, tag, nbytes):
        self.pg, self.peer, self.tag, self.nbytes = pg, peer, tag, nbytes

    def irecv(self, buf):
        body = _as_bytes(buf)
        assert body.numel() == self.nbytes, (body.numel(), self.nbytes)
        header = torch.zeros(1, dtype=torch.int64)
        works = [dist.irecv(header, group=self.pg, tag=self.tag, group_src=self.peer),
                 dist.irecv(body, group=self.pg, tag=self.tag, group_src=self.peer)]
        return TorchRequest(works, header)

    def isend(self, buf):
        body = _as_bytes(buf)
        header = torch.tensor([body.numel()], dtype=torch.int64)
        if body.numel() < self.nbytes:  # a short batch: the receive is for a full one
            full = torch.empty(self.nbytes, dtype=torch.uint8, device=body.device)
            full[:body.numel()] = body
            body = full
        works = [dist.isend(header, group=self.pg, tag=self.tag, group_dst=self.peer),
                 dist.isend(body, group=self.pg, tag=self.tag, group_dst=self.peer)]
        return TorchRequest(works, header, keep=body)


class TorchRequest:
    """torch.distributed works as transport.py's boxes use a request; `values`: a receive's
    header or an all-reduce's result; `keep`: what must live until the works complete."""

    def __init__(self, works, values=None, keep=None):
        self.works, self.values, self.keep = works, values, keep

    def test(self) -> bool:
        return all(work.is_completed() for work in self.works)

    def wait(self, poll_sleep=0.0):
        while poll_sleep > 0 and not self.test():
            time.sleep(poll_sleep)
        for work in self.works:
            work.wait()  # leaves the GIL (the watchdog's thread runs)

    def progress(self):
        """The libraries progress on threads of their own."""

    def received_bytes(self) -> int:
        return int(self.values[0])

    def value(self) -> int:
        return int(self.values[0])
