"""Where a contender's time goes (bench peers' waterfall): from the performance model's ideal
to the measured wall time of its timed runs, on the rank that computes most.

Per rank the benchmark counts, over the timed runs, the wall time W, the time in the stage's own
compute C (forward, backward, optimizer step; for torch's schedules the stage's forward and
backward chunks and the optimizer step) and the time blocked on messages (MPI waits; gloo's
waits inside the schedule). The model (perf/model.py) runs the same operations at the per-block
costs measured in isolation at start-up, over a free link and without framework costs: its
makespan T is the ideal, and on each rank it splits into that rank's ideal compute C* and its
ideal idle time I* (fill and drain, the bubble, waiting on a slower stage). Then, exactly,

    W = T + (C - C*) + (wait - I*) + (W - C - wait)

- compute above its isolated cost (C - C*): the same blocks slower inside the run (cold
  caches, the allocator returning and faulting back memory, threads), or faster (negative);
- waiting beyond the model (wait - I*): messages slower than free, a slower neighbour, jitter;
- framework (W - C - wait): the trainer's own time outside compute and waits (the schedule's
  bookkeeping, posting and polling messages, Python).
"""
import time
from dataclasses import replace

from .. import model as perfmodel
from .common import save_figure

FREE_LINK = perfmodel.Link(0.0, float("inf"))
STEPS = ("model", "compute above isolated", "waiting beyond model", "framework")


class ScheduleClock:
    """Compute and wait seconds of torch.distributed.pipelining contenders on this rank: wraps
    each PipelineStage's chunk methods and the optimizer's step, and the schedules' wait on
    batched point-to-point work (module-level, so once for all)."""

    def __init__(self):
        self.compute = self.wait = 0.0
        from torch.distributed.pipelining import schedules
        original = schedules._wait_batch_p2p

        def timed_wait(work):
            start = time.perf_counter()
            try:
                return original(work)
            finally:
                self.wait += time.perf_counter() - start
        schedules._wait_batch_p2p = timed_wait

    def watch(self, stage, optimizer):
        for name in ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk"):
            if hasattr(stage, name):
                setattr(stage, name, self._timed(getattr(stage, name)))
        optimizer.step = self._timed(optimizer.step)

    def _timed(self, fn):
        def timed(*args, **kw):
            start = time.perf_counter()
            try:
                return fn(*args, **kw)
            finally:
                self.compute += time.perf_counter() - start
        return timed


def kept_stage_costs(block_costs, sizes, kept, windows):
    """The model's StageCosts of PETRA with a kept plan (kept[s][i] of every windows[s]
    micro-batches keep block i's graph): what the kept-blocks planner counts a stage's kept
    micro-batches to save (memory_plan.stage_units, at the measured kept times) comes off its
    backward, on average."""
    from ...core.memory_plan import measured_units, stage_units
    costs, units, i = perfmodel.stage_costs(block_costs, sizes), measured_units(block_costs), 0
    for s, n in enumerate(sizes):
        if kept and windows[s]:
            mine = units[i:i + n]
            saved = stage_units(mine, [0] * n, windows[s]) - stage_units(mine, kept[s], windows[s])
            costs[s] = replace(costs[s], backward=costs[s].backward - saved)
        i += n
    return costs


def model_run(orders, costs):
    """(makespan, each rank's busy seconds) of `orders` at `costs` over a free link."""
    fields = {perfmodel.FORWARD: "forward", perfmodel.BACKWARD: "backward",
              perfmodel.FORWARD_BACKWARD: "forward_backward", perfmodel.STEP: "step"}
    busy = [sum(getattr(costs[s], fields[op]) for op, _ in order)
            for s, order in enumerate(orders)]
    return perfmodel.simulate(orders, costs, FREE_LINK), busy


