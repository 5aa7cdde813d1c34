"""Run the real trainer with one rank made to fail mid-run (for the fault tests).

Usage: mpirun -n J python tests/programs/faulty_train.py FAIL_RANK FAIL_MICROBATCH CONFIG
       [--set ...]
"""
import sys

from mpi4py import MPI

from petra_mpi import train
from petra_mpi.engine.worker import StageWorker

fail_rank, fail_b = int(sys.argv[1]), int(sys.argv[2])
if MPI.COMM_WORLD.Get_rank() == fail_rank:
    original = StageWorker.forward

    def forward(self, b, x):
        if b == fail_b:
            raise RuntimeError(f"injected failure at micro-batch {b}")
        return original(self, b, x)

    StageWorker.forward = forward
sys.exit(train.main(sys.argv[3:]))
