"""Hang watchdog for runs over several ranks: a rank that makes no progress for run.watchdog_s
seconds says where it stands and ends with EXIT_STALLED, instead of waiting forever; a rank whose
start-up outlasts run.startup_s does the same. The run builds it (run/assemble.py) and hands it
to the engine as its heartbeat.

Why: when a neighbour's node dies, what the survivors see depends on the transport: some
libraries raise an error, some crash, and MPICH over TCP waits forever on the receive that
will never complete. The engine calls `beat` before every scheduled action; a thread (which
never calls the transport) checks the time since the last beat. Between the loops the trainer
wraps its collectives (the stop votes, the checkpoint's barriers) in `collective`: a rank lost
just before one leaves the others waiting there too.

Some steps may outlast the limit without anything being wrong: a checkpoint's writes, replica 0's
evaluation (the other replicas wait for it in the next stop vote). Every rank calls `allow` before
such a step at the same point of the program, whether or not it does the work itself, and its limit
is raised by the step's grace until its next agreement (a stop vote or the checkpoint's collective
completing): only then does a rank know that every rank is past the step.

The start-up (MPI's start, the device, the data, the stages, a checkpoint's load, the first
micro-batch through every stage) is the first such step, with a deadline of its own. A hang there
often holds Python's interpreter lock (MPI_Init, an HDF5 open on a stalled file system), which
silences any thread of the rank; so a small child process forked before MPI starts watches it
(`begin_startup`) and makes the rank exit with EXIT_STALLED. It ends at the first agreement that
shows every rank has trained its first micro-batch.

A rank's watch loop that slept far longer than it asked was stopped itself (SLURM suspends a job
by stopping every process, `scontrol suspend`; the clock goes on meanwhile): the beat restarts
when it wakes.

The report, one block per rank on stderr (the job's log), names the last action (tick, action,
micro-batch) and every receive and send still pending with the peer rank and its host; its first
line alone says which neighbours went silent. Inside a collective, where no neighbour is waited
on, it names the ranks whose heartbeats stopped (heartbeats.py). docs/running.md, "A rank
stalled", reads one.
"""
import math
import os
import re
import select
import signal
import socket
import sys
import threading
import time
from contextlib import contextmanager

from .heartbeats import Heartbeats, beat_period

EXIT_STALLED = 5  # the trainer's exit status when the watchdog ended it
# run.watchdog_s unset: max(AUTO_FLOOR_S, AUTO_TICKS x the slowest gap between two actions so far)
AUTO_FLOOR_S = 120.0
AUTO_TICKS = 20
# What a rank may wait beyond its limit for work it cannot see: the other ranks' checkpoint
# writes (their file systems), replica 0's evaluation of a piece (EVAL_CHECK_BATCHES batches).
CHECKPOINT_GRACE_S = 600.0
EVALUATION_GRACE_S = 600.0
END_GRACE_S = 600.0  # the end of a run: the writer's trace and summary (its file system)


def auto_limit(slowest_gap_s: float) -> float:
    return max(AUTO_FLOOR_S, AUTO_TICKS * slowest_gap_s)


def was_stopped(asked_s: float, slept_s: float) -> bool:
    """Whether a wait of asked_s that took slept_s means this process was stopped meanwhile
    (SIGSTOP, a suspended job) rather than merely scheduled late."""
    return slept_s > 2 * asked_s + 1.0


