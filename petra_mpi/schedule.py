"""The PETRA schedule as pure tick arithmetic (docs/design.md §1).

Micro-batch b enters stage 0 at tick b. With J stages:
- petra / delayed: stage s forwards b = t - s and backwards b = t - 2(J-1) + s at tick t, so the
  forward and backward of one micro-batch on stage s are delay(J, s) = 2(J-1-s) ticks apart; the
  last stage does both at once.
- backprop: one micro-batch in flight at a time; b occupies ticks b(2J-1) ... b(2J-1) + 2(J-1),
  going forward through every stage and back again.
A segment of n micro-batches starts with an empty pipeline (fill) and ends with every backward done
(drain); stages take an optimizer step after every k backwards and after their last one.
"""

METHODS = ("petra", "backprop", "delayed")


def delay(num_stages: int, stage: int) -> int:
    return 2 * (num_stages - 1 - stage)


def num_ticks(method: str, num_stages: int, n: int) -> int:
    if n == 0:
        return 0
    if method == "backprop":
        return n * (2 * num_stages - 1)
    return n + 2 * (num_stages - 1)


def _valid(b: int, n: int):
    return b if 0 <= b < n else None


def forward_microbatch(method: str, num_stages: int, stage: int, tick: int, n: int):
    """The micro-batch stage `stage` forwards at `tick`, or None (for the last stage this is
    also its backward)."""
    if method == "backprop":
        b, phase = divmod(tick, 2 * num_stages - 1)
        return _valid(b, n) if phase == stage else None
    return _valid(tick - stage, n)


def backward_microbatch(method: str, num_stages: int, stage: int, tick: int, n: int):
    """The micro-batch stage `stage` backwards at `tick`, or None."""
    if method == "backprop":
        b, phase = divmod(tick, 2 * num_stages - 1)
        return _valid(b, n) if phase == 2 * (num_stages - 1) - stage else None
    return _valid(tick - delay(num_stages, stage) - stage, n)


def entered_before(method: str, num_stages: int, tick: int) -> int:
    """How many micro-batches entered stage 0 before `tick`."""
    if method == "backprop":
        return -(-tick // (2 * num_stages - 1))
    return tick


def stop_count(method: str, num_stages: int, tick: int, n: int, margin: int = 0) -> int:
    """The segment length when a stop is applied at `tick`: what has entered plus `margin`
    (the MPI engine covers the receives a rank may already have posted), at most n. The local
    engine applies a stop at once, the MPI engine one vote later, so a run stopped mid-segment
    is not comparable between the two engines."""
    return min(n, entered_before(method, num_stages, tick) + margin)


def tick_ops(method: str, num_stages: int, stage: int, tick: int, n: int):
    """The operations of `stage` at `tick`, in order: ("forward", b) then ("backward", b); the
    last stage has ("forward_backward", b). This order is all an MPI rank needs: its
    neighbours' messages provide the synchronisation."""
    last = stage == num_stages - 1
    ops = []
    b = forward_microbatch(method, num_stages, stage, tick, n)
    if b is not None:
        ops.append(("forward_backward" if last else "forward", b))
    if not last:
        b = backward_microbatch(method, num_stages, stage, tick, n)
        if b is not None:
            ops.append(("backward", b))
    return ops


def updates_after(b: int, n: int, k: int) -> bool:
    """Whether a stage steps its optimizer after the backward of micro-batch b (0-based) of a
    segment of n: every k backwards, and at the drain so no gradient is left behind."""
    return (b + 1) % k == 0 or b == n - 1