def waterfall(runs, microbatches, makespan, busy, measured) -> dict:
    """The waterfall of one contender over `runs` timed runs of `microbatches` each: `makespan`
    and `busy` (per rank) of one run in the model, `measured` per rank (wall, compute, wait)
    summed over the runs. Seconds per run, on the rank that computes most."""
    r = max(range(len(measured)), key=lambda s: measured[s][1])
    wall, compute, wait = (v / runs for v in measured[r])
    idle = makespan - busy[r]
    steps = [makespan, compute - busy[r], wait - idle, wall - compute - wait]
    return {"rank": r, "microbatches": microbatches, "wall_s": wall, "model_s": makespan,
            "steps_s": dict(zip(STEPS, steps)),
            "per_rank": [{"wall_s": w / runs, "compute_s": c / runs, "wait_s": x / runs,
                          "model_busy_s": b} for (w, c, x), b in zip(measured, busy)]}


def ours_model(method, block_costs, sizes, kept, n, k):
    """(makespan, busy per rank) in the model of one segment of n micro-batches of our engine
    (method petra or backprop) on `sizes`, with the kept plan `kept` (None: none)."""
    from ...core.schedule import schedule_for
    J = len(sizes)
    schedule = schedule_for(method, J)
    costs = kept_stage_costs(block_costs, sizes, kept, [schedule.in_flight(s) for s in range(J)])
    return model_run(perfmodel.petra_orders(method, J, n, k), costs)


def pipeline_model(schedule, autograd_costs, sizes, m, steps):
    """(makespan, busy per rank) in the model of `steps` steps of m micro-batches of a pipelining
    schedule (gpipe, 1f1b, 1f1b_checkpointed: its backward also recomputes the forward);
    None for a schedule the model does not run."""
    costs = perfmodel.stage_costs(autograd_costs, sizes)
    if schedule == "1f1b_checkpointed":
        costs = [replace(c, backward=c.backward + c.forward) for c in costs]
    if schedule.startswith("1f1b"):
        orders = perfmodel.one_f_one_b_order(len(sizes), m)
    elif schedule == "gpipe":
        orders = perfmodel.gpipe_order(len(sizes), m)
    else:
        return None
    makespan, busy = model_run(orders, costs)
    return steps * makespan, [steps * b for b in busy]


def draw(record: dict, path: str, names=None) -> str:
    """The waterfalls of a `bench peers` record as one figure, a panel per contender (`names`,
    default every one on PETRA's own net but backprop, ours first): ms per micro-batch, the
    model's ideal, each step added, and the measured total."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    falls = record["waterfall"]
    if names is None:
        same = [n for n in falls if record["net"][n] == record["model"] and n != "backprop"]
        names = sorted(same, key=lambda n: not n.startswith("petra"))
    names = [n for n in names if n in falls]
    cols = min(5, len(names))
    rows = -(-len(names) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(2.6 * cols, 3.4 * rows), sharey=True,
                             squeeze=False)
    colours = ["tab:blue", "tab:orange", "tab:red", "tab:purple", "tab:green"]
    for ax, name in zip(axes.flat, names):
        w = falls[name]
        ms = 1e3 / w["microbatches"]
        bottom, steps = 0.0, [w["model_s"] * ms] + [w["steps_s"][s] * ms for s in STEPS[1:]]
        for i, step in enumerate(steps):
            start = bottom if i else 0.0
            ax.bar(i, step, bottom=start, color=colours[i])
            bottom = start + step
        ax.bar(len(steps), w["wall_s"] * ms, color=colours[-1])
        ax.set_xticks(range(len(steps) + 1), ["model", "+compute", "+waiting", "+framework",
                                              "measured"], rotation=60, fontsize=7)
        ax.set_title(name, fontsize=8)
    for ax in list(axes.flat)[len(names):]:
        ax.set_visible(False)
    for row in axes:
        row[0].set_ylabel("ms per micro-batch")
    fig.suptitle(f"{record['model']}, {record['ranks']} ranks: the model at isolated block costs, "
                 "then what the run adds (rank that computes most)", fontsize=9)
    return save_figure(fig, path)
