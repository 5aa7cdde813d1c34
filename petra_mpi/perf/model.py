"""A performance model of pipelined training: per-stage costs and a point-to-point link in, the
time of a run out, by simulating each rank's ordered operations.

Every rank runs its operations in a fixed order (PETRA's and backprop's are the schedule's
actions, 1F1B's from one_f_one_b_order); an operation starts when its rank is free and
the message it needs has arrived, and runs for its measured cost. A message arrives
latency + bytes / bandwidth after the operation that produced it ends; sends do not hold the
sender (the transport is non-blocking and polled while the stage computes). A framework may add
its own costs (Framework): seconds each operation holds its rank beyond its compute, seconds per
message, and seconds per optimizer step. This is the whole model: no contention between ranks,
no jitter.
"""
import itertools
from dataclasses import dataclass, replace

import numpy as np

from ..core.schedule import Kind, schedule_for

FORWARD, BACKWARD, FORWARD_BACKWARD, STEP = (k.value for k in (
    Kind.FORWARD, Kind.BACKWARD, Kind.FORWARD_BACKWARD, Kind.STEP))


@dataclass
class Link:
    latency: float    # seconds
    bandwidth: float  # bytes per second

    def seconds(self, nbytes: float) -> float:
        return self.latency + nbytes / self.bandwidth


@dataclass
class StageCosts:
    """Seconds per micro-batch of one stage, and the bytes it sends."""
    forward: float        # forward without graph (PETRA, backprop) or with graph (1F1B)
    backward: float       # rebuild or recompute + VJP (PETRA), or the autograd backward (1F1B)
    forward_backward: float  # the last stage's forward, loss and backward at once
    step: float           # one optimizer step of the stage's parameters
    out_bytes: int        # its output activation
    down_bytes: int       # what its backward sends down (δ, plus x̃ where the receiver rebuilds)
    weight: float = 0.0   # the part of backward that computes the weight gradients (zero
    #                       bubble runs it as a separate operation, backward_weight)


@dataclass
class Framework:
    """What the training framework itself costs, beside the compute and the link, fitted from
    runs whose compute costs nothing (fit_framework):
    - per_op: seconds every operation but the step holds its rank beyond its compute (the
      schedule's bookkeeping, posting and completing the operation's messages, the autograd
      calls around the compute): on the rank's critical path, like the compute;
    - per_message: seconds added to a message's way from the operation that sends it to the one
      that needs it (what overlaps the ranks' compute: matching, the receiver's polling);
    - per_step: seconds every optimizer step adds (a schedule's setup and teardown of a step)."""
    per_message: float = 0.0
    per_step: float = 0.0
    per_op: float = 0.0

    def to_record(self) -> dict:
        return {"per_message_s": self.per_message, "per_step_s": self.per_step,
                "per_op_s": self.per_op}

    @classmethod
    def from_record(cls, record) -> "Framework":
        """From to_record's dict (a record without per_op_s, from before it was fitted: 0)."""
        return cls(record["per_message_s"], record["per_step_s"], record.get("per_op_s", 0.0))


NO_FRAMEWORK = Framework()


def simulate(orders, costs, link: Link, framework: Framework = NO_FRAMEWORK,
             busy_links=False) -> float:
    """Makespan of ranks running `orders[s]`: lists of (op, b) with op in forward, backward,
    forward_backward, step (schedule.Kind's names), backward_input, backward_weight; forward b
    on stage s needs forward b of s-1, backward (or backward_input) b needs the backward,
    forward_backward or backward_input b of s+1; the last stage's backward b (1F1B, zero bubble)
    needs its own forward b; backward_weight b needs its own backward_input b.
    busy_links: a link carries one message at a time in each direction (a message leaves when
    its operation ends and the wire is free, holds it bytes / bandwidth and arrives latency
    later), so a pipeline whose messages outlast its compute runs at the link's pace; without
    it every message takes latency + bytes / bandwidth however many are under way."""
    J = len(orders)
    done = {}     # (stage, op, b) -> end time
    arrivals = {} if busy_links else None  # (stage, op, b) -> when its message arrives
    wires = {}    # (from, to) -> when the wire is free
    free = [0.0] * J
    position = [0] * J
    remaining = sum(len(o) for o in orders)
    while remaining:
        progressed = False
        for s in range(J):
            while position[s] < len(orders[s]):
                op, b = orders[s][position[s]]
                ready = _ready_time(s, op, b, J, done, costs, link, framework.per_message,
                                    arrivals)
                if ready is None:
                    break
                start = max(free[s], ready)
                c = costs[s]
                cost = {FORWARD: c.forward, BACKWARD: c.backward,
                        FORWARD_BACKWARD: c.forward_backward, STEP: c.step + framework.per_step,
                        "backward_input": c.backward - c.weight, "backward_weight": c.weight}[op]
                cost += framework.per_op if op != STEP else 0.0
                free[s] = done[(s, op, b)] = start + cost
                if busy_links:
                    _put_on_wire(s, op, b, J, done, costs, link, wires, arrivals)
                position[s] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            raise ValueError("the operation orders deadlock")
    return max(free)


