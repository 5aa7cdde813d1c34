"""Stopping on request: SIGUSR1 or SIGTERM (e.g. SLURM before a time limit) makes the run drain,
checkpoint and exit with EXIT_REQUEUE, which a batch script turns into a requeue."""
import signal
import sys

EXIT_REQUEUE = 3
STOP_CHECK_TICKS = 8  # ticks between agreements on a stop request (MPI: one Iallreduce each)


class StopRequest:
    def __init__(self):
        self.requested = False

    def install(self):
        for sig in (signal.SIGUSR1, signal.SIGTERM):
            signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame):
        if not self.requested:
            print(f"petra_mpi: received {signal.Signals(signum).name}: draining, checkpointing "
                  f"and stopping", file=sys.stderr, flush=True)
        self.requested = True
