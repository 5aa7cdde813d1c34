"""Stopping on request: SIGUSR1 or SIGTERM (e.g. SLURM before a time limit) makes the run drain,
checkpoint and exit with EXIT_REQUEUE, which a batch script turns into a requeue. The same vote
carries the wall-time checkpoint cadence (run.checkpoint_every_minutes)."""
import signal
import sys
import time

from ..core.schedule import stop_count

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


class SegmentVotes:
    """When a stop request shortens a segment: one rule for both engines, so that a stop leaves
    the same state in either. Every STOP_CHECK_TICKS ticks, while two checks remain, the request
    is read (the MPI engine posts a non-blocking all-reduce of every rank's flag), and what was
    read one check earlier applies (by then the all-reduce has completed): the segment becomes
    schedule.stop_count micro-batches long from that tick."""

    def __init__(self, schedule, read):
        """read(): reads the request now and returns a callable that gives what it read (the
        MPI engine's waits for the all-reduce)."""
        self.schedule, self.read = schedule, read
        self.pending = None

    def length(self, tick: int, n: int) -> int:
        """The segment's length from `tick` on, where n is its length so far; called at every
        tick before its actions."""
        if tick % STOP_CHECK_TICKS:
            return n
        if self.pending is not None:
            result, self.pending = self.pending, None
            if result():
                return stop_count(self.schedule, tick, n)
        if tick + 2 * STOP_CHECK_TICKS < self.schedule.num_ticks(n):
            self.pending = self.read()
        return n


# What the engines' stop vote carries (they take its maximum over the ranks): a stop outranks a
# due checkpoint, and both end the current segment at the same tick on every rank.
CHECKPOINT_DUE, STOP = 1, 2
# Evaluation batches between two agreements on a stop request: each agreement drains the
# forward-only pipeline (J - 1 ticks of fill), so a few per ImageNet evaluation (782 batches of
# 64) cost little, and CIFAR's 79 batches run in one piece.
EVAL_CHECK_BATCHES = 256


def _now():
    return time.monotonic()


class Interrupts:
    """A stop request and the wall-time checkpoint cadence as one vote value, read by the engines
    as `requested`: STOP when this process got SIGUSR1/SIGTERM, CHECKPOINT_DUE when
    run.checkpoint_every_minutes have passed since the last checkpoint, else 0. Only one rank
    keeps the clock (rank 0): the vote's maximum then carries its clock to every rank, so all
    decide identically, which separate clocks read at different moments would not."""

    def __init__(self, stop, every_minutes=0.0, keeps_clock=True, clock=None):
        self.stop, self.clock = stop, clock or _now
        self.period = 60.0 * every_minutes if keeps_clock else 0.0
        self.restart()

    def restart(self):
        """Start the next period (after a checkpoint)."""
        self.due = self.clock() + self.period

    @property
    def requested(self) -> int:
        if self.stop is not None and self.stop.requested:
            return STOP
        if self.period and self.clock() >= self.due:
            return CHECKPOINT_DUE
        return 0


def agree(world, interrupts) -> int:
    """At a drain point: the vote over every rank (a blocking all-reduce), the same everywhere."""
    level = interrupts.requested
    if world is None:
        return level
    import numpy as np
    from mpi4py import MPI
    # The buffer form: mpi4py's pickle-based allreduce keeps the GIL while it waits, which would
    # silence the watchdog thread of a rank whose neighbour never comes to the vote.
    levels = np.array([level], dtype=np.int32)
    world.comm.Allreduce(MPI.IN_PLACE, levels, op=MPI.MAX)
    return int(levels[0])
