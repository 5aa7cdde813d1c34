"""The schedule as data: which actions each stage runs at each tick (docs/design.md §1).

Micro-batch b enters stage 0 at tick b. With J stages:
- petra / delayed: stage s forwards b = t - s and backwards b = t - 2(J-1) + s at tick t, so the
  forward and backward of one micro-batch on stage s are d_s = 2(J-1-s) ticks apart; the last
  stage does both at once (forward_backward).
- backprop: one micro-batch in flight at a time; b occupies ticks b(2J-1) ... b(2J-1) + 2(J-1),
  going forward through every stage and back again.
Within a tick a stage runs its backward first, then its forward, then its optimizer step if one
is due: the backward and the forward only need the previous tick's messages, so this order
trains exactly as any other, and the backward frees a FIFO entry before the forward pushes one.
A segment of n micro-batches starts with an empty pipeline (fill) and ends with every backward done
(drain); stages take an optimizer step after every k backwards and after their last one.
Evaluation runs a forward-only schedule (ForwardOnlySchedule) the same way.

A stage's in-flight count d_s (`in_flight`) is the schedule's: how many micro-batches a stage
holds after a forward, whose backwards are still to come (its FIFO's and kept graphs' window),
and how many micro-batches late its gradients are, d_s / k optimizer updates
(`delay_in_updates`). The stages, the delay compensation, the kept-blocks plan and the dry run
read it here; SCHEDULES is the table of methods, and the config's train.method choices are its
names.

lowered() turns a stage's actions of a tick into what the engines run: the data read, the
receives, the computation, the sends and the report, each message naming its peer stage.

`python -m petra_mpi.schedule --method petra --stages 4 --microbatches 8 --accumulation 2`
prints each rank's actions as a grid.
"""
import argparse
from dataclasses import dataclass
from enum import Enum

from ..comm.channels import CHANNELS, of_action


class Kind(str, Enum):
    """What an action does; its value is the one name of the op everywhere (traces, models,
    the watchdog's report)."""
    # a stage's own work: what actions() plans and the grid shows
    FORWARD = "forward"
    BACKWARD = "backward"
    FORWARD_BACKWARD = "forward_backward"  # the last stage: forward, loss and backward at once
    STEP = "step"                          # the optimizer step, after the backward of microbatch
    EVALUATE = "evaluate"                  # evaluation: a forward with running statistics
    # around it, what lowered() adds: the data, the messages (to or from `peer`), the result
    LOAD = "load"                          # stage 0 reads the micro-batch from the data
    SEND_F = "send_forward"                # the activation, to stage + 1
    RECV_F = "receive_forward"
    SEND_B = "send_backward"               # (x̃, δx), to stage - 1
    RECV_B = "receive_backward"
    SEND_L = "send_labels"                 # stage 0's labels, to the last stage
    RECV_L = "receive_labels"
    REPORT = "report"                      # the last stage hands on the loss (or the logits)


SYMBOLS = {Kind.FORWARD: "F", Kind.BACKWARD: "B", Kind.FORWARD_BACKWARD: "FB", Kind.STEP: "S",
           Kind.EVALUATE: "E"}
# the receive of each send, from the channel table (comm/channels.py)
RECEIVER = {Kind(c.send): Kind(c.receive) for c in CHANNELS}


@dataclass(frozen=True)
class Action:
    kind: Kind
    stage: int
    microbatch: int
    peer: int | None = None  # a message's other stage: where a send goes, a receive comes from

    @property
    def computes(self) -> bool:
        """Whether it is the stage's own work (planned by actions()), not what lowered() adds."""
        return self.kind in SYMBOLS

    @property
    def label(self) -> str:
        """F3, B1, FB5, E2 or S (the step's micro-batch is the backward's just before it); a
        lowered action: its kind and micro-batch (send_forward 3)."""
        if not self.computes:
            return f"{self.kind.value} {self.microbatch}"
        return SYMBOLS[self.kind] + ("" if self.kind is Kind.STEP else str(self.microbatch))


def updates_after(b: int, n: int, k: int) -> bool:
    """Whether a stage steps its optimizer after the backward of micro-batch b (0-based) of a
    segment of n: every k backwards, and at the drain so no gradient is left behind."""
    return (b + 1) % k == 0 or b == n - 1


def _valid(b: int, n: int):
    return b if 0 <= b < n else None


