"""A per-rank timeline of a run, written as Chrome-trace JSON (the Trace Event Format that
Perfetto and chrome://tracing open): `run.trace: true` gives `run.out_dir/trace.json`.

What is recorded, each as a complete ("X") event with ts/dur in microseconds:
- forward, backward, step (optimizer), loss (the last stage's cross-entropy), log (the trainer's
  loss bookkeeping), eval and checkpoint spans;
- wait: the time blocked in MPI per stream (activation/rebuilt/gradient/labels in, and the waits
  of the sends), with the message size in bytes;
- plan: one span per tick naming the actions the schedule planned for it ("B1 F3 S", labels of
  schedule.Action), so the planned actions sit beside the measured ones; under MPI with the bytes
  the rank sent in that tick (compressed size when `comm` compresses).
pid = rank (in one process: the stage), tid = the kind, so each kind is a row of its own.

Cost: when tracing is off every worker holds NULL_TRACER, whose span() returns one shared null
context manager and whose other hooks return their argument: no clock reads, no allocation.
When on, events are small tuples appended to a list, converted to JSON only at the end.
"""
import json
import sys
import time
from contextlib import nullcontext

from ..comm.channels import streams
from ..files import write_atomic

# Kinds of spans; each gets its own row (tid) within a rank, in this order.
FORWARD, BACKWARD, STEP, LOSS, LOG, EVAL, CHECKPOINT, WAIT, PLAN = (
    "forward", "backward", "step", "loss", "log", "eval", "checkpoint", "wait", "plan")
COMPUTE_TIDS = {PLAN: 0, FORWARD: 1, BACKWARD: 2, STEP: 3, LOSS: 4, LOG: 5, EVAL: 6,
                CHECKPOINT: 7}
# The MPI engine's streams (the channel table's, comm/channels.py) and their rows: one row per
# stream, so a rank waiting on its gradients is told apart from one waiting on its activations.
STREAMS = streams()
WAIT_TIDS = {name: 10 + i for i, name in enumerate(STREAMS)}
# Recording stops at this many events per process, so a long run cannot fill memory (about
# 100 bytes each in memory, 150 in the file); trace a short run to look at the schedule.
MAX_EVENTS = 500_000

_NULL_SPAN = nullcontext()  # reusable: entering and leaving it does nothing


class NullTracer:
    """Tracing off: every hook is a no-op that allocates nothing."""
    enabled = False
    tick = b = -1

    def span(self, kind, b=-1):
        return _NULL_SPAN

    def plan(self, tick, actions):
        return actions

    def wrap_callback(self, kind, fn):
        return fn

    def wait(self, stream, start, end, nbytes):
        pass


NULL_TRACER = NullTracer()


class TraceLog:
    """The events of one process and their common time origin (a perf_counter() value that all
    ranks took right after one Barrier, so their timelines line up to within the Barrier's exit
    skew, microseconds on one node)."""

    def __init__(self, origin: float):
        self.origin = origin
        self.events = []   # (kind, name, pid, tid, start, end, b, tick, nbytes)
        self.dropped = 0
        self.names = {}    # pid -> process name

    def add(self, event):
        if len(self.events) < MAX_EVENTS:
            self.events.append(event)
        else:
            self.dropped += 1


class _Span:
    __slots__ = ("tracer", "kind", "b", "start")

    def __init__(self, tracer, kind, b):
        self.tracer, self.kind, self.b = tracer, kind, b

    def __enter__(self):
        if self.tracer.sync is not None:
            self.tracer.sync()  # queued GPU work before the span is not the span's
        self.start = time.perf_counter()
        return self

    def __exit__(self, *exc):
        t = self.tracer
        if t.sync is not None:
            t.sync()
        t.log.add((self.kind, self.kind, t.pid, COMPUTE_TIDS[self.kind], self.start,
                   time.perf_counter(), self.b, t.tick, -1))


