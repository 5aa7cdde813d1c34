"""Run under mpirun -n 2 with the device as argument (cpu or cuda): messages keep their layout.

Rank 0 sends a channels-last tensor, a 3-sample channels-last tensor into the 4-sample buffer,
and an NCHW tensor on a contiguous link; rank 1 checks values and strides. The sender must hand
MPI the producer's own memory (no conversion copy; on the GPU with staging, a pinned copy in
the same layout). Prints "layout ok" on rank 1."""
import sys

import torch
from mpi4py import MPI

from petra_mpi.comm.channels import BY_KEY
from petra_mpi.comm.mpi import MPIGroup, cuda_aware_mpi
from petra_mpi.comm.transport import CHANNELS_LAST, CONTIGUOUS, Inbox, Outbox, Transport

comm = MPI.COMM_WORLD
device = torch.device(sys.argv[1])
transport = Transport(device, cuda_aware_mpi()[0] if device.type == "cuda" else False)
activation, gradient = (MPIGroup(comm).link(1 - comm.rank, BY_KEY[key], 0)
                        for key in ("activation", "gradient"))
shape = (4, 3, 2, 5)
base = torch.arange(4 * 3 * 2 * 5, dtype=torch.float32, device=device).reshape(shape)
full = base.contiguous(memory_format=torch.channels_last)
short = full[:3]
plain = base * 2


def fail(message):
    print(message, file=sys.stderr, flush=True)
    comm.Abort(1)


if comm.rank == 0:
    last = Outbox(activation, transport, depth=4, layout=CHANNELS_LAST)
    nchw = Outbox(gradient, transport, layout=CONTIGUOUS)
    for t in (full, short):
        last.put(t)
        kept = (last.unposted or last.pending)[-1][1]
        if transport.direct and kept.data_ptr() != t.data_ptr():
            fail("a channels-last message was copied before sending")
        if kept.stride() != t.stride():
            fail(f"sent with strides {kept.stride()} instead of {t.stride()}")
    nchw.put(plain)
    last.flush()
    nchw.flush()
else:
    last = Inbox(activation, transport, shape, torch.float32, layout=CHANNELS_LAST)
    nchw = Inbox(gradient, transport, shape, torch.float32, layout=CONTIGUOUS)
    last.expect(2)
    nchw.expect(1)
    for want in (full, short):
        got = last.get()
        if got.device.type != device.type or not torch.equal(got, want):
            fail(f"received {got.cpu().tolist()} instead of {want.cpu().tolist()}")
        if not got.is_contiguous(memory_format=torch.channels_last):
            fail(f"received with strides {got.stride()}, not channels-last")
    got = nchw.get()
    if not (torch.equal(got, plain) and got.is_contiguous()):
        fail("the NCHW message changed")
    if device.type == "cuda":
        torch.cuda.synchronize()
    print("layout ok", flush=True)
