"""Under `mpirun -n J`: PETRA against other pipeline-parallel trainers on the same ranks, alternated
in one run (round-robin over the contenders, medians of the rounds).

- petra, backprop: our MPI engine on RevNet18 (as `bench pipeline`), or with `--model revlm` on
  the reversible causal language model (configs/lm/shakespeare_cpu.yaml's size by default); its
  messages over MPI, or with `--transport torch` over gloo (comm.transport), as torch's are.
- gpipe, 1f1b, zero_bubble: torch.distributed.pipelining's ScheduleGPipe, Schedule1F1B and
  ScheduleInterleavedZeroBubble (one stage per rank) on the plain twin of the same width
  (ResNet18, or the plain transformer `lm`), split by its own measured block costs, over gloo.
- 1f1b_checkpointed: Schedule1F1B with torch.utils.checkpoint around every block.
- gpipe_rev, 1f1b_rev, 1f1b_checkpointed_rev, zero_bubble_rev: the same schedules on PETRA's own
  net (RevNet18 or revlm) run with autograd, activations stored (what a user of torch's
  pipelining would run on this net), split by its measured autograd block costs. The record's
  "net" says which net each contender trains; "flops_per_microbatch" gives each net's forward
  and backward FLOPs (torch's flop counter) and PETRA's own, rebuild included.
- petra_budget_1f1b, petra_unlimited: PETRA with kept blocks (model.memory_budget,
  memory_plan.py) at a budget per rank of 1F1B's peak activation bytes there (on the same net
  when it ran; less PETRA's own), and without a limit; each on the split training would choose
  for its budget (the measured balance redone with the plan's costs) unless --partition fixes it.
- petra_rebuild_last: PETRA whose last stage rebuilds instead of holding its graph
  (model.rebuild_last_stage), on the split balanced for it; petra_budget_1f1b_checkpointed: the
  same with kept blocks at checkpointed 1F1B's peak per rank less its own.

Every contender updates its weights once per K x micro-batch images (K = --accumulation, 4 by
default: the paper's CIFAR-10 recipe, micro-batch 64 and k = 4): PETRA and backprop accumulate K
micro-batches, a torch.distributed.pipelining step runs K micro-batches (at least J, which 1F1B
needs; --pt-microbatches overrides). Each update is SGD (momentum 0.9, Nesterov). Images/s
come from timed passes; activation memory from one separate untimed pass per contender (docs/peers.md
says how it is counted).

A pipelining step drains the pipeline at every update, so its timed steps are its steady state.
Ours drain only at the end of a segment (training: once per epoch), so a timed segment of
--microbatches holds one fill and one drain; "steady_images_per_s" gives our rate without them,
from the start times of stage 0's forwards in the middle of the segment (a whole number of
updates, from the first tick that also runs a backward on). On one node every rank's clock is
the same (CLOCK_MONOTONIC). "waterfall" says where each contender's time went (waterfall.py)."""
import argparse
import statistics
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ...engines.build import StageSpec, build_engine, build_stages, build_workers
from ...core.worker import WorkerHooks
from ...comm.world import World
from ...models import NetSpec, build_blocks
from ...core.optim import constant_lr
from ...core.planner import Layout, plan_layout
from ...core.schedule import Kind, PetraSchedule
from .common import emit, last_json_line, random_batch
from .meter import ActivationMeter
from .pipelining import LR, MOMENTUM, pipelining_contenders
from .waterfall import STEPS, ScheduleClock, draw, ours_model, pipeline_model, waterfall

SAME_NET = "_rev"  # suffix of the pipelining contenders on PETRA's own net
REBUILDS = "petra_rebuild_last"  # PETRA whose last stage rebuilds (model.rebuild_last_stage)
# kept variants at a pipeline's peak memory per rank: name -> (that pipeline, the variant of ours
# whose own peak the budget adds to)
BUDGETS = {"petra_budget_1f1b": ("1f1b", "petra"),
           "petra_budget_1f1b_checkpointed": ("1f1b_checkpointed", REBUILDS)}
