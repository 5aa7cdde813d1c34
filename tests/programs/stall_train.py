"""Run the real trainer with one rank made to stall mid-run (for the watchdog test): its forward
of one micro-batch sleeps far longer than the test's run.watchdog_s.

Usage: mpirun -n J python tests/programs/stall_train.py STALL_RANK STALL_MICROBATCH CONFIG
       [--set ...]
"""
import sys
import time

from mpi4py import MPI

from petra_mpi import train
from petra_mpi.engine.worker import StageWorker

stall_rank, stall_b = int(sys.argv[1]), int(sys.argv[2])
if MPI.COMM_WORLD.Get_rank() == stall_rank:
    original = StageWorker.forward

    def forward(self, b, x):
        if b == stall_b:
            time.sleep(3600)
        return original(self, b, x)

    StageWorker.forward = forward
sys.exit(train.main(sys.argv[3:]))
