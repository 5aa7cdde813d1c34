"""Run the real trainer with one rank stopped (SIGSTOP, as a hung node or a stuck driver would
leave it) at a point of its start-up, for the start-up deadline's tests: as it starts MPI (the
other ranks then hang in MPI's start, which holds Python's interpreter lock), or as it is about
to train its first micro-batch (the others wait for it in their first ticks). Nothing continues
it: the job must end by the start-up deadline.

Usage: mpirun -n J python tests/programs/stop_at_startup.py (mpi|first-tick) RANK CONFIG [--set ...]
"""
import os
import signal
import sys

from petra_mpi import train
from petra_mpi.comm import world

where, stop_rank = sys.argv[1], int(sys.argv[2])
assert where in ("mpi", "first-tick"), where


def stop():
    os.kill(os.getpid(), signal.SIGSTOP)


if world.launcher_rank_and_size()[0] == stop_rank:
    if where == "mpi":
        start_mpi = world.World.from_environment.__func__

        def stopped_in_mpi_start(cls, *args, **kw):
            stop()
            return start_mpi(cls, *args, **kw)

        world.World.from_environment = classmethod(stopped_in_mpi_start)
    else:  # (the trainer, not imported yet, takes the step function from the watchdog)
        from petra_mpi.run import watchdog
        step = watchdog.startup_step

        def stopped_before_training(what):
            step(what)
            if what == "training the first micro-batch":
                stop()

        watchdog.startup_step = stopped_before_training
sys.exit(train.main(sys.argv[3:]))
