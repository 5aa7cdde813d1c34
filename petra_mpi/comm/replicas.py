"""Data parallelism across pipeline replicas: before each optimizer step a stage averages its
parameter gradients over the copies of itself in the other replicas (its data-parallel group), so
every replica keeps the same weights. Batch-norm statistics are not averaged: each replica
normalises with its own micro-batches and keeps its own running statistics (replica 0's are the
ones evaluated and checkpointed), as DDP does by default.

The worker (worker.py) starts the average right after the backward that completes an
accumulation group and finishes it, then steps, just before its next operation. The weights
therefore change at the same point of the schedule as without replicas, while the all-reduce
overlaps the sends of that backward and the wait for the next input.

Arithmetic, the same in both reducers: sum the accumulated gradients over the replicas, divide by
R (the optimizer then divides by the backwards accumulated). ReplicaMean lets the transport sum
(MPI, gloo or NCCL); LocalMean, the single-process reference, sums in replica order. IEEE addition
is commutative, so for R = 2 the two agree bitwise; for R > 2 the library's association order is
its own (every rank gets the same result, but it may differ from the reference in the last bits).
"""
import time
from collections import deque

import torch


def _with_grads(worker):
    """The stage's parameters that received a gradient, in a fixed order (the same on every
    replica: they hold the same blocks)."""
    return [p for p in worker.optimizer.params if p.grad is not None]


def _flatten(params):
    if not params:  # a stage without parameters still takes part in the collective
        return torch.zeros(0)
    return torch.cat([p.grad.reshape(-1) for p in params])


def _unflatten_into(flat, params):
    offset = 0
    for p in params:
        n = p.grad.numel()
        p.grad.copy_(flat[offset:offset + n].view_as(p.grad))
        offset += n


def average_path(device_type: str, cuda_aware: bool, device_collectives: bool) -> str:
    """How the replica average reaches MPI: "cpu" (host gradients), "cuda-aware" (the device
    buffer to Iallreduce) or "pinned-host-staging". A CUDA-aware library reads device memory in
    point-to-point transfers, but its non-blocking collectives may not (Open MPI's libnbc reduces
    on the CPU over the raw pointers), so the device path needs both, device_collectives being
    an explicit opt-in (mpi.device_collectives)."""
    if device_type != "cuda":
        return "cpu"
    return "cuda-aware" if cuda_aware and device_collectives else "pinned-host-staging"


class ReplicaMean:
    """One stage's average over its data-parallel group (World.replica_mean): one flattened
    bucket per step, summed by the group's non-blocking all-reduce. On a GPU the bucket (or its
    pinned host copy, queued behind the backward, on the "pinned-host-staging" path) is handed
    to the library once an event after it has completed: posted by a poll between blocks, or
    before the rank blocks, polling the transport meanwhile. The host never waits for the GPU.
    It joins the transport's boxes, so that polls and waits reach it."""

    def __init__(self, group, transport, path):
        self.group, self.transport, self.path = group, transport, path
        self.size = group.size
        self.unposted = None  # (bucket for the library, CUDA event or None) not yet posted
        self.request = None
        self.held = None  # (flattened gradients, their host copy or None, parameters)
        self.waited = 0.0  # seconds blocked finishing all-reduces (for the benchmark)
        transport.boxes.append(self)

    def start(self, worker):
        params = _with_grads(worker)
        flat = _flatten(params)
        host = ready = None
        buf = flat
        if self.path != "cpu":
            if self.path == "pinned-host-staging":
                host = torch.empty(flat.shape, dtype=flat.dtype, pin_memory=True)
                host.copy_(flat, non_blocking=True)
                buf = host
            ready = torch.cuda.Event()  # (a stage without parameters has an empty host bucket)
            ready.record(torch.cuda.current_stream(self.transport.device))
        self.unposted, self.held = (buf, ready), (flat, host, params)
        self.post_ready(wait=False)

    def post_ready(self, wait: bool):
        """Post the all-reduce once its data are ready; with `wait`, poll until they are."""
        while self.unposted is not None:
            buf, ready = self.unposted
            if ready is not None and not ready.query():
                if not wait:
                    return
                self.transport.wait_for(ready)
                continue  # look again: a poll while waiting may have posted it already
            self.unposted = None
            self.request = self.group.iallreduce_sum(buf)

    def poll(self):
        self.post_ready(wait=False)
        if self.request is not None:
            self.request.progress()

    def finish(self, worker):
        # both waits post the other boxes' sends as their data become ready (a neighbour may
        # wait for one of them) but never wait for data the all-reduce does not need
        self.post_ready(wait=True)
        start = time.perf_counter()
        self.transport.wait(self.request)
        self.waited += time.perf_counter() - start
        (flat, host, params), self.request, self.held = self.held, None, None
        if host is not None:
            flat.copy_(host, non_blocking=True)
        flat.div_(self.size)
        _unflatten_into(flat, params)


class LocalMean:
    """The same average for the R replicas of one stage held by one process (the reference the
    MPI run is compared with). The local engine runs every replica through a tick before the
    next tick, so every replica starts a step's average before any starts the next one; a worker
    finishes at its next operation, possibly after another replica has started the next average,
    hence one queue of finished means per worker."""

    def __init__(self, workers):
        self.workers = list(workers)  # in replica order
        self.started = {}  # this step's flattened gradients, by worker
        self.ready = {w: deque() for w in self.workers}

    def start(self, worker):
        assert worker not in self.started, "a replica started two steps before the others one"
        self.started[worker] = _flatten(_with_grads(worker))
        if len(self.started) == len(self.workers):
            total = self.started[self.workers[0]].clone()
            for w in self.workers[1:]:
                total.add_(self.started[w])
            mean = total.div_(len(self.workers))
            for w in self.workers:
                self.ready[w].append(mean)
            self.started = {}

    def finish(self, worker):
        assert self.ready[worker], "a replica has not reached the step"
        _unflatten_into(self.ready[worker].popleft(), _with_grads(worker))


def link_local(workers, replicas: int):
    """Give the workers of R in-process replicas (in rank order: replica · J + stage) one
    LocalMean per stage."""
    J = len(workers) // replicas
    for s in range(J):
        reducer = LocalMean(workers[s::J])
        for w in workers[s::J]:
            w.average_with(reducer)
