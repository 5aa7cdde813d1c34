"""Hang watchdog for MPI runs: a rank that makes no progress for run.watchdog_s seconds says where
it stands and ends with EXIT_STALLED, instead of waiting forever.

Why: when a neighbour's node dies, what the survivors see depends on the transport: some MPI
libraries raise an error, some crash, and MPICH over TCP waits forever on the receive that
will never complete. The engine calls `beat` before every scheduled action; a thread (which
never calls MPI) checks the time since the last beat. Between the loops the trainer wraps its
collectives (the stop votes, the checkpoint's barriers) in `collective`: a rank lost just before
one leaves the others waiting there too. A checkpoint gets CHECKPOINT_GRACE_S more, since its
barriers also wait for the slowest rank's file system. Elsewhere outside the loops (start-up,
the end) the watchdog is idle.

The report, one block per rank on stderr (the job's log), names the last action (tick, action,
micro-batch) and every receive and send still pending with the peer rank and its host; its first
line alone says which neighbours went silent. docs/running.md, "A rank stalled", reads one.
"""
import os
import sys
import threading
import time
from contextlib import contextmanager

EXIT_STALLED = 5  # the trainer's exit status when the watchdog ended it
# run.watchdog_s unset: max(AUTO_FLOOR_S, AUTO_TICKS x the slowest gap between two actions so far)
AUTO_FLOOR_S = 120.0
AUTO_TICKS = 20
# A checkpoint's collectives may wait this much longer: the other ranks write their stage files.
CHECKPOINT_GRACE_S = 600.0


def auto_limit(slowest_gap_s: float) -> float:
    return max(AUTO_FLOOR_S, AUTO_TICKS * slowest_gap_s)


class Watchdog:
    """`limit_s`: a fixed limit, or None for auto_limit of the measured gaps between actions.
    `pending()`: this rank's receives and sends in flight, as (blocked, direction, stream, peer,
    count) with blocked true for the one the rank is waiting on now (called from the watchdog
    thread while the main thread waits; it calls no MPI). `where`: this rank's name in reports
    ("rank 3 (n2, stage 3)"). `exit`: how the rank ends (os._exit: the main thread is stuck in
    MPI, where no exception would reach it)."""

    def __init__(self, limit_s, where, pending, out=sys.stderr, exit=os._exit):
        self.fixed, self.where, self.pending = limit_s, where, pending
        self.out, self.exit = out, exit
        self.slowest = 0.0
        self.last = None   # (monotonic time, tick, action, micro-batch) of the last beat
        self.grace = 0.0   # seconds beyond the limit (inside a checkpoint's collectives)
        self.armed = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="petra-watchdog", daemon=True)
        self._thread.start()

    def limit(self) -> float:
        return self.fixed if self.fixed is not None else auto_limit(self.slowest)

    def beat(self, tick, action, microbatch):
        """The rank is about to run `action` of `microbatch` at `tick`: it made progress."""
        now = time.monotonic()
        if self.armed and self.last is not None:
            self.slowest = max(self.slowest, now - self.last[0])
        self.last = (now, tick, action, microbatch)
        self.armed = True

    def idle(self):
        """Out of the loops until the next beat (evaluation set-up, the end)."""
        self.armed = False

    @contextmanager
    def collective(self, name, grace_s=0.0):
        """Inside: a collective of every rank named `name` ("stop vote", "checkpoint"), watched
        with the limit plus grace_s; idle after it (its length is not a gap between actions)."""
        self.grace, self.last, self.armed = grace_s, (time.monotonic(), None, name, None), True
        try:
            yield
        finally:
            self.armed, self.grace = False, 0.0

    def close(self):
        self._stop.set()
        self._thread.join()

    def _watch(self):
        while not self._stop.is_set():
            limit = self.limit()
            self._stop.wait(min(1.0, limit / 10))
            last, limit = self.last, limit + self.grace
            if self.armed and last is not None and time.monotonic() - last[0] > limit:
                self._report(limit, last)
                # Let the other ranks' watchdogs, which stalled within the same second, print
                # theirs before the launcher tears the job down on our exit.
                time.sleep(min(2.0, limit / 2) + 1.0)
                self.exit(EXIT_STALLED)
                return

    def _report(self, limit, last):
        _, tick, action, microbatch = last
        if tick is None:  # inside a collective
            self._write(f"petra_mpi: watchdog: {self.where}: no progress for {limit:g} s "
                        f"(run.watchdog_s{' + checkpoint grace' if self.grace else ''}) in the "
                        f"{action}, a collective of every rank: a rank or its node is lost or "
                        f"stalled; exit status {EXIT_STALLED}")
            return
        pending = self.pending()
        blocked = [f"{direction} of {stream} {'from' if direction == 'receive' else 'to'} {peer}"
                   for is_blocked, direction, stream, peer, _ in pending if is_blocked]
        why = (f"waiting on the {blocked[0]}: that rank or its node is lost or stalled" if blocked
               else "not waiting on MPI: this rank's own work stalled")
        head = (f"petra_mpi: watchdog: {self.where}: no progress for {limit:g} s "
                f"(run.watchdog_s) after tick {tick}, {action} of micro-batch {microbatch}; "
                f"{why}; exit status {EXIT_STALLED}")
        lines = [head] + [f"  {'waiting' if b else 'pending'}: {direction} {stream} "
                          f"{'from' if direction == 'receive' else 'to'} {peer} ({n} in flight)"
                          for b, direction, stream, peer, n in pending]
        self._write("\n".join(lines))

    def _write(self, text):
        # one write, newline included: print() writes the end apart, and the launcher can put
        # another rank's report between the two
        self.out.write(text + "\n")
        self.out.flush()


class NoWatchdog:
    """Stands in where no watchdog runs (one process, run.watchdog_s = 0)."""

    def beat(self, tick, action, microbatch):
        pass

    def idle(self):
        pass

    @contextmanager
    def collective(self, name, grace_s=0.0):
        yield

    def close(self):
        pass


def start_watchdog(limit_s, world, pending):
    """The watchdog of this rank (NoWatchdog when `limit_s`, run.watchdog_s, is 0; None: the
    automatic limit); `pending`: see Watchdog."""
    if limit_s == 0:
        return NoWatchdog()
    me = world.placement[world.rank] if world.placement else None
    where = (f"rank {world.rank}" + (f" ({me['host']}, stage {me['stage']})" if me else ""))
    return Watchdog(limit_s, where, pending)
