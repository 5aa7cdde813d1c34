"""The transport's logic on the CPU (comm/transport.py, mpi.py, replicas.py): when a pooled receive
buffer may be reused, how the host waits for GPU data (by polling MPI, never by blocking), which
path the replicas' average takes, and messages in channels-last layout. GPU events and MPI requests
are played by fakes here; tests/mpi/test_mpi.py sends real messages, and tests/e2e/test_gpu.py
runs the real thing where a GPU exists."""
import sys

import pytest
import torch

from petra_mpi.comm.channels import BY_KEY
from petra_mpi.comm.mpi import MPIGroup, MPIRequest, device_collectives
from petra_mpi.comm.replicas import ReplicaMean, average_path
from petra_mpi.comm.transport import (CHANNELS_LAST, CONTIGUOUS, HostPool, Inbox, Outbox, Transport,
                                      empty_in_layout, in_layout, layout_of, storage_order)

# ---------------------------------------------------------------- receive-buffer pool

SHAPE = (4, 3, 2, 2)

KEEPERS = {  # what a consumer may keep of a received tensor (a stage-0 FIFO entry, a slice...)
    "tensor": lambda t: t,
    "slice": lambda t: t[1:3],
    "reshape": lambda t: t.reshape(4, -1),
    "narrow": lambda t: t.narrow(0, 0, 1),
    "channels-last view": lambda t: t.permute(0, 2, 3, 1),
    "numpy view": lambda t: t.numpy()[2:],
}


@pytest.fixture(params=["3.11", "3.14"])
def counting(request, monkeypatch):
    """Python 3.14 borrows references for locals passed as arguments, so sys.getrefcount reports
    one less than 3.11 does; liveness must not depend on it."""
    if request.param == "3.14":
        real = sys.getrefcount
        probe = object()
        wrapper_own = (lambda obj: real(obj))(probe) - real(probe)  # the wrapper's argument
        monkeypatch.setattr(sys, "getrefcount", lambda obj: real(obj) - wrapper_own - 1)
        assert sys.getrefcount(probe) == real(probe) - 1
    return request.param


@pytest.mark.parametrize("keep", KEEPERS)
def test_pool_never_reuses_a_buffer_something_still_views(counting, keep):
    pool = HostPool()
    first = pool.tensor(SHAPE, torch.float32)
    first.fill_(7.0)
    kept = KEEPERS[keep](first)
    address = first.data_ptr()
    del first
    second = pool.tensor(SHAPE, torch.float32)
    assert second.data_ptr() != address, f"a buffer whose {keep} is alive was lent again"
    second.fill_(-1.0)
    assert (torch.as_tensor(kept) == 7.0).all()


@pytest.mark.parametrize("keep", KEEPERS)
def test_pool_reuses_a_buffer_once_every_view_is_gone(counting, keep):
    pool = HostPool()
    first = pool.tensor(SHAPE, torch.float32)
    address = first.data_ptr()
    kept = KEEPERS[keep](first)
    del first, kept
    assert pool.tensor(SHAPE, torch.float32).data_ptr() == address, "a free buffer leaked"


def test_pool_lends_each_buffer_once_while_held(counting):
    pool = HostPool()
    held = [pool.tensor(SHAPE, torch.float32) for _ in range(3)]
    assert len({t.data_ptr() for t in held}) == 3
    address = held[1].data_ptr()
    del held[1]
    assert pool.tensor(SHAPE, torch.float32).data_ptr() == address


# ---------------------------------------------------------------- waiting for GPU data

class FakeEvent:
    """A CUDA event whose work completes after `polls` queries; blocking on it is a defect."""

    def __init__(self, polls):
        self.polls = polls

    def query(self):
        if self.polls == 0:
            return True
        self.polls -= 1
        return False

    def synchronize(self):
        raise AssertionError("the host blocked on the GPU without driving MPI")