class Watchdog:
    """`limit_s`: a fixed limit, or None for auto_limit of the measured gaps between actions; 0:
    nothing is watched (one process, run.watchdog_s 0), but the start-up still ends at the first
    agreement after `warmup_ticks`. `pending()`: this rank's receives and sends in flight, as
    (blocked, direction, stream, peer, count) with blocked true for the one the rank is waiting
    on now (called from the watchdog thread while the main thread waits; it calls no transport;
    None until watch_messages gives it). `rank_name`: this rank in reports ("rank 3 (n2, stage
    3)"). `warmup_ticks`: the ticks in which every stage trains its first micro-batch; the
    start-up ends at an agreement posted after them. `heartbeats`: this rank's Heartbeats,
    started with the watch (a report inside a collective names the ranks whose heartbeats
    stopped), or None. `exit`: how the rank ends (os._exit: the main thread is stuck in the
    transport, where no exception would reach it)."""

    def __init__(self, limit_s, rank_name, pending=None, warmup_ticks=0, out=sys.stderr,
                 exit=os._exit, heartbeats=None):
        self.fixed, self.rank_name, self.pending = limit_s, rank_name, pending
        self.heartbeats = heartbeats if limit_s != 0 else None
        self.warmup_ticks = warmup_ticks
        self.out, self.exit = out, exit
        self.slowest = 0.0
        self.last = None   # (monotonic time, tick, action, micro-batch) of the last beat
        self.grace = 0.0   # seconds beyond the limit until the next agreement (allow)
        self.grace_for = None  # the step that grace is for ("checkpoint")
        self.starting = startup_watched()  # the start-up watcher watches until it ends
        self.armed = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="petra-watchdog", daemon=True)
        if limit_s != 0:
            self._thread.start()
        if self.heartbeats:
            self.heartbeats.start()

    def watch_messages(self, pending):
        """From now on the reports list `pending()`'s messages (the engine's, built after the
        watchdog that watches it)."""
        self.pending = pending

    def limit(self) -> float:
        return self.fixed if self.fixed is not None else auto_limit(self.slowest)

    def beat(self, tick, action, microbatch):
        """The rank is about to run `action` of `microbatch` at `tick`: it made progress."""
        now = time.monotonic()
        if self.armed and self.last is not None and not self.starting:
            self.slowest = max(self.slowest, now - self.last[0])
        self.last = (now, tick, action, microbatch)
        self.armed = True

    def idle(self):
        """Out of the loops until the next beat (evaluation set-up, the end)."""
        self.armed = False

    def allow(self, step, grace_s):
        """Every rank is about to run `step` ("evaluation"), which may outlast the limit by
        grace_s on some rank: until this rank's next agreement its limit is raised by grace_s."""
        if grace_s >= self.grace:
            self.grace, self.grace_for = grace_s, step

    def agreed(self, tick=None):
        """Every rank has come to the same agreement: a stop vote posted at `tick` of a segment,
        or (None) one at a drain. Every rank is past the steps allowed for, and past its start-up
        once every stage has trained its first micro-batch."""
        self.grace, self.grace_for = 0.0, None
        if self.starting and (tick is None or tick >= self.warmup_ticks):
            self.starting = False
            end_startup()

    @contextmanager
    def collective(self, name, grace_s=0.0):
        """Inside: a collective of every rank named `name` ("stop vote", "checkpoint"), watched
        with the limit plus grace_s (and what `allow` allowed); an agreement when it completes,
        idle after it (its length is not a gap between actions)."""
        if grace_s:
            self.allow(name, grace_s)
        self.last, self.armed = (time.monotonic(), None, name, None), True
        try:
            yield
            self.agreed()
        finally:
            self.armed = False

    def close(self):
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        if self.heartbeats:
            self.heartbeats.close()

    def _watch(self):
        while True:
            asked = min(1.0, self.limit() / 10)
            before = time.monotonic()
            if self._stop.wait(asked):
                return
            now, last = time.monotonic(), self.last
            if was_stopped(asked, now - before):
                # The whole process was stopped: the main thread made no progress either.
                if last is not None:
                    self.last = (now, *last[1:])
                continue
            limit = self.limit() + self.grace
            if self.armed and not self.starting and last is not None and now - last[0] > limit:
                self._report(limit, last)
                # Let the other ranks' watchdogs, which stalled within the same second, print
                # theirs before the launcher tears the job down on our exit.
                time.sleep(min(2.0, limit / 2) + 1.0)
                self.exit(EXIT_STALLED)
                return

    def _report(self, limit, last):
        _, tick, action, microbatch = last
        key = "run.watchdog_s" + (f" + {self.grace_for} grace" if self.grace else "")
        if tick is None:  # inside a collective: no neighbour to name, but the heartbeats
            self._write(f"petra_mpi: watchdog: {self.rank_name}: no progress for {limit:g} s "
                        f"({key}) in the {action}, a collective of every rank: "
                        f"{self._who_stopped()}; exit status {EXIT_STALLED}")
            return
        pending = self.pending() if self.pending else []
        blocked = [f"{direction} of {stream} {'from' if direction == 'receive' else 'to'} {peer}"
                   for is_blocked, direction, stream, peer, _ in pending if is_blocked]
        why = (f"waiting on the {blocked[0]}: that rank or its node is lost or stalled" if blocked
               else "not waiting on MPI: this rank's own work stalled")
        head = (f"petra_mpi: watchdog: {self.rank_name}: no progress for {limit:g} s "
                f"({key}) after tick {tick}, {action} of micro-batch {microbatch}; "
                f"{why}; exit status {EXIT_STALLED}")
        lines = [head] + [f"  {'waiting' if b else 'pending'}: {direction} {stream} "
                          f"{'from' if direction == 'receive' else 'to'} {peer} ({n} in flight)"
                          for b, direction, stream, peer, n in pending]
        _write(self.out, "\n".join(lines))

    def _who_stopped(self) -> str:
        """Which ranks of a collective are gone, as far as their heartbeats tell: by host, the
        host whose ranks stopped first (its last beat the oldest) first."""
        stopped = self.heartbeats.stopped() if self.heartbeats else None
        if stopped is None:
            return "a rank or its node is lost or stalled"
        if not stopped:
            return ("every rank's heartbeat goes on: a rank is stalled, or cut off from the "
                    "others")
        hosts, by_host = self.heartbeats.hosts, {}
        for r in sorted(stopped):
            by_host.setdefault(hosts[r], []).append(r)

        def since(host):  # the newest beat of the host's stopped ranks
            ages = [stopped[r] for r in by_host[host] if stopped[r] is not None]
            return min(ages) if ages else math.inf

        def group(host):
            whole = len(by_host[host]) == hosts.count(host)  # then the node itself is likely gone
            age = since(host)
            return (f"{_ranks(by_host[host])} ({host}{', all of its ranks' if whole else ''})"
                    + (f" for {age:.0f} s" if age < math.inf else ""))

        order = sorted(by_host, key=lambda h: (-since(h), by_host[h][0]))
        return f"no heartbeat from {' and from '.join(map(group, order))}: lost or stalled"

    def _write(self, text):
        _write(self.out, text)