REBUILDING = {REBUILDS, "petra_budget_1f1b_checkpointed"}


class SampleAfterForward(WorkerHooks):
    """Samples `meter` (when set) after each forward: the FIFO is at its fullest then."""
    meter = None

    def after(self, worker, action, x=None):
        if self.meter is not None and action.kind is Kind.FORWARD:
            self.meter.sample()


class ForwardClock(WorkerHooks):
    """When `starts` is a dict: the clock at the start of each forward, by micro-batch (a timed
    segment's steady state is read from stage 0's)."""
    starts = None

    def before(self, worker, action, x=None, labels=None):
        if self.starts is not None and action.kind is Kind.FORWARD:
            self.starts[action.microbatch] = time.perf_counter()


def steady_images_per_s(starts, num_stages, k, batch):
    """Images/s of a segment in its steady state, from stage 0's forward start times: between
    the forward of micro-batch d_0 (the first tick that also runs a backward there) and the one a
    whole number of updates (k micro-batches each) later, as late as the segment allows; None
    when the segment is too short for one update of steady state."""
    first = PetraSchedule(num_stages).in_flight(0)
    updates = (max(starts, default=-1) - first) // k
    if updates < 1:
        return None
    last = first + updates * k
    return (last - first) * batch / (starts[last] - starts[first])


@dataclass
class Workload:
    """What every contender trains: PETRA's reversible net (`arch`) or the pipelines' plain twin
    (`plain`), and random batches of the net's kind: 32x32 images and a label each, or windows of
    `context` token ids and a label per token."""
    arch: str
    plain: str
    width: int
    num_classes: int
    model_kw: dict
    context: int = 0  # a language model's window; 0: images

    @classmethod
    def from_args(cls, a):
        if a.model == "revlm":
            kw = {"depth": a.depth, "heads": a.heads, "context": a.context}
            return cls("revlm", "lm", a.width or 128, 256, kw, a.context)
        return cls("revnet18", "resnet18", a.width or 32, 10, {})

    @property
    def input_shape(self) -> tuple:
        return (self.context,) if self.context else (3, 32, 32)

    @property
    def labels_per_sample(self) -> int:
        return self.context or 1

    def blocks(self, arch):
        return build_blocks(arch, self.width, self.num_classes, **self.model_kw)

    def net(self, arch) -> NetSpec:
        return NetSpec(arch, self.width, self.num_classes, model_kw=self.model_kw)

    def stages(self, split, only=None):
        """The stages of PETRA's reversible net split as `split` (just stage `only`)."""
        return build_stages(StageSpec(self.net(self.arch)), Layout(split), only=only)

    def zeros(self, n):
        return (torch.zeros(n, self.context, dtype=torch.long) if self.context
                else torch.zeros(n, *self.input_shape))

    def batch(self, n, g):
        """(inputs, labels) of n random samples."""
        return random_batch(n, self.num_classes, g, self.context)


# ---------------------------------------------------------------------------------------------

def main(argv):
    a = parse_args(argv)
    if a.plot:  # a saved run's output: its figure only
        print(draw(last_json_line(a.plot), a.waterfall or "runs/bench/waterfall.png"))
        return
    record = run(a)
    if record is not None and a.waterfall:  # before the table: the JSON line stays the last
        print(f"waterfall: {draw(record, a.waterfall)}")
    report(a, record)