class FakeRequest:
    def __init__(self, log, what):
        self.log, self.what = log, what

    def Get_status(self, status=None):
        self.log.append(("progress", self.what))
        return False

    def Wait(self, status=None):
        self.log.append(("wait", self.what))


class FakeComm:
    """Records what is handed to MPI, and each progress call on a request, in order."""

    def __init__(self):
        self.log = []
        self.buffers = []  # what each all-reduce was handed

    def Get_size(self):
        return 2

    def Get_rank(self):
        return 0

    def Isend(self, buf, dest, tag):
        what = buf if isinstance(buf, str) else "host tensor"
        self.log.append(("send", what))
        return FakeRequest(self.log, what)

    def Irecv(self, buf, source, tag):
        return FakeRequest(self.log, "receive")

    def Iallreduce(self, sendbuf, buf, op):
        self.buffers.append(buf)
        self.log.append(("allreduce", "bucket"))
        return FakeRequest(self.log, "allreduce")


def link(comm, peer):
    """The activation stream with rank `peer` over a fake communicator."""
    return MPIGroup(comm).link(peer, BY_KEY["activation"], 0)


def test_a_poll_posts_only_what_is_ready():
    comm, transport = FakeComm(), Transport(torch.device("cpu"), False)
    outbox = Outbox(link(comm, 1), transport)
    outbox.unposted.extend([("a", None, FakeEvent(1)), ("b", None, FakeEvent(0))])
    transport.poll()
    assert [e for e in comm.log if e[0] == "send"] == []  # b waits behind a: MPI matches in order
    transport.poll()
    assert [w for k, w in comm.log if k == "send"] == ["a", "b"]


class HeldEvent:
    """A CUDA event whose work completes only once the test releases it. A host that waits for
    it before then would spin for ever: past `patience` queries the wait counts as a defect."""

    def __init__(self, patience=1000):
        self.released, self.queries, self.patience = False, 0, patience

    def query(self):
        self.queries += 1
        if not self.released and self.queries > self.patience:
            raise AssertionError("the host waited for GPU work that the message does not need")
        return self.released

    def synchronize(self):
        raise AssertionError("the host blocked on the GPU without driving MPI")


class ArrivingRequest(FakeRequest):
    """A receive or send that completes at its `tests`-th test."""

    def __init__(self, log, what, tests):
        super().__init__(log, what)
        self.tests = tests

    def Test(self, status=None):
        self.tests -= 1
        self.log.append(("test", self.what))
        return self.tests <= 0


class ArrivingComm(FakeComm):
    def Irecv(self, buf, source, tag):
        return ArrivingRequest(self.log, "receive", tests=3)


def test_a_receive_does_not_wait_for_the_gpu_data_of_earlier_sends():
    """The backward's send, queued behind kernels still running, must not hold up the
    forward's receive: the receive returns as soon as its message is there, and a send whose
    data become ready meanwhile goes out during the wait (the neighbour this rank waits for may
    be waiting for it)."""
    comm, transport = ArrivingComm(), Transport(torch.device("cpu"), False)
    inbox = Inbox(link(comm, 0), transport, (2, 3), torch.float32)
    inbox.expect(1)
    ready_soon = Outbox(link(comm, 2), transport)
    ready_soon.unposted.append(("ready soon", None, FakeEvent(1)))
    behind_kernels = Outbox(link(comm, 1), transport)
    held = HeldEvent()
    behind_kernels.unposted.append(("behind kernels", None, held))
    inbox.get()
    received = max(i for i, (kind, what) in enumerate(comm.log) if what == "receive")
    assert comm.log.index(("send", "ready soon")) < received
    assert held.queries > 0 and len(behind_kernels.unposted) == 1  # polled, not waited for
    assert [w for k, w in comm.log if k == "send"] == ["ready soon"]
    held.released = True
    transport.poll()
    assert [w for k, w in comm.log if k == "send"] == ["ready soon", "behind kernels"]