def _put_on_wire(s, op, b, J, done, costs, link, wires, arrivals):
    """The arrival of the message (s, op, b) sends, if it sends one, on a busy link. Each
    direction of a link has one sender, whose operations end in order: its wire carries its
    messages in that order."""
    if op == FORWARD and s < J - 1:
        to, nbytes = s + 1, costs[s].out_bytes
    elif op in (BACKWARD, FORWARD_BACKWARD, "backward_input") and s > 0:
        to, nbytes = s - 1, costs[s].down_bytes
    else:
        return
    leaves = max(done[(s, op, b)], wires.get((s, to), 0.0))
    wires[(s, to)] = leaves + nbytes / link.bandwidth
    arrivals[(s, op, b)] = wires[(s, to)] + link.latency


def _ready_time(s, op, b, J, done, costs, link, extra=0.0, arrivals=None):
    """When the input of (s, op, b) is there, or None if its producer has not run yet; a message
    takes `extra` seconds of the framework's own beside the link's (`arrivals`: busy links'
    arrival times, simulate's busy_links)."""
    def arrival(key, nbytes):
        end = done.get(key)
        if end is None:
            return None
        return (arrivals[key] if arrivals is not None else end + link.seconds(nbytes)) + extra

    if op == STEP:
        return 0.0
    if op in (FORWARD, FORWARD_BACKWARD) and s > 0:
        return arrival((s - 1, FORWARD, b), costs[s - 1].out_bytes)
    if op in (BACKWARD, "backward_input"):
        if s == J - 1:  # 1F1B's and zero bubble's last stage: its own forward
            return done.get((s, FORWARD, b))
        sender = next(((s + 1, o, b) for o in (BACKWARD, FORWARD_BACKWARD, "backward_input")
                       if (s + 1, o, b) in done), None)
        return None if sender is None else arrival(sender, costs[s + 1].down_bytes)
    if op == "backward_weight":
        return done.get((s, "backward_input", b))
    return 0.0


def petra_orders(method, J, n, k=1):
    """Each stage's operations for a segment of n micro-batches: the schedule's actions."""
    schedule = schedule_for(method, J, k)
    return [[(a.kind.value, a.microbatch) for tick in schedule.stage_actions(s, n) for a in tick]
            for s in range(J)]


def one_f_one_b_order(J, m):
    """1F1B (PipeDream-flush) for one step of m micro-batches: stage s runs min(J-1-s, m)
    forwards, then alternates forward and backward, then the remaining backwards, then steps."""
    orders = []
    for s in range(J):
        warmup = min(J - 1 - s, m)
        order = [(FORWARD, b) for b in range(warmup)]
        f, bwd = warmup, 0
        while bwd < m:
            if f < m:
                order.append((FORWARD, f))
                f += 1
            order.append((BACKWARD, bwd))
            bwd += 1
        order.append((STEP, m))
        orders.append(order)
    return orders


def gpipe_order(J, m):
    return [[(FORWARD, b) for b in range(m)] + [(BACKWARD, b) for b in range(m)] +
            [(STEP, m)] for _ in range(J)]


def zero_bubble_order(J, m):
    """Zero bubble (ZB-H1, torch's ScheduleInterleavedZeroBubble with one stage per rank) for
    one step of m micro-batches: 1F1B's order with each backward split into its input part,
    sent down at once, and its weight part, which stage s runs s micro-batches late (after the
    input part of micro-batch b + s), the rest at the end, where 1F1B's drain idles."""
    orders = []
    for s in range(J):
        warmup = min(J - 1 - s, m)
        order = [(FORWARD, b) for b in range(warmup)]
        weights = 0
        for b in range(m):
            if warmup + b < m:
                order.append((FORWARD, warmup + b))
            order.append(("backward_input", b))
            if b >= s:
                order.append(("backward_weight", weights))
                weights += 1
        order += [("backward_weight", b) for b in range(weights, m)] + [(STEP, m)]
        orders.append(order)
    return orders


def peak_in_flight(order, release=BACKWARD) -> int:
    """The most micro-batches of one rank's `order` between their forward and their `release`
    operation: what its activations are held for (1F1B: until the backward; zero bubble:
    until backward_weight, which still needs them)."""
    held = peak = 0
    for op, _ in order:
        if op == FORWARD:
            held += 1
            peak = max(peak, held)
        elif op == release:
            held -= 1
    return peak


def ring_allreduce_seconds(nbytes, members, link: Link) -> float:
    """A ring all-reduce of nbytes among `members` ranks over `link`: a reduce-scatter and an
    all-gather of members - 1 rounds each, every round moving nbytes / members over every
    link at once: 2 (members - 1) / members x nbytes / bandwidth + 2 (members - 1) latencies."""
    if members <= 1:
        return 0.0
    return 2 * (members - 1) * (link.latency + nbytes / members / link.bandwidth)