def parse_args(argv):
    p = argparse.ArgumentParser(prog="mpirun -n J python -m petra_mpi.bench peers",
                                description=__doc__)
    p.add_argument("--model", choices=("revnet18", "revlm"), default="revnet18",
                   help="revnet18 (plain twin ResNet18) or revlm (plain twin lm), random data")
    p.add_argument("--width", type=int, default=0, help="0: 32 (revnet18), 128 (revlm)")
    p.add_argument("--depth", type=int, default=4, help="revlm: decoder blocks")
    p.add_argument("--heads", type=int, default=4, help="revlm: attention heads")
    p.add_argument("--context", type=int, default=64, help="revlm: tokens per window")
    p.add_argument("--batch", type=int, default=64, help="micro-batch size (every contender)")
    p.add_argument("--microbatches", type=int, default=24,
                   help="PETRA/backprop micro-batches per timed segment (fill and drain included)")
    p.add_argument("--accumulation", type=int, default=4, metavar="K",
                   help="micro-batches per weight update of every contender (PETRA's k)")
    p.add_argument("--pt-microbatches", type=int, default=0,
                   help="micro-batches per torch.distributed.pipelining step (0: K, or J if more;"
                        " 1F1B needs at least J)")
    p.add_argument("--rounds", type=int, default=3, help="alternated rounds of each contender")
    p.add_argument("--transport", choices=("mpi", "torch"), default="mpi",
                   help="what carries PETRA's messages (comm.transport): mpi, or torch "
                        "(gloo, as torch's schedules always are)")
    p.add_argument("--threads", type=int, default=0, help="torch threads per rank (0: share)")
    p.add_argument("--no-zero-bubble", action="store_true", help="skip the zero-bubble schedule")
    p.add_argument("--partition", type=_split_arg, metavar="A,B,...",
                   help="blocks per stage of the reversible net (default: by measured costs)")
    p.add_argument("--pt-partition", type=_split_arg, metavar="A,B,...",
                   help="blocks per stage of the plain twin (default: by measured costs)")
    p.add_argument("--waterfall", metavar="PNG", help="draw the waterfalls to this file")
    p.add_argument("--plot", metavar="RUN.txt",
                   help="no run: draw the waterfalls of a saved output (its JSON last line)")
    a = p.parse_args(argv)
    if a.accumulation < 1:
        p.error("--accumulation must be at least 1")
    return a


def _split_arg(text):
    return [int(n) for n in text.split(",")]


def measured_splits(a, world, work):
    """(our split of the reversible net, the pipelines' splits {net: split}, the per-block costs
    measured on rank 0 (None elsewhere): {"ours": our BlockCosts (kept times included), net:
    autograd BlockCosts of each net}). Each split is balanced by its costs, as a user would
    balance it (training's default for ours; for the pipelines the autograd costs they run, of
    the plain twin and of the reversible net), unless --partition and --pt-partition give them
    (the memory a contender holds depends on its split): the pipelines on the reversible net
    then take --partition. The costs also drive the waterfall's model."""
    from ...core.blockcost import measure_autograd_costs, measure_net_costs
    J, measured = world.size, None
    if world.rank == 0:
        costs = {"ours": measure_net_costs(work.net(work.arch), a.batch, time_kept=True)}
        petra_split, pt_splits = plan_layout(work.net(work.arch), J, costs=costs["ours"]).split, {}
        for net in (work.plain, work.arch):
            costs[net] = measure_autograd_costs(work.blocks(net), work.input_shape, a.batch,
                                                work.num_classes)
            pt_splits[net] = plan_layout(work.net(net), J, costs=costs[net]).split
        measured = (petra_split, pt_splits)
    petra_split, pt_splits = world.bcast(measured)
    if a.partition and a.pt_partition:
        petra_split, pt_splits = a.partition, {work.plain: a.pt_partition,
                                               work.arch: a.partition}
    return petra_split, pt_splits, costs if world.rank == 0 else None


