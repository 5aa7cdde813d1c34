"""A performance model of pipelined training: per-stage costs and a point-to-point link in, the
time of a run out, by simulating each rank's ordered operations.

Every rank runs its operations in a fixed order (PETRA's and backprop's are the schedule's
actions, 1F1B's from one_f_one_b_order); an operation starts when its rank is free and
the message it needs has arrived, and runs for its measured cost. A message arrives
latency + bytes / bandwidth after the operation that produced it ends; sends do not hold the
sender (the transport is non-blocking and polled while the stage computes). This is the whole
model: no contention between ranks, no jitter.
"""
from dataclasses import dataclass

from .schedule import Kind, schedule_for

FORWARD, BACKWARD, FORWARD_BACKWARD, STEP = (k.value for k in Kind)


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


def simulate(orders, costs, link: Link) -> float:
    """Makespan of ranks running `orders[s]`: lists of (op, b) with op in forward, backward,
    forward_backward, step (schedule.Kind's names); forward b on stage s needs forward b of s-1, backward b needs the backward (or
    forward_backward) b of s+1; the last stage's backward b (1F1B) needs its own forward b."""
    J = len(orders)
    done = {}     # (stage, op, b) -> end time
    free = [0.0] * J
    position = [0] * J
    remaining = sum(len(o) for o in orders)
    while remaining:
        progressed = False
        for s in range(J):
            while position[s] < len(orders[s]):
                op, b = orders[s][position[s]]
                ready = _ready_time(s, op, b, J, done, costs, link)
                if ready is None:
                    break
                start = max(free[s], ready)
                cost = getattr(costs[s], op)
                free[s] = done[(s, op, b)] = start + cost
                position[s] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            raise ValueError("the operation orders deadlock")
    return max(free)


def _ready_time(s, op, b, J, done, costs, link):
    """When the input of (s, op, b) is there, or None if its producer has not run yet."""
    if op == STEP:
        return 0.0
    if op in (FORWARD, FORWARD_BACKWARD) and s > 0:
        end = done.get((s - 1, FORWARD, b))
        return None if end is None else end + link.seconds(costs[s - 1].out_bytes)
    if op == BACKWARD:
        if s == J - 1:  # 1F1B's last stage: its own forward
            return done.get((s, FORWARD, b))
        end = done.get((s + 1, BACKWARD, b), done.get((s + 1, FORWARD_BACKWARD, b)))
        return None if end is None else end + link.seconds(costs[s + 1].down_bytes)
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


def predict_images_per_s(method, costs, link, n, batch, k=1):
    """images/s of a segment of n micro-batches (fill and drain included) for petra, backprop,
    delayed; or of steps of n micro-batches for 1f1b and gpipe."""
    J = len(costs)
    if method == "1f1b":
        orders = one_f_one_b_order(J, n)
    elif method == "gpipe":
        orders = gpipe_order(J, n)
    else:
        orders = petra_orders(method, J, n, k)
    return n * batch / simulate(orders, costs, link)


def stage_costs(block_costs, sizes, rebuilt_down=None):
    """StageCosts of a split from blockcost.BlockCosts (PETRA's and backprop's operations).
    rebuilt_down[s]: whether stage s sends x̃ with δ (its predecessor rebuilds); default: every
    stage but the first."""
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
            down_bytes=in_bytes * (2 if sends_rebuilt else 1) if s > 0 else 0))
        i += n
    return out