class TickSchedule:
    """Which micro-batch each stage forwards and backwards at each tick, and the actions that
    follow from it; a subclass gives the timing (num_ticks, forward_microbatch,
    backward_microbatch, entered_before)."""
    method: str
    backward = True  # whether a backward follows each forward (not in evaluation)

    def __init__(self, num_stages: int, accumulation: int = 1):
        self.J, self.k = num_stages, accumulation

    def num_ticks(self, n: int) -> int:
        """How many ticks a segment of n micro-batches takes, drain included."""
        raise NotImplementedError

    def forward_microbatch(self, stage, tick, n):
        """The micro-batch `stage` forwards at `tick`, or None (the last stage: also its
        backward)."""
        raise NotImplementedError

    def backward_microbatch(self, stage, tick, n):
        """The micro-batch `stage` backwards at `tick`, or None."""
        raise NotImplementedError

    def entered_before(self, tick: int) -> int:
        """How many micro-batches entered stage 0 before `tick`."""
        raise NotImplementedError

    def in_flight(self, stage: int) -> int:
        """d_s: how many micro-batches later than its forward `stage` runs a micro-batch's
        backward, i.e. how many it holds after a forward (its backward runs first in a tick),
        and how many micro-batches late its gradients are; 0 where nothing waits between a
        forward and its backward."""
        raise NotImplementedError

    def delay_in_updates(self, stage: int) -> float:
        """How many optimizer updates late `stage`'s gradients are on average: d_s / k (exactly:
        the k staleness values floor(b / k) - floor((b - d_s) / k) of one update sum to d_s)."""
        return self.in_flight(stage) / self.k

    def actions(self, stage: int, tick: int, n: int) -> list:
        """The actions of `stage` at `tick` of a segment of n, in the order they run."""
        out = []
        if stage == self.J - 1:
            b = self.forward_microbatch(stage, tick, n)
            if b is not None:
                out.append(Action(Kind.FORWARD_BACKWARD, stage, b))
            stepped = b
        else:
            stepped = self.backward_microbatch(stage, tick, n)
            if stepped is not None:
                out.append(Action(Kind.BACKWARD, stage, stepped))
            b = self.forward_microbatch(stage, tick, n)
            if b is not None:
                out.append(Action(Kind.FORWARD, stage, b))
        if stepped is not None and updates_after(stepped, n, self.k):
            out.append(Action(Kind.STEP, stage, stepped))
        return out

    def stage_actions(self, stage: int, n: int) -> list:
        """Every action of `stage` over a segment of n, tick by tick: one list per tick."""
        return [self.actions(stage, t, n) for t in range(self.num_ticks(n))]

    # ---- lowered: the actions with their data and messages, what the engines run
    def lowered(self, stage: int, tick: int, n: int) -> list:
        """The actions of `stage` at `tick` as the engines run them: each computation after the
        reads and receives of its inputs and before the sends of its outputs (torch's pipelining
        lowers its schedules to SEND_F / RECV_F / SEND_B / RECV_B the same way). A send names
        the stage it goes to, a receive the stage it comes from (`peer`); a stream carries its
        messages in order, so the k-th send of a kind from s to p is the k-th such receive on p
        (tests/unit/test_messages.py pairs them)."""
        out = []
        for action in self.actions(stage, tick, n):
            out += self._inputs(action) + [action] + self._outputs(action)
        return out

    def _message(self, kind: Kind, s: int, b: int) -> Action:
        """Stage s's send or receive of `kind` for micro-batch b, with the peer the channel table
        gives it (comm/channels.py)."""
        channel = of_action(kind.value)[0]
        sends = kind.value == channel.send
        return Action(kind, s, b, channel.receiver(s, self.J) if sends
                      else channel.sender(s, self.J))

    def _inputs(self, a: Action) -> list:
        s, b, last = a.stage, a.microbatch, a.stage == self.J - 1
        if a.kind is Kind.BACKWARD:
            return [self._message(Kind.RECV_B, s, b)]
        if a.kind is Kind.STEP:
            return []
        # a forward of some kind: stage 0 reads the data and passes the labels to the last stage
        if s == 0:
            return [Action(Kind.LOAD, s, b)] + ([] if last else [self._message(Kind.SEND_L, s, b)])
        return [self._message(Kind.RECV_F, s, b)] + ([self._message(Kind.RECV_L, s, b)]
                                                     if last else [])

    def _outputs(self, a: Action) -> list:
        s, b, last = a.stage, a.microbatch, a.stage == self.J - 1
        down = [self._message(Kind.SEND_B, s, b)] if s > 0 else []  # stage 0 sends nothing down
        if a.kind is Kind.BACKWARD:
            return down
        if a.kind is Kind.FORWARD_BACKWARD:  # the report after the send: .item() waits there
            return down + [Action(Kind.REPORT, s, b)]
        if a.kind in (Kind.FORWARD, Kind.EVALUATE):
            return [Action(Kind.REPORT, s, b)] if last else [self._message(Kind.SEND_F, s, b)]
        return []

    def receives(self, stage: int, n: int) -> dict:
        """How many messages of each kind `stage` receives in a segment of n, where every stage
        runs every micro-batch once (what the MPI engine's streams post receives for)."""
        last = stage == self.J - 1
        return {Kind.RECV_F: n if stage > 0 else 0,
                Kind.RECV_B: n if self.backward and not last else 0,
                Kind.RECV_L: n if last and self.J > 1 else 0}