def test_finishing_the_replica_average_does_not_wait_for_other_sends_gpu_data():
    """The all-reduce of the replicas' average waits for its own bucket only: a send queued
    behind kernels elsewhere stays unposted while the average completes, and sends whose data
    become ready during the wait go out in order, each once."""
    comm, transport = ArrivingComm(), Transport(torch.device("cpu"), False)
    mean = ReplicaMean(MPIGroup(comm), transport, "cpu")
    worker = FakeWorker([[2.0, 4.0]])
    mean.start(worker)
    mean.request = MPIRequest(ArrivingRequest(comm.log, "allreduce", tests=4))
    outbox = Outbox(link(comm, 1), transport, depth=4)
    held = HeldEvent()
    outbox.unposted.extend([("a", None, FakeEvent(1)), ("b", None, FakeEvent(0)),
                            ("behind kernels", None, held)])
    mean.finish(worker)
    assert [w for k, w in comm.log if k == "send"] == ["a", "b"]
    assert held.queries > 0 and len(outbox.unposted) == 1  # polled, not waited for
    assert [p.grad.tolist() for p in worker.optimizer.params] == [[1.0, 2.0]]


def test_making_room_for_a_send_waits_for_the_oldest_send_not_the_gpu():
    """Two sends in flight and a third behind a kernel: room is made by the oldest send
    completing; the third waits for its data in the queue, not the host."""
    comm, transport = FakeComm(), Transport(torch.device("cpu"), False)
    outbox = Outbox(link(comm, 1), transport, depth=2)
    oldest = ArrivingRequest(comm.log, "oldest", tests=2)
    outbox.pending.extend([(MPIRequest(oldest), None),
                           (MPIRequest(ArrivingRequest(comm.log, "next", tests=2)), None)])
    held = HeldEvent()
    outbox.unposted.append(("third", None, held))
    outbox._drain(outbox.depth)
    assert oldest.tests <= 0 and len(outbox.pending) == 1 and len(outbox.unposted) == 1
    held.released = True
    outbox.flush()
    assert [w for k, w in comm.log if k == "send"] == ["third"]


# ---------------------------------------------------------------- the replicas' average

@pytest.mark.parametrize("device,aware,collectives,path", [
    ("cpu", False, False, "cpu"),
    ("cpu", True, True, "cpu"),
    ("cuda", False, False, "pinned-host-staging"),
    ("cuda", False, True, "pinned-host-staging"),
    # CUDA-aware point-to-point says nothing of non-blocking collectives: staged by default
    ("cuda", True, False, "pinned-host-staging"),
    ("cuda", True, True, "cuda-aware"),
])
def test_replica_average_path(device, aware, collectives, path):
    assert average_path(device, aware, collectives) == path


def test_device_collectives_need_an_explicit_opt_in(monkeypatch):
    monkeypatch.delenv("PETRA_MPI_DEVICE_COLLECTIVES", raising=False)
    assert device_collectives()[0] is False
    monkeypatch.setenv("PETRA_MPI_DEVICE_COLLECTIVES", "0")
    assert device_collectives()[0] is False
    monkeypatch.setenv("PETRA_MPI_DEVICE_COLLECTIVES", "1")
    assert device_collectives() == (True, "PETRA_MPI_DEVICE_COLLECTIVES=1")


class FakeWorker:
    def __init__(self, grads):
        params = [torch.nn.Parameter(torch.zeros(len(g))) for g in grads]
        for p, g in zip(params, grads):
            p.grad = torch.tensor(g)
        self.optimizer = type("Optimizer", (), {"params": params})()