def flops_per_microbatch(work, batch, stages):
    """FLOPs of one micro-batch (torch.utils.flop_counter): each net's forward and backward with
    autograd ({net: {"forward", "backward"}}), and PETRA's on `stages` (the whole net split as it
    runs: every stage's forward without graph, the last one's forward, loss and backward, and
    the other stages' backward, rebuild included)."""
    from torch.utils.flop_counter import FlopCounterMode
    x, y = work.batch(batch, torch.Generator().manual_seed(0))
    flops = {}
    for net in (work.plain, work.arch):
        out = x
        with FlopCounterMode(display=False) as forward:
            for block in work.blocks(net):
                out = block(out)
            loss = F.cross_entropy(out, y)
        with FlopCounterMode(display=False) as backward:
            loss.backward()
        flops[net] = {"forward": forward.get_total_flops(),
                      "backward": backward.get_total_flops()}
    with FlopCounterMode(display=False) as petra:
        out = x
        for stage in stages[:-1]:
            out = stage(out, 0)
        _, _, grad = stages[-1].forward_backward_loss(out, y)
        for stage in reversed(stages[:-1]):
            out, grad = stage.backward(out, grad, 0)
    flops["petra"] = petra.get_total_flops()
    return flops


class PeersBench:
    """Every contender on this rank: PETRA and backprop on one stage of the reversible net, the
    torch.distributed.pipelining schedules on one stage of its plain twin, and the data they
    train on."""

    def __init__(self, a, world, work):
        self.a, self.world, self.work = a, world, work
        J = world.size
        self.M = a.pt_microbatches
        petra_split, self.pt_splits, self.block_costs = measured_splits(a, world, work)
        # the kept plans' costs: the measured ones, unless --partition fixes our split
        self.costs = None if a.partition or not self.block_costs else self.block_costs["ours"]
        (self.stage,) = work.stages(a.partition or petra_split, world.rank)
        self.sizes = self.stage.partition
        self.sampler, self.clock = SampleAfterForward(), ForwardClock()
        # our contenders: name -> (engine, its stage on this rank, the stage's kept plan: None,
        # PETRA as in the paper)
        self.variants = {m: (engine, self.stage, None)
                         for m, engine in self.engines_on(self.stage, "petra", "backprop")}
        self.rebuild_split = a.partition or world.bcast(self.block_costs and plan_layout(
            work.net(work.arch), J, costs=self.block_costs["ours"], rebuild_last=True).split)
        self.variants[REBUILDS] = self.petra_on(self.rebuild_split, None)  # balanced for it
        # kept variant -> (memory_plan.Plan, kept budget per rank or None, its split, the
        # planner's time over PETRA's on PETRA's split)
        self.plans = {}
        self.budget_from = {}  # kept variant -> the contender whose memory its budget matches
        nets = {"": work.plain, SAME_NET: work.arch}
        self.net_of = {m: work.arch for m in self.variants}
        self.pts, self.skipped = pipelining_contenders(
            world, {suffix: (lambda n=net: work.blocks(n), self.pt_splits[net])
                    for suffix, net in nets.items()},
            self.M, work.zeros(a.batch), zero_bubble=not a.no_zero_bubble)
        for name in [*self.pts, *self.skipped]:
            self.net_of[name] = work.arch if name.endswith(SAME_NET) else work.plain
        self.schedule_clock = ScheduleClock()
        for pt in self.pts.values():
            self.schedule_clock.watch(pt.stage, pt.opt)
        self.measured = {}  # contender -> [wall, compute, wait] seconds over its timed runs
        g = torch.Generator().manual_seed(0)
        self.data = [work.batch(a.batch, g) for _ in range(max(4, self.M))]
        self.full_x = torch.cat([d[0] for d in self.data[:self.M]])
        self.full_y = torch.cat([d[1] for d in self.data[:self.M]])
        self.pt_steps = max(1, round(a.microbatches / self.M))

    def engines_on(self, stage, *methods):
        """(method, our engine of that method over `stage`) for each of `methods`."""
        workers = build_workers([stage], constant_lr(LR), self.a.accumulation,
                                momentum=MOMENTUM, hooks=[self.sampler, self.clock])
        return [(m, build_engine(workers, m, self.world, self.work.input_shape, self.a.batch,
                                 labels_per_sample=self.work.labels_per_sample))
                for m in methods]

    def names(self):
        return [*self.variants, *self.pts]

    def petra_on(self, split, kept):
        """(engine, stage, kept) of a PETRA variant on `split`: this rank's stage of PETRA's when
        the split is the same, else a stage and an engine of its own."""
        engine, stage, _ = self.variants["petra"]
        if split != self.sizes:
            (stage,) = self.work.stages(split, self.world.rank)
            ((_, engine),) = self.engines_on(stage, "petra")
        return engine, stage, kept

    def petra_run(self, name, n):
        """Images trained by one segment of n micro-batches of our engine, with the variant's
        kept plan and last-stage rule (the stage holds nothing between segments, so both may
        change)."""
        engine, stage, kept = self.variants[name]
        stage.set_kept(kept)
        if stage.is_last:
            stage.set_rebuild_last(name in REBUILDING)
        batches = ((self.data[i % len(self.data)] for i in range(n)) if self.world.rank == 0
                   else None)
        engine.train_segment(batches, n)
        return n * self.a.batch

    def add_kept_variants(self, peaks):
        """PETRA with kept blocks, planned as training plans them: at a budget per rank of
        1F1B's peak activation bytes less PETRA's own there (`peaks`: per contender and rank,
        on rank 0), so that PETRA holds at most what 1F1B holds, and without a limit. Where our
        split was measured, each variant's split is the measured balance redone with its plan's
        costs (planner.plan_layout, as model.balance: measure does), and a variant whose split
        differs runs on stages of its own. The plans are made on rank 0 on a fresh copy of the
        net and sent to every rank."""
        from ...core.memory_plan import AUTO
        a, world, work = self.a, self.world, self.work
        plans = None
        if world.rank == 0:
            budgets = {"petra_unlimited": None}
            for name, (rival, ours) in BUDGETS.items():
                rival = next((n for n in (rival + SAME_NET, rival) if n in peaks), None)
                if rival:  # the pipeline on PETRA's own net when it ran
                    self.budget_from[name] = rival
                    budgets[name] = [max(0, f - p) for f, p in zip(peaks[rival], peaks[ours])]
            plans = {}
            for name, budget in sorted(budgets.items()):
                # balanced for a last stage that rebuilds: the plan only; where our split was
                # given, the plan on it; else the measured balance redone with the plan's costs
                fixed = (self.rebuild_split if name in REBUILDING else
                         self.sizes if self.costs is None else None)
                layout = plan_layout(work.net(work.arch), world.size, partition=fixed,
                                     budget=AUTO if budget is None else budget,
                                     batch_size=a.batch, costs=self.costs)
                plan = layout.plan
                # set against the planner's time of PETRA on its own split
                petra = max(plan.petra_units_on(self.sizes))
                plans[name] = (plan, budgets[name], layout.split, max(plan.units) / petra)
        self.plans = world.bcast(plans)
        for name, (plan, _, split, _) in self.plans.items():
            self.variants[name] = self.petra_on(split, plan.kept[world.rank])
            self.net_of[name] = work.arch
        return list(self.plans)

    def pt_run(self, name, steps):
        """Images trained by `steps` steps of a pipelining schedule."""
        for _ in range(steps):
            self.pts[name].step(self.full_x, self.full_y)
        return steps * self.M * self.a.batch

    def counters(self, name) -> tuple:
        """(compute, wait) seconds so far on this rank: ours, or all pipelining schedules'."""
        if name in self.variants:
            engine = self.variants[name][0]
            return engine.compute_seconds, engine.wait_seconds()
        return self.schedule_clock.compute, self.schedule_clock.wait

    def timed_run(self, name):
        """(images/s of one timed segment of a contender, between barriers; for ours, on rank 0,
        the segment's steady-state images/s, else None). Adds the segment's wall, compute and
        wait seconds on this rank to self.measured."""
        self.world.barrier()
        before = self.counters(name)
        start = time.perf_counter()
        if name in self.variants:
            self.clock.starts = {}
            images = self.petra_run(name, self.a.microbatches)
        else:
            images = self.pt_run(name, self.pt_steps)
        wall = time.perf_counter() - start  # this rank's own, before it waits for the others
        self.world.barrier()
        speed = images / (time.perf_counter() - start)
        spent = [wall, *(b - a for a, b in zip(before, self.counters(name)))]
        self.measured[name] = [t + x for t, x in zip(self.measured.get(name, [0.0] * 3), spent)]
        starts, self.clock.starts = self.clock.starts, None
        steady = (steady_images_per_s(starts, self.world.size, self.a.accumulation, self.a.batch)
                  if starts else None)
        return speed, steady

    def images_per_s(self) -> tuple:
        """({contender: median images/s}, {our contender: median steady-state images/s, on
        rank 0}) over a.rounds round-robin rounds, after a warm-up (a failing zero-bubble step
        would leave the other ranks waiting in gloo, so a schedule that raises here ends the run
        with its error)."""
        for name in self.variants:
            self.petra_run(name, self.world.size + 2)
        for n in self.pts:
            self.pt_run(n, 1)
        speeds = {name: [] for name in self.names()}
        steady = {name: [] for name in self.variants}
        for _ in range(self.a.rounds):
            for name in speeds:
                speed, steady_speed = self.timed_run(name)
                speeds[name].append(speed)
                if steady_speed is not None:
                    steady[name].append(steady_speed)
        return ({name: statistics.median(v) for name, v in speeds.items()},
                {name: statistics.median(v) for name, v in steady.items() if v})

    def peak_bytes(self, names) -> tuple:
        """(peak activation bytes, peak bytes of kept graphs) of each of `names` from one
        untimed pass with the hooks on; per rank, gathered on rank 0. Ours count their FIFOs,
        what autograd saves and their kept graphs (Stage.kept_bytes: activations, stashed
        weights, inputs), together at every sample."""
        world, peaks, kept = self.world, {}, {}
        for m in [n for n in names if n in self.variants]:
            stage = self.variants[m][1]
            meter = ActivationMeter(stage, lambda s=stage: (t for f in s.fifos for t in f),
                                    extra=lambda s=stage: s.kept_bytes)
            self.sampler.meter = meter
            stage.reset_peaks()
            try:
                with meter.hooks():
                    world.barrier()
                    self.petra_run(m, self.a.microbatches)
            finally:
                self.sampler.meter = None
            peaks[m], kept[m] = meter.peak, stage.peak_kept_bytes
        for n in [n for n in names if n in self.pts]:
            world.barrier()
            peaks[n] = self.pts[n].measure(self.full_x, self.full_y)
        return ({name: world.gather(peaks[name]) for name in names},
                {name: world.gather(kept[name]) for name in kept})