class Tracer:
    """Tracing on, for one stage (pid). The engine's loop passes each tick's planned actions
    through plan(), which also tells the tracer the current tick and micro-batch: the waits
    inside an action are tagged with them; the engine reports each stream's waits to wait()."""
    enabled = True

    def __init__(self, log: TraceLog, pid: int, name: str, sync=None):
        # sync: torch.cuda.synchronize on a GPU, else None. CUDA kernels run asynchronously, so
        # without it a span would measure the launches only; tracing a GPU run therefore
        # serialises host and device at every span (slower, but the spans mean something).
        self.log, self.pid, self.sync = log, pid, sync
        self.tick = self.b = -1  # outside a tick (drain, evaluation): -1, left out of args
        self.sent_bytes = 0  # what the MPI engine reported sent (through wait)
        self.under_mpi = False  # whether an engine reports waits at all (the local one does not)
        log.names[pid] = name

    def span(self, kind, b=-1):
        return _Span(self, kind, b)

    def plan(self, tick, actions):
        return self._plan(tick, actions) if actions else actions

    def _plan(self, tick, actions):
        start, sent = time.perf_counter(), self.sent_bytes
        self.tick = tick
        for action in actions:
            self.b = action.microbatch
            yield action
        label = " ".join(a.label for a in actions if a.computes)  # the messages: in the waits
        nbytes = self.sent_bytes - sent if self.under_mpi else -1
        self.log.add((PLAN, label, self.pid, COMPUTE_TIDS[PLAN], start, time.perf_counter(), -1,
                      tick, nbytes))
        self.tick = self.b = -1

    def wrap_callback(self, kind, fn):
        if fn is None:
            return None

        def traced(b, *args):
            with self.span(kind, b):
                return fn(b, *args)
        return traced

    def wait(self, stream, start, end, nbytes):
        self.under_mpi = True
        if stream.endswith(" out") and nbytes > 0:
            self.sent_bytes += nbytes
        self.log.add((WAIT, stream, self.pid, WAIT_TIDS[stream], start, end, self.b, self.tick,
                      nbytes))


def start(enabled: bool, world, stages, device=None) -> list:
    """One tracer per stage of this process (NULL_TRACER each when disabled). Over ranks this is
    collective: every rank must call it (it agrees on the time origin with a barrier)."""
    if not enabled:
        return [NULL_TRACER for _ in stages]
    sync = None
    if device is not None and getattr(device, "type", device) == "cuda":
        import torch
        sync = torch.cuda.synchronize
    if world is not None:
        world.barrier()
    log = TraceLog(time.perf_counter())
    return [Tracer(log, s, f"rank {s}" if world else f"stage {s}", sync) for s in stages]


def finish(tracers: list, world, path: str, meta: dict | None = None) -> str | None:
    """Gather every rank's events to the rank that writes the run's outputs (World.writer_rank),
    which writes `path` atomically (a temporary file, then a rename) and records itself as
    `writer_rank` in its metadata. Collective under MPI. Returns the path on the writing rank."""
    if not tracers or not tracers[0].enabled:
        return None
    log = tracers[0].log
    part = (log.events, log.names, log.origin, log.dropped)
    writer = 0 if world is None else world.writer_rank
    parts = [part] if world is None else world.gather(part, root=writer)
    if world is not None and not world.is_writer:
        return None
    write(path, parts, {**(meta or {}), "writer_rank": writer})
    return path


def to_events(parts) -> list:
    """Trace Event Format dicts from the gathered parts: metadata rows, then the spans."""
    out = []
    for events, names, origin, dropped in parts:
        for pid, name in names.items():
            out.append({"ph": "M", "name": "process_name", "pid": pid, "args": {"name": name}})
            out.append({"ph": "M", "name": "process_sort_index", "pid": pid,
                        "args": {"sort_index": pid}})
            for label, tid in list(COMPUTE_TIDS.items()) + list(WAIT_TIDS.items()):
                label = label if tid < 10 else f"wait {label}"
                out.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid,
                            "args": {"name": label}})
                out.append({"ph": "M", "name": "thread_sort_index", "pid": pid, "tid": tid,
                            "args": {"sort_index": tid}})
        for kind, name, pid, tid, start, end, b, tick, nbytes in events:
            args = {}
            if b >= 0:
                args["microbatch"] = b
            if tick >= 0:
                args["tick"] = tick
            if nbytes >= 0:
                args["bytes"] = nbytes
            out.append({"name": name, "cat": kind, "ph": "X", "pid": pid, "tid": tid,
                        "ts": round((start - origin) * 1e6, 3),
                        "dur": round(max(0.0, end - start) * 1e6, 3), "args": args})
    return out


def write(path: str, parts, meta: dict):
    dropped = sum(p[3] for p in parts)
    if dropped:
        print(f"petra_mpi: trace: {dropped} events past the first {MAX_EVENTS} per process were "
              f"not recorded", file=sys.stderr, flush=True)
    other = {**meta, "dropped_events": dropped}

    def one_event_a_line(f):  # compact, yet a reader can grep it
        f.write('{"displayTimeUnit": "ms", "otherData": ' + json.dumps(other) +
                ', "traceEvents": [\n')
        f.write(",\n".join(json.dumps(e, separators=(",", ":")) for e in to_events(parts)))
        f.write("\n]}\n")
    write_atomic(path, one_event_a_line)