def predict_images_per_s(method, costs, link, n, batch, k=1, framework=NO_FRAMEWORK,
                         busy_links=False):
    """images/s of a segment of n micro-batches (fill and drain included) for petra, backprop,
    delayed; or of steps of n micro-batches for 1f1b and gpipe (busy_links as simulate's)."""
    J = len(costs)
    orders = (one_f_one_b_order(J, n) if method == "1f1b" else gpipe_order(J, n)
              if method == "gpipe" else petra_orders(method, J, n, k))
    return n * batch / simulate(orders, costs, link, framework, busy_links)


FRAMEWORK_COSTS = ("per_message", "per_step", "per_op")


def fit_framework(orders_list, costs_list, links, measured_seconds, rounds=6,
                  names=FRAMEWORK_COSTS) -> Framework:
    """The Framework that best explains measured makespans of runs whose compute costs nothing
    (least squares of the relative errors, every cost at least 0), fitting the costs `names`
    (the others stay 0). A makespan is piecewise linear in the costs (the longest path counts so
    many operations, messages and steps), so the fit is linearised at its current estimate and
    solved again until the critical paths stop changing."""
    fw, h = Framework(**{n: 1e-3 for n in names}), 1e-7
    for _ in range(rounds):
        here = [getattr(fw, n) for n in names]
        moved = [replace(fw, **{n: getattr(fw, n) + h}) for n in names]  # one cost nudged each
        rows, rhs = [], []
        for orders, costs, link, seconds in zip(orders_list, costs_list, links, measured_seconds):
            at = simulate(orders, costs, link, fw)
            slopes = [(simulate(orders, costs, link, m) - at) / h for m in moved]
            # each run's error relative to its length, so that short runs count as much
            rows.append([d / seconds for d in slopes])
            rhs.append((seconds - at + sum(d * v for d, v in zip(slopes, here))) / seconds)
        fw = Framework(**dict(zip(names, _nonnegative_least_squares(rows, rhs))))
    return fw


def _nonnegative_least_squares(rows, rhs):
    """x >= 0 minimising |rows · x - rhs|: the best unconstrained solution over every subset of
    the unknowns (the others at 0) that has no negative entry (2^n subsets: n is at most 3)."""
    a, y = np.asarray(rows, dtype=float), np.asarray(rhs, dtype=float)
    best, best_err = np.zeros(a.shape[1]), float(np.sum(y ** 2))
    for free in itertools.product((False, True), repeat=a.shape[1]):
        cols = [i for i, f in enumerate(free) if f]
        if not cols:
            continue
        solution = np.linalg.lstsq(a[:, cols], y, rcond=None)[0]
        if (solution < 0).any():
            continue
        x = np.zeros(a.shape[1])
        x[cols] = solution
        err = float(np.sum((a @ x - y) ** 2))
        if err < best_err:
            best, best_err = x, err
    return [float(v) for v in best]


def stage_costs(block_costs, sizes, rebuilt_down=None, weight=None):
    """StageCosts of a split from blockcost.BlockCosts (PETRA's and backprop's operations).
    rebuilt_down[s]: whether stage s sends x̃ with δ (its predecessor rebuilds); default: every
    stage but the first. weight[b]: the weight-gradient part of block b's backward."""
    out, i = [], 0
    for s, n in enumerate(sizes):
        blocks = range(i, i + n)
        in_bytes = block_costs.output_bytes[i - 1] if i > 0 else 0
        sends_rebuilt = rebuilt_down[s] if rebuilt_down is not None else s > 0
        out.append(StageCosts(
            forward=sum(block_costs.forward[b] for b in blocks),
            backward=sum(block_costs.backward[b] for b in blocks),
            forward_backward=sum(block_costs.last[b] for b in blocks),
            step=sum(block_costs.step[b] for b in blocks),
            out_bytes=block_costs.output_bytes[i + n - 1],
            down_bytes=in_bytes * (2 if sends_rebuilt else 1) if s > 0 else 0,
            weight=sum(weight[b] for b in blocks) if weight is not None else 0.0))
        i += n
    return out


def speedup_bound(block_costs, sizes, n, k=1, link=None) -> dict:
    """What a split allows PETRA over backprop, from measured per-block costs (a
    blockcost.BlockCosts): `steady`, the sum of the stages' work over the slowest stage's (an
    endless segment), and `segment`, the model's ratio for segments of n micro-batches (fill
    and drain included, steps every k) over `link` (default: free)."""
    link = link or Link(0.0, float("inf"))
    work = block_costs.stage_seconds(sizes)
    costs = stage_costs(block_costs, sizes)
    petra = simulate(petra_orders("petra", len(sizes), n, k), costs, link)
    backprop = simulate(petra_orders("backprop", len(sizes), n, k), costs, link)
    return {"steady": sum(work) / max(work), "segment": backprop / petra}