class PetraSchedule(TickSchedule):
    """Stage s forwards b = t - s and backwards b = t - 2(J-1) + s at tick t."""
    method = "petra"

    def num_ticks(self, n: int) -> int:
        return n + 2 * (self.J - 1) if n else 0

    def forward_microbatch(self, stage, tick, n):
        return _valid(tick - stage, n)

    def backward_microbatch(self, stage, tick, n):
        return _valid(tick - self.in_flight(stage) - stage, n)

    def entered_before(self, tick: int) -> int:
        return tick

    def in_flight(self, stage: int) -> int:
        return 2 * (self.J - 1 - stage)


class DelayedSchedule(PetraSchedule):
    """PETRA's timing; the stages differ (buffered inputs, stashed weights), not the schedule."""
    method = "delayed"


class BackpropSchedule(TickSchedule):
    """One micro-batch in flight: forward through every stage, then back, one stage busy."""
    method = "backprop"

    def num_ticks(self, n: int) -> int:
        return n * (2 * self.J - 1)

    def forward_microbatch(self, stage, tick, n):
        b, phase = divmod(tick, 2 * self.J - 1)
        return _valid(b, n) if phase == stage else None

    def backward_microbatch(self, stage, tick, n):
        b, phase = divmod(tick, 2 * self.J - 1)
        return _valid(b, n) if phase == 2 * (self.J - 1) - stage else None

    def entered_before(self, tick: int) -> int:
        return -(-tick // (2 * self.J - 1))

    def in_flight(self, stage: int) -> int:
        return 0  # a micro-batch's backward comes before the next micro-batch's forward


class ForwardOnlySchedule(TickSchedule):
    """Evaluation: stage s evaluates micro-batch b at tick b + s (a forward with running
    statistics; no backward, no step), so the stages of one process and the ranks of MPI run
    it with the same driver as training (engines/segment.py)."""
    method = "evaluate"
    backward = False

    def num_ticks(self, n: int) -> int:
        return n + self.J - 1 if n else 0

    def forward_microbatch(self, stage, tick, n):
        return _valid(tick - stage, n)

    def backward_microbatch(self, stage, tick, n):
        return None

    def entered_before(self, tick: int) -> int:
        return tick

    def in_flight(self, stage: int) -> int:
        return 0  # no backward

    def actions(self, stage: int, tick: int, n: int) -> list:
        b = self.forward_microbatch(stage, tick, n)
        return [] if b is None else [Action(Kind.EVALUATE, stage, b)]


# The methods (train.method) and their schedules; the config's choices are these names, in this
# order.
SCHEDULES = {s.method: s for s in (PetraSchedule, BackpropSchedule, DelayedSchedule)}
METHODS = tuple(SCHEDULES)


def schedule_for(method: str, num_stages: int, accumulation: int = 1) -> TickSchedule:
    return SCHEDULES[method](num_stages, accumulation)


def num_ticks(method: str, num_stages: int, n: int) -> int:
    """The tick count of a segment by method name, for callers that need that one number."""
    return schedule_for(method, num_stages).num_ticks(n)


def grid(schedule: TickSchedule, n: int) -> str:
    """Rows = stages (ranks), columns = ticks; a cell lists the tick's actions in order."""
    cells = [[" ".join(a.label for a in acts) or "." for acts in schedule.stage_actions(s, n)]
             for s in range(schedule.J)]
    width = max(len(c) for row in cells for c in row)
    ticks = len(cells[0])
    lines = [f"{schedule.method}: {schedule.J} stages, {n} micro-batches, "
             f"accumulation {schedule.k}, {ticks} ticks",
             "legend: Fb forward of micro-batch b, Bb backward, FBb the last stage's forward, "
             "loss and backward, S optimizer step, . idle; within a tick, left to right",
             "tick    | " + " | ".join(str(t).rjust(width) for t in range(ticks))]
    for s, row in enumerate(cells):  # " | " between ticks: a tick's actions stay together
        lines.append(f"rank {s:<3}| " + " | ".join(c.rjust(width) for c in row))
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m petra_mpi.schedule",
                                description="Print each rank's actions tick by tick.")
    p.add_argument("--method", choices=METHODS, default="petra")
    p.add_argument("--stages", type=int, default=4)
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--accumulation", type=int, default=1)
    a = p.parse_args(argv)
    if a.stages < 1 or a.microbatches < 1 or a.accumulation < 1:
        p.error("--stages, --microbatches and --accumulation must be at least 1")
    print(grid(schedule_for(a.method, a.stages, a.accumulation), a.microbatches))


if __name__ == "__main__":
    main()