def _write(out, text):
    # one write, newline included: print() writes the end apart, and the launcher can put
    # another rank's report between the two
    out.write(text + "\n")
    out.flush()


def start_watchdog(limit_s, world, warmup_ticks=0, run_dir=None):
    """The watchdog of this rank (`limit_s`: run.watchdog_s; 0: none watches, under one process
    too, world None; None: the automatic limit); `warmup_ticks`: see Watchdog; `run_dir`: where
    every rank's heartbeat is (None: no heartbeats)."""
    if world is None:
        return Watchdog(0, "rank 0", warmup_ticks=warmup_ticks)
    me = world.placement[world.rank] if world.placement else None
    rank_name = f"rank {world.rank}" + (f" ({me['host']}, stage {me['stage']})" if me else "")
    heartbeats = None
    if run_dir and me and limit_s != 0:
        heartbeats = Heartbeats(run_dir, world.rank, [p["host"] for p in world.placement],
                                beat_period(AUTO_FLOOR_S if limit_s is None else limit_s))
    return Watchdog(limit_s, rank_name, warmup_ticks=warmup_ticks, heartbeats=heartbeats)


# ---------------------------------------------------------------------------- the start-up
# The watcher of this process's start-up (one per process): the write end of its pipe.
_startup_pipe = None


