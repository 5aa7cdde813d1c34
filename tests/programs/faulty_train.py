"""Run the real trainer with one rank made to fail or stall mid-run (for the fault and watchdog
tests): its forward of one micro-batch raises, sleeps far longer than any test's
run.watchdog_s, or kills its own process with SIGKILL as an OOM killer would (fail, stall,
kill), or it sleeps in its first stop vote at a drain instead of voting
(stall-vote, MICROBATCH unused): the other ranks then wait inside that collective.

Usage: mpirun -n J python tests/programs/faulty_train.py (fail|stall|kill|stall-vote) RANK
       MICROBATCH CONFIG [--set ...]
"""
import os
import signal
import sys
import time

from mpi4py import MPI

from petra_mpi import train
from petra_mpi.run import trainer
from petra_mpi.core.worker import StageWorker

fault, fault_rank, fault_b = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
assert fault in ("fail", "stall", "kill", "stall-vote"), fault
if MPI.COMM_WORLD.Get_rank() == fault_rank and fault == "stall-vote":
    def agree(world, interrupts):
        time.sleep(3600)

    trainer.agree = agree
elif MPI.COMM_WORLD.Get_rank() == fault_rank:
    original = StageWorker.forward

    def forward(self, b, x):
        if b == fault_b:
            if fault == "fail":
                raise RuntimeError(f"injected failure at micro-batch {b}")
            if fault == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(3600)
        return original(self, b, x)

    StageWorker.forward = forward
sys.exit(train.main(sys.argv[4:]))