def waterfalls(bench) -> dict:
    """On rank 0, each contender's waterfall (waterfall.py) over its timed runs of `bench`
    (PeersBench), where the model runs it; None elsewhere."""
    measured = {n: bench.world.gather(v) for n, v in sorted(bench.measured.items())}
    if bench.world.rank != 0:
        return None
    a, work, out = bench.a, bench.work, {}
    for name, per_rank in measured.items():
        if name in bench.variants:
            method = "backprop" if name == "backprop" else "petra"
            plan = bench.plans[name][0] if name in bench.plans else None
            sizes = bench.variants[name][1].partition
            costs = bench.block_costs["ours"]
            model = ours_model(method, costs.with_rebuilt_last() if name in REBUILDING
                               else costs, sizes, plan.kept if plan else None,
                               a.microbatches, a.accumulation)
        else:
            net = bench.net_of[name]
            model = pipeline_model(name.removesuffix(SAME_NET), bench.block_costs[net],
                                   bench.pt_splits[net], bench.M, bench.pt_steps)
        if model is not None:
            n = a.microbatches if name in bench.variants else bench.pt_steps * bench.M
            out[name] = waterfall(a.rounds, n, *model, per_rank)
    return out


def run(a):
    """Time and measure every contender on every rank; the JSON record on rank 0, else None."""
    world = World.from_environment(a.transport)
    if world is None:
        raise SystemExit("run under mpirun (or torchrun with --transport torch) with at least 2 "
                         "ranks")
    torch.set_num_threads(a.threads or world.thread_share())
    a.pt_microbatches = a.pt_microbatches or max(a.accumulation, world.size)
    dist = world.torch_distributed()  # torch's schedules run over gloo
    work = Workload.from_args(a)
    bench = PeersBench(a, world, work)
    flops = (flops_per_microbatch(work, a.batch, work.stages(bench.sizes))
             if world.rank == 0 else None)
    # the contenders' memory first: PETRA's kept budget comes from 1F1B's
    peak_bytes, kept_bytes = bench.peak_bytes(bench.names())
    kept_names = bench.add_kept_variants(peak_bytes)
    images_per_s, steady = bench.images_per_s()
    falls = waterfalls(bench)
    more_peaks, more_kept = bench.peak_bytes(kept_names)
    peak_bytes.update(more_peaks)
    kept_bytes.update(more_kept)
    dist.destroy_process_group()
    if world.rank != 0:
        return None
    record = {"bench": "peers", "ranks": world.size, "threads": torch.get_num_threads(),
              "transport": {"ours": "mpi" if a.transport == "mpi" else "gloo",
                            "pipelining": "gloo"},
              "model": work.arch, "plain_model": work.plain, **work.model_kw,
              "batch": a.batch, "width": work.width, "microbatches": a.microbatches,
              "accumulation": a.accumulation, "pt_microbatches": a.pt_microbatches,
              "partition": bench.sizes, "pt_partition": bench.pt_splits[work.plain],
              "pt_partition_rev": bench.pt_splits[work.arch],
              "net": {name: bench.net_of[name] for name in images_per_s},
              "flops_per_microbatch": flops,
              "images_per_s": images_per_s, "steady_images_per_s": steady,
              "peak_activation_bytes": {name: peak_bytes[name] for name in images_per_s},
              "peak_kept_bytes": kept_bytes, "waterfall": falls,
              "kept": {name: {"budget_bytes": budget, "plan": plan.kept,
                              "planned_kept_bytes": plan.kept_bytes,
                              "planned_relative_time": relative, "partition": split}
                       for name, (plan, budget, split, relative) in bench.plans.items()}}
    for name, rival in bench.budget_from.items():
        record["kept"][name]["budget_from"] = rival
    record.update(ratios(images_per_s, steady))
    if work.context:  # a language model: every window is context tokens
        record["tokens_per_s"] = {n: v * work.context for n, v in images_per_s.items()}
        record["steady_tokens_per_s"] = {n: v * work.context for n, v in steady.items()}
    if bench.skipped:
        record["skipped"] = bench.skipped
    return record