def begin_startup(deadline_s, rank):
    """Watch this rank's start-up from now on from a child process: each step (startup_step) may
    take deadline_s seconds (run.startup_s; 0: not watched). Call it before the transport
    starts. When a
    step outlasts the deadline, the watcher reports like the watchdog and makes the rank exit
    with EXIT_STALLED: the rank's handler of signal EXIT_STALLED (SIGTRAP) is the C library's
    _exit, which the kernel calls with the signal's number, so the rank exits even while its
    interpreter is held in native code; SIGKILL follows when even that cannot run (the report
    is written either way)."""
    global _startup_pipe
    if not deadline_s or _startup_pipe is not None or "mpi4py.MPI" in sys.modules:
        return  # (a process forked after MPI started is unsafe on some interconnects)
    import ctypes
    assert signal.SIGTRAP == EXIT_STALLED
    libc = ctypes.CDLL(None, use_errno=True)
    libc.signal.restype = ctypes.c_void_p
    libc.signal.argtypes = (ctypes.c_int, ctypes.c_void_p)
    libc.signal(signal.SIGTRAP, ctypes.cast(libc._exit, ctypes.c_void_p).value)
    rank_name = f"rank {rank} ({socket.gethostname().split('.')[0]})"
    read_end, write_end = os.pipe()
    rank_pid = os.getpid()
    sys.stderr.flush()
    child = os.fork()
    if child == 0:
        # The watcher is a grandchild (its parent exits at once and is reaped below), so that no
        # zombie stays in the rank; no MPI, no torch yet, and it leaves with the start-up.
        code = 1
        try:
            if os.fork() == 0:
                os.close(write_end)
                os.closerange(3, read_end)  # the launcher's descriptors (PMI) are the rank's
                os.closerange(read_end + 1, os.sysconf("SC_OPEN_MAX"))
                for sig in (signal.SIGUSR1, signal.SIGUSR2, signal.SIGTERM, signal.SIGINT):
                    signal.signal(sig, signal.SIG_IGN)  # signals for the job are the rank's
                _watch_startup(read_end, deadline_s, rank_name, rank_pid)
            code = 0
        finally:
            os._exit(code)
    os.waitpid(child, 0)
    os.close(read_end)
    _startup_pipe = write_end
    startup_step("starting MPI")


def startup_watched() -> bool:
    return _startup_pipe is not None


def startup_step(what):
    """Tell the start-up watcher what this rank starts now ("opening the data"): its report
    names the last step."""
    _tell_watcher((what.replace("\n", " ") + "\n").encode())


def end_startup():
    """The start-up is over: the watcher leaves, the rank's handler of SIGTRAP is the default
    again."""
    global _startup_pipe
    if _startup_pipe is None:
        return
    _tell_watcher(b"\0\n")
    os.close(_startup_pipe)
    _startup_pipe = None
    signal.signal(signal.SIGTRAP, signal.SIG_DFL)


def _tell_watcher(data):
    if _startup_pipe is None:
        return
    try:
        os.write(_startup_pipe, data)
    except OSError:  # the watcher was killed: the start-up goes on unwatched
        pass


def startup_report(rank_name, deadline_s, step) -> str:
    """The start-up watcher's report: `rank_name` ("rank 1 (n2)") spent deadline_s in `step`."""
    return (f"petra_mpi: watchdog: {rank_name}: no progress for {deadline_s:g} s "
            f"(run.startup_s) in the start-up, at: {step}; exit status {EXIT_STALLED}")


def _watch_startup(pipe, deadline_s, rank_name, rank_pid):
    """The watcher's loop: read the rank's steps until it says the start-up is over (or dies:
    end of file); when a step outlasts the deadline, report and end the rank."""
    step, pending, left = "starting", b"", deadline_s
    while left > 0:
        asked = min(1.0, deadline_s / 10)
        before = time.monotonic()
        readable, _, _ = select.select([pipe], [], [], asked)
        slept = time.monotonic() - before
        if not was_stopped(asked, slept):  # a suspended job: its start-up did not run either
            left -= slept
        if readable:
            data = os.read(pipe, 4096)
            if not data or b"\0" in data:
                return  # started, or the rank is gone
            *lines, pending = (pending + data).split(b"\n")
            if lines:
                step, left = lines[-1].decode(errors="replace"), deadline_s
    _write(sys.stderr, startup_report(rank_name, deadline_s, step))
    os.kill(rank_pid, signal.SIGTRAP)
    until = time.monotonic() + 5.0
    while time.monotonic() < until:  # end of file: the rank has exited
        readable, _, _ = select.select([pipe], [], [], until - time.monotonic())
        if readable and not os.read(pipe, 4096):
            return
    os.kill(rank_pid, signal.SIGKILL)


