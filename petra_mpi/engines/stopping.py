"""Stopping on request: SIGUSR1 or SIGTERM makes the run drain, checkpoint and exit. The status
says which signal it was: EXIT_REQUEUE after SIGUSR1 (SLURM before a time limit: the batch script
requeues the job), EXIT_STOPPED after SIGTERM (a cancel, a preemption: the script does not). The
same vote carries the wall-time checkpoint cadence (run.checkpoint_every_minutes)."""
import signal
import sys
import time

EXIT_REQUEUE = 3  # checkpointed on SIGUSR1: requeue to resume
EXIT_STOPPED = 4  # checkpointed on SIGTERM (a cancel, a preemption): stop here
STOP_CHECK_TICKS = 8  # ticks between agreements on a stop request (one all-reduce each)
# Micro-batches a stopped segment keeps beyond what has entered stage 0 when the stop applies.
# At least 1: micro-batch entered_before(t) - 1 may already have had its backward on some stage
# (J = 1, backprop), which decided "no step" with the old length, and must not become the last.
# At least a channel's `ahead` (comm/channels.py, 2) over ranks: a stream posts receives up to
# that many micro-batches past the last one it received, and every posted receive must still
# get its message (tests/unit/test_messages.py checks it at every tick). 3 keeps one micro-batch
# of slack over both bounds. Both engines use this one margin, so a stop leaves the same state.
STOP_MARGIN = 3


class StopRequest:
    """Set by SIGUSR1 or SIGTERM (`requested`); `term`: a SIGTERM came (the run is to stop, not to
    be requeued)."""

    def __init__(self):
        self.requested = self.term = False

    def install(self):
        for sig in (signal.SIGUSR1, signal.SIGTERM):
            signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame):
        if not self.requested:
            print(f"petra_mpi: received {signal.Signals(signum).name}: draining, checkpointing "
                  f"and stopping", file=sys.stderr, flush=True)
        self.requested = True
        self.term = self.term or signum == signal.SIGTERM


def stop_count(schedule, tick: int, n: int) -> int:
    """The segment length when a stop applies at `tick`: what has entered plus STOP_MARGIN, at
    most n. Every action before `tick` is then the same in the segment of n and in the shorter
    one, so the drain leaves every stage with its gradients applied."""
    return min(n, schedule.entered_before(tick) + STOP_MARGIN)


class SegmentVotes:
    """When a stop request shortens a segment: one rule for both engines, so that a stop leaves
    the same state in either. Every STOP_CHECK_TICKS ticks, while two checks remain, the request
    is read (the MPI engine posts a non-blocking all-reduce of every rank's flag), and what was
    read one check earlier applies (by then the all-reduce has completed): the segment becomes
    stop_count micro-batches long from that tick."""

    def __init__(self, schedule, read):
        """read(tick): reads the request at `tick` and returns a callable that gives what it
        read (the MPI engine's waits for the all-reduce)."""
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
            self.pending = self.read(tick)
        return n


# What the engines' stop vote carries (they take its maximum over the ranks): a stop outranks a
# due checkpoint, and both end the current segment at the same tick on every rank. A SIGTERM on
# any rank (STOP_TERM) outranks a SIGUSR1 on another: a cancelled job is not requeued.
CHECKPOINT_DUE, STOP, STOP_TERM = 1, 2, 3


def stop_status(level: int) -> int:
    """The exit status of a run stopped by the agreed vote `level` (STOP or STOP_TERM)."""
    return EXIT_STOPPED if level == STOP_TERM else EXIT_REQUEUE
# Evaluation batches between two agreements on a stop request: each agreement drains the
# forward-only pipeline (J - 1 ticks of fill), so a few per ImageNet evaluation (782 batches of
# 64) cost little, and CIFAR's 79 batches run in one piece.
EVAL_CHECK_BATCHES = 256


def _now():
    return time.monotonic()


class Interrupts:
    """A stop request and the wall-time checkpoint cadence as one vote value, read by the engines
    as `requested`: STOP (STOP_TERM) when this process got SIGUSR1 (SIGTERM), CHECKPOINT_DUE when
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
            return STOP_TERM if getattr(self.stop, "term", False) else STOP
        if self.period and self.clock() >= self.due:
            return CHECKPOINT_DUE
        return 0


def agree(world, interrupts) -> int:
    """At a drain point: the vote over every rank (World.vote, blocking), the same everywhere."""
    level = interrupts.requested
    return level if world is None else world.vote(level)