OURS = ("petra", "petra_budget_1f1b", "petra_unlimited", REBUILDS,
        "petra_budget_1f1b_checkpointed")
RIVALS = ("1f1b", "1f1b_checkpointed", "zero_bubble")


def ratios(images_per_s, steady) -> dict:
    """"{ours}_vs_{rival}": our images/s over a pipeline's, timed segments alike (fill and drain
    in ours), and "steady_{ours}_vs_{rival}": ours in steady state; for every pipeline on either
    net (the rival's name says which)."""
    out = {}
    for ours in OURS:
        for rival in (r + suffix for suffix in ("", SAME_NET) for r in RIVALS):
            if ours in images_per_s and rival in images_per_s:
                out[f"{ours}_vs_{rival}"] = images_per_s[ours] / images_per_s[rival]
                if ours in steady:
                    out[f"steady_{ours}_vs_{rival}"] = steady[ours] / images_per_s[rival]
    return out


def report(a, r):
    """The table on rank 0, then the JSON line (nothing on the other ranks)."""
    if r is None:
        return
    mib, M = 2.0 ** 20, r["pt_microbatches"]
    net, plain = r["model"], r["plain_model"]
    words = "tokens" if "tokens_per_s" in r else "images"
    speeds = r.get("tokens_per_s", r["images_per_s"])
    steady = r.get("steady_tokens_per_s", r["steady_images_per_s"])
    print(f"width {r['width']}, micro-batch {a.batch}, {r['ranks']} ranks x {r['threads']} "
          f"threads, median of {a.rounds} alternated rounds; messages: ours over "
          f"{r['transport']['ours']}, pipelining over {r['transport']['pipelining']}")
    print(f"ours: {net}, {a.microbatches} micro-batches per timed segment (fill and drain "
          f"included; 'steady': without them), k = {a.accumulation}; pipelining: {M} "
          f"micro-batches per step, {max(1, round(a.microbatches / M))} step(s) per timed "
          f"segment; blocks per stage: ours {r['partition']}, pipelines on {plain} "
          f"{r['pt_partition']}, on {net} {r['pt_partition_rev']}")
    flops = r["flops_per_microbatch"]
    print("GFLOPs per micro-batch (forward + backward): " + ", ".join(
        f"{n} {(f['forward'] + f['backward']) / 1e9:.2f}" for n, f in flops.items()
        if isinstance(f, dict)) + f", PETRA on {net} (rebuild included) {flops['petra'] / 1e9:.2f}")
    # a cluster sizes every GPU for the rank that holds most: the fullest rank first
    print(f"{'contender':<31} {'net':<9} {words + '/s':>9} {'steady':>8}  {'fullest':>8}  "
          f"peak activation MiB per rank")
    for name, speed in speeds.items():
        held = r["peak_activation_bytes"][name]
        per_rank = " ".join(f"{b / mib:8.2f}" for b in held)
        still = f"{steady[name]:8.1f}" if name in steady else f"{'':8}"
        print(f"{name:<31} {r['net'][name]:<9} {speed:>9.1f} {still}  {max(held) / mib:8.2f}  "
              f"{per_rank}")
    for name, why in r.get("skipped", {}).items():
        print(f"{name:<31} did not run: {why}")
    for name, k in r["kept"].items():
        budget = ("no limit" if k["budget_bytes"] is None else "budget " + " ".join(
            f"{b / mib:.2f}" for b in k["budget_bytes"]) + f" MiB per rank ({k['budget_from']}'s "
            "peak less ours without kept blocks)")
        print(f"{name}: blocks per stage {k['partition']}, kept graphs ({budget}) per stage "
              f"{k['plan']}, peak kept MiB per rank "
              f"{' '.join(f'{b / mib:.2f}' for b in r['peak_kept_bytes'][name])}; planned "
              f"time {k['planned_relative_time']:.3f} of PETRA's on its split")
    print("where the time goes, ms per micro-batch on the rank that computes most (the model at "
          "isolated block costs, then what the run adds):")
    print(f"{'contender':<31} {'rank':>4} {'model':>7} {'+compute':>10} {'+waiting':>10} "
          f"{'+framework':>10} {'measured':>9}")
    for name, w in (r["waterfall"] or {}).items():
        ms = 1e3 / w["microbatches"]
        print(f"{name:<31} {w['rank']:>4} {w['model_s'] * ms:7.2f} " + " ".join(
            f"{w['steps_s'][s_] * ms:+10.2f}" for s_ in STEPS[1:]) + f" {w['wall_s'] * ms:9.2f}")
    rivals = [n for n in (r_ + suffix for suffix in ("", SAME_NET) for r_ in RIVALS)
              if any(f"{ours}_vs_{n}" in r for ours in OURS)]
    print(f"{'ours / pipeline':<31} " + " ".join(f"{n:>21}" for n in rivals))
    print(f"{'(segment, steady)':<31} " + " ".join(f"{r['net'][n]:>21}" for n in rivals))
    for ours in [o for o in OURS if o in speeds]:
        cells = (f"{r.get(f'{ours}_vs_{n}', 0):.2f} {r.get(f'steady_{ours}_vs_{n}', 0):.2f}"
                 for n in rivals)
        print(f"{ours:<31} " + " ".join(f"{c:>21}" for c in cells))
    emit(r)