# ------------------------------------------------------------------ reading the reports back
# After a stalled run, the batch script asks which rank the reports point at: each report names
# the rank it waited on (inside a collective: the first rank whose heartbeat stopped, one of a
# host that lost every rank first), so the waits form chains, and a chain ends at the rank that
# is lost or stalled itself (it printed no report, or its report says it was not waiting on MPI).

_REPORT = re.compile(r"petra_mpi: watchdog: rank (\d+)(?: \(([^,)]+)[,)])?")
_WAITED_ON = re.compile(r"waiting on the (?:receive|send) of .*? (?:from|to) rank (\d+)"
                        r"(?: \(([^)]+)\))?: ")
_HEARTBEATS_STOPPED = re.compile(r"no heartbeat from (.+?): lost or stalled")
_HOST_GROUP = re.compile(r"ranks? ([\d–, ]+) \(([^,)]+)")  # "ranks 4–5 (n3" of the above
# srun's line for the first task that ended: the step is being torn down after it, and a rank
# that was stopped (SIGSTOP, a suspended node) may still report then, blaming a live neighbour.
# A report that names the heartbeats that stopped still counts then (a rank crashed as a node
# was lost, and the watchdog of another fired after it): a rank stopped itself names none (its
# own beat stopped too), and the ranks that stopped first come first.
_STEP_ENDING = re.compile(r"^srun: error: (?:\S+: tasks? [\d,-]+: |Node failure)")
OWN_WORK = "own work"  # a report's wait when the rank was not waiting on MPI


def read_reports(log_text: str):
    """The watchdog reports of a launch's part of the log (up to srun's first task end, but for
    those that name stopped heartbeats): returns ({rank: the rank it waited on, OWN_WORK, or
    None (a collective, the start-up)}, {rank: host} as the reports name them)."""
    waits, hosts, ending = {}, {}, False
    for line in log_text.splitlines():
        ending = ending or bool(_STEP_ENDING.match(line))
        report = _REPORT.search(line)
        if not report or int(report.group(1)) in waits:
            continue
        peer, stopped = _WAITED_ON.search(line), _HEARTBEATS_STOPPED.search(line)
        if ending and not stopped:
            continue
        rank = int(report.group(1))
        if report.group(2):
            hosts[rank] = report.group(2)
        if peer:
            waits[rank] = int(peer.group(1))
            if peer.group(2):
                hosts.setdefault(waits[rank], peer.group(2))
        elif stopped:
            groups = [(_rank_list(g.group(1)), g.group(2))
                      for g in _HOST_GROUP.finditer(stopped.group(1))]
            waits[rank] = groups[0][0][0]
            for ranks, host in groups:
                for r in ranks:
                    hosts.setdefault(r, host)
        else:
            waits[rank] = OWN_WORK if "not waiting on MPI" in line else None
    return waits, hosts


def _ranks(ranks) -> str:
    """'rank 4' or 'ranks 4–5, 7': consecutive ranks as ranges."""
    ranks, spans = sorted(ranks), []
    for r in ranks:
        if spans and r == spans[-1][1] + 1:
            spans[-1][1] = r
        else:
            spans.append([r, r])
    text = ", ".join(f"{a}" if a == b else f"{a}–{b}" for a, b in spans)
    return f"rank{'s' if len(ranks) > 1 else ''} {text}"


def _rank_list(text: str) -> list:
    """The ranks of _ranks' text without its word: "4–5, 7" -> [4, 5, 7]."""
    ranks = []
    for span in text.split(","):
        first, _, last = span.strip().partition("–")
        ranks += range(int(first), int(last or first) + 1)
    return ranks