def test_replica_average_is_posted_once_its_gpu_data_are_ready():
    """The all-reduce waits for the event after its bucket (the copy to pinned memory on a GPU):
    a poll posts it only once ready, and finishing it polls MPI rather than blocking."""
    comm, transport = FakeComm(), Transport(torch.device("cpu"), False)
    outbox = Outbox(link(comm, 1), transport)
    outbox.put(torch.zeros(2))
    mean = ReplicaMean(MPIGroup(comm), transport, "cpu")
    worker = FakeWorker([[2.0, 4.0], [6.0]])
    mean.start(worker)
    (buf,) = comm.buffers
    del comm.log[:]
    mean.request = None  # as if the bucket were on a GPU: held back behind an event
    mean.unposted = (buf, FakeEvent(2))
    transport.poll()
    assert not any(k == "allreduce" for k, _ in comm.log)
    mean.finish(worker)
    kinds = [k for k, _ in comm.log]
    assert kinds.index("allreduce") > kinds.index("progress") and kinds[-1] == "wait"
    assert kinds.count("allreduce") == 1
    # the fake all-reduce summed nothing: the mean over 2 replicas halves the gradients
    assert [p.grad.tolist() for p in worker.optimizer.params] == [[1.0, 2.0], [3.0]]


# ---------------------------------------------------------------- channels-last messages

def channels_last(n=4):
    x = torch.arange(n * 3 * 2 * 5, dtype=torch.float32).reshape(n, 3, 2, 5)
    return x.contiguous(memory_format=torch.channels_last)


def test_layout_of_a_message():
    x = channels_last()
    assert layout_of(x) == CHANNELS_LAST
    assert layout_of(x.contiguous()) == CONTIGUOUS
    assert layout_of(torch.zeros(4, 10)) == CONTIGUOUS
    # one pixel per channel: both orders are the same memory, sent as NCHW
    assert layout_of(torch.zeros(4, 8, 1, 1).contiguous(memory_format=torch.channels_last)) \
        == CONTIGUOUS


def test_a_channels_last_message_is_sent_without_a_copy():
    x = channels_last()
    buf, keep, ready = Transport(torch.device("cpu"), False).send_buffer(x, CHANNELS_LAST)
    assert keep.data_ptr() == x.data_ptr() and keep.stride() == x.stride() and ready is None
    assert buf.is_contiguous() and buf.data_ptr() == x.data_ptr()
    assert buf.shape == (4, 2, 5, 3)  # NHWC: storage order


def test_a_message_is_sent_in_the_agreed_layout_whatever_the_producer_made():
    x = channels_last()
    buf, keep, _ = Transport(torch.device("cpu"), False).send_buffer(x, CONTIGUOUS)
    assert keep.is_contiguous() and torch.equal(keep, x)
    assert torch.equal(buf, x.contiguous())
    buf, keep, _ = Transport(torch.device("cpu"), False).send_buffer(x.contiguous(), CHANNELS_LAST)
    assert torch.equal(buf, x.permute(0, 2, 3, 1))


def test_a_channels_last_message_is_received_with_channels_last_strides():
    transport = Transport(torch.device("cpu"), False)
    x = channels_last()
    sent, _, _ = transport.send_buffer(x, CHANNELS_LAST)
    got, buf = transport.recv_buffer(x.shape, torch.float32, CHANNELS_LAST)
    assert got.shape == x.shape and got.stride() == x.stride()
    buf.copy_(sent)  # what MPI does: the bytes in storage order
    assert torch.equal(got, x)
    # a smaller batch fills the buffer's first samples: the batch is outermost in NHWC too
    got, buf = transport.recv_buffer(x.shape, torch.float32, CHANNELS_LAST)
    buf.reshape(-1)[:3 * 30] = sent.reshape(-1)[:3 * 30]
    assert torch.equal(got[:3], x[:3])


def test_layout_helpers_round_trip():
    x = channels_last()
    assert in_layout(x, CHANNELS_LAST) is x
    assert storage_order(x, CHANNELS_LAST).is_contiguous()
    y = empty_in_layout((4, 3, 2, 5), CHANNELS_LAST, lambda s: torch.empty(s))
    assert y.shape == (4, 3, 2, 5) and y.is_contiguous(memory_format=torch.channels_last)
    assert empty_in_layout((4, 10), CONTIGUOUS, lambda s: torch.empty(s)).shape == (4, 10)
