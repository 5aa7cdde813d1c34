"""Run under mpirun -n 2 with an output file: polling the transport between blocks must not lose
a message's size.

Rank 0 sends a 3-row tensor into rank 1's inbox sized for 4 rows; rank 1 polls after the message
has surely arrived (the barrier follows the send's completion), then receives it and saves what
it received (torch.save) to the output file for the test to check."""
import sys

import torch
from mpi4py import MPI

from petra_mpi.comm.channels import BY_KEY
from petra_mpi.comm.mpi import MPIGroup
from petra_mpi.comm.transport import Inbox, Outbox, Transport

comm = MPI.COMM_WORLD
transport = Transport(torch.device("cpu"), False)
link = MPIGroup(comm).link(1 - comm.rank, BY_KEY["activation"], 0)
sent = torch.arange(6, dtype=torch.float32).reshape(3, 2)
if comm.rank == 0:
    box = Outbox(link, transport)
    box.put(sent)
    box.flush()
    comm.Barrier()
else:
    box = Inbox(link, transport, (4, 2), torch.float32)
    box.expect(1)
    comm.Barrier()
    for _ in range(3):
        transport.poll()
    torch.save(box.get(), sys.argv[1])
