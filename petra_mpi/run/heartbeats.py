"""Every rank's heartbeat in the run directory: a thread of each rank rewrites its file,
logs/heartbeats/rank-N, every few seconds while its process runs, whatever the main thread does
(waiting in MPI included). Inside a collective of every rank (a stop vote, a checkpoint's
barrier) MPI does not say which rank is missing; a rank whose watchdog fires there reads every
rank's file, and the ranks whose heartbeat stopped are the ones lost (their process or their
node is gone) or frozen. Files rather than messages: a lost rank answers no message, while its
last file stays on the run directory's file system, which every rank shares (the checkpoints
need it too).

A file holds one line, the wall time of the beat and the rank's host, rewritten whole (a new
file renamed over the old one) so that a reader sees a whole line. Wall times of different
nodes are compared: a beat counts as stopped only when it is STALE_BEATS periods old, far more
than the clocks of a cluster's nodes (kept together by NTP) ever differ."""
import os
import threading
import time

from ..files import write_atomic

FOLDER = os.path.join("logs", "heartbeats")  # in the run directory
MAX_PERIOD_S = 5.0   # the longest time between two beats of a rank
# A heartbeat this many periods old has stopped: half a watchdog's limit (at most 25 s), so
# that one that stopped before a collective began is stale when the watchdog fires there, and a
# live rank's beat may come late by 4 periods (a loaded machine, a slow file system) unnamed.
STALE_BEATS = 5
READ_TIMEOUT_S = 10.0  # a run directory on a file system that hangs names nobody after this


def beat_period(limit_s: float) -> float:
    """The time between two beats under a watchdog of limit_s: a tenth of it, at most
    MAX_PERIOD_S."""
    return min(MAX_PERIOD_S, limit_s / 10)


class Heartbeats:
    """This rank's heartbeat (`start` it; a thread beats every period_s until `close`), and
    which ranks' heartbeats stopped (`stopped`). hosts: every rank's host, in rank order."""

    def __init__(self, run_dir, rank, hosts, period_s):
        self.folder = os.path.join(run_dir, FOLDER)
        self.rank, self.hosts, self.period = rank, list(hosts), period_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="petra-heartbeat", daemon=True)

    def path(self, rank) -> str:
        return os.path.join(self.folder, f"rank-{rank}")

    def start(self):
        """The first beat now (its file is there once this returns), the next ones from a
        thread."""
        self._write()
        self._thread.start()
        return self

    def close(self):
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def _beat(self):
        while not self._stop.wait(self.period):
            self._write()

    def _write(self):
        line = f"{time.time():.1f} {self.hosts[self.rank]}\n"
        try:
            write_atomic(self.path(self.rank), lambda f: f.write(line))
        except OSError:
            pass  # (a full or read-only file system: the reports name nobody)

    def stopped(self):
        """{rank: seconds since its last beat, None if it never beat} of the ranks, this one
        aside, whose last beat is STALE_BEATS periods old or that never beat; None when that
        cannot be told: the files unreadable within READ_TIMEOUT_S (a file system that hangs:
        a thread of its own reads them), or this rank's own beat stale."""
        ages = {}

        def read():
            now = time.time()
            for r in range(len(self.hosts)):
                try:
                    with open(self.path(r)) as f:
                        ages[r] = now - float(f.read().split()[0])
                except (OSError, ValueError, IndexError):
                    ages[r] = None  # no beat, or a file that is not one

        reader = threading.Thread(target=read, name="petra-heartbeat-reader", daemon=True)
        reader.start()
        reader.join(READ_TIMEOUT_S)
        stale, own = STALE_BEATS * self.period, ages.get(self.rank)
        if reader.is_alive() or own is None or own >= stale:
            return None
        return {r: age for r, age in ages.items()
                if r != self.rank and (age is None or age >= stale)}