def diagnose(waits: dict, hosts: dict, size: int | None = None):
    """From read_reports' waits and hosts, and the number of ranks when known: (the hosts of the
    ranks to blame, one line saying which). The chains of waits end at a rank that did not
    report or whose own work stalled; where the reports name no rank (a collective, the
    start-up), the ranks that did not report are to blame. ([], "") without reports."""
    if not waits:
        return [], ""
    named = {p for p in waits.values() if isinstance(p, int)}
    silent = sorted(set(range(size) if size else named) - set(waits))
    ends = []
    for r in sorted(waits):
        seen = set()
        while isinstance(waits.get(r), int) and r not in seen:
            seen.add(r)
            r = waits[r]
        if r not in seen and r not in ends and (r not in waits or waits[r] == OWN_WORK):
            ends.append(r)  # (a chain that runs into a cycle of waits blames no rank)

    def at(r):
        return f"rank {r}" + (f" on {hosts[r]}" if r in hosts else "")

    def beside(r):
        """The silent ranks of r's host (the ranks elsewhere that were ended before their own
        watchdogs fired are beside the point)."""
        return [s for s in silent if r not in hosts or hosts.get(s) == hosts[r]]

    lines = [f"{at(r)} is lost or stalled: {_ranks(beside(r))} did not report" if r not in waits
             else f"{at(r)} stalled in its own work (it was not waiting on MPI)" for r in ends]
    if not ends and silent:
        ends = silent
        lines.append(f"{', '.join(at(r) for r in silent)}: lost or stalled (no report; the "
                     f"others' reports name no rank they waited on)")
    if not lines and named:
        lines.append("every rank reported waiting on another: no rank stands out")
    elif not lines:
        lines.append("the reports name no rank they waited on, and " +
                     ("every rank reported" if size else "which ranks did not report is unknown"))
    return sorted({hosts[r] for r in ends if r in hosts}), "; ".join(lines)


_RANK_MAP = re.compile(r"^petra_mpi: rank map \((\d+) ranks\)$")
_RANK_ROW = re.compile(r"^  rank +(\d+)  host (\S+)  stage ")


def read_rank_map(log_text: str) -> dict:
    """rank -> host from the rank map that rank 0 printed at start-up (comm/devices.rank_map) in
    `log_text`, a launch's part of the log; {} when that launch printed none (it hung before).
    Only a launch's own map says where its ranks ran: the one before a requeue may name other
    nodes."""
    hosts, lines = {}, iter(log_text.splitlines())
    for line in lines:
        if _RANK_MAP.match(line):
            for row in lines:
                found = _RANK_ROW.match(row)
                if not found:
                    break
                hosts[int(found.group(1))] = found.group(2)
            return hosts
    return hosts


NO_RANK_MAP = ("no rank map of this launch in the log (it stalled before rank 0 printed one): "
               "no host is blamed")


def main(argv=None) -> int:
    """`python -m petra_mpi.watchdog --diagnose RUN_DIR [--log-from BYTES]`: read the reports and
    the rank map in RUN_DIR/logs/train.log (from byte BYTES: the launch that stalled) and print
    two lines: the hosts to blame (comma-separated, empty when none stands out or that launch
    printed no rank map), then the diagnosis (empty without reports)."""
    import argparse
    parser = argparse.ArgumentParser(prog="python -m petra_mpi.watchdog")
    parser.add_argument("--diagnose", metavar="RUN_DIR", required=True)
    parser.add_argument("--log-from", type=int, default=0, metavar="BYTES")
    args = parser.parse_args(argv)
    with open(os.path.join(args.diagnose, "logs", "train.log"), "rb") as f:
        f.seek(args.log_from)
        text = f.read().decode(errors="replace")
    placement = read_rank_map(text)
    waits, hosts = read_reports(text)
    avoid, line = diagnose(waits, {**placement, **hosts}, len(placement) or None)
    if waits and not placement:
        avoid, line = [], f"{line}; {NO_RANK_MAP}"
    print(",".join(avoid))
    print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
