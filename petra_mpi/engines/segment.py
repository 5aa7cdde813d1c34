"""The segment driver: the tick loop of both engines, written once (Algorithm 1 of the paper).

A segment runs n micro-batches from an empty pipeline to a full drain. At every tick each stage
runs its lowered actions (core/schedule.py: receive, compute, send, in order; engines/tick.py
runs each) through its port; a stop request read every STOP_CHECK_TICKS ticks may shorten the
segment (stopping.SegmentVotes). The local engine hands the driver every stage of every replica
in rank order, so each tick runs stage by stage, every replica through tick t before t + 1 (a
stage's replica average needs all of them); the MPI engine hands it its one stage.
"""
from .stopping import SegmentVotes
from .tick import run_action


class NoHeartbeat:
    """Where no watchdog watches the loop (one process, the benchmarks): what an engine tells
    its watchdog (run/watchdog.py), said to no one."""

    def beat(self, tick, action, microbatch):
        """About to run `action` of `microbatch` at `tick`."""

    def idle(self):
        """Out of the loops until the next beat."""

    def agreed(self, tick=None):
        """Every rank has come to a stop vote posted at `tick` (None: at a drain)."""


NO_HEARTBEAT = NoHeartbeat()


def train_segment(schedule, runs, n: int, vote=None, heartbeat=NO_HEARTBEAT) -> int:
    """Train the StageRuns `runs` on a segment of n micro-batches of `schedule`. vote: None (no
    stop request), or vote(tick) that reads the request at `tick` and returns a callable giving
    what was read, the same on every rank. Returns the micro-batches trained."""
    for run in runs:
        run.worker.begin_segment()
    votes = None if vote is None else SegmentVotes(schedule, vote)
    return _run(schedule, runs, n, votes, heartbeat, traced=True)


def evaluate(schedule, runs, m: int, heartbeat=NO_HEARTBEAT):
    """Run m batches through `runs` with a forward-only `schedule` (ForwardOnlySchedule), the
    stages in eval mode (running batch-norm statistics); results go to the last run's report."""
    for run in runs:
        run.worker.stage.eval()
    try:
        # not traced: the trace's plan spans are the training ticks (the trainer spans the eval)
        _run(schedule, runs, m, None, heartbeat, traced=False)
    finally:
        for run in runs:
            run.worker.stage.train()


def _run(schedule, runs, n, votes, heartbeat, traced) -> int:
    for run in runs:
        run.port.expect(schedule.receives(run.stage, n))
    t = 0
    while t < schedule.num_ticks(n):
        if votes is not None:
            n = _shorten(schedule, runs, n, votes.length(t, n))
        for run in runs:
            actions = schedule.lowered(run.stage, t, n)
            if traced:  # passes the actions through (it records the tick when tracing is on)
                actions = run.worker.tracer.plan(t, actions)
            for action in actions:
                heartbeat.beat(t, action.kind.value, action.microbatch)
                run_action(run, action)
        t += 1
    # A vote is posted only while 2 checks remain, so none is pending here; a request that
    # arrives later is seen by the trainer's stop check at the drain.
    assert votes is None or votes.pending is None
    for run in runs:
        run.worker.settle()  # the segment's last step, when it waited for the replicas' average
        run.port.flush()
        run.finish()
    heartbeat.idle()
    return n


def _shorten(schedule, runs, n, shorter) -> int:
    """The segment's length from now on; a stop shortened it from n to `shorter` micro-batches:
    every receive already posted still gets its message (stopping.STOP_MARGIN), and the actions
    of the shorter segment end with its drain and last optimizer steps."""
    if shorter != n:
        for run in runs:
            before, after = schedule.receives(run.stage, n), schedule.receives(run.stage, shorter)
            run.port.shrink({kind: before[kind] - after[kind] for kind in before})
    return shorter
