"""Under `mpirun -n J`: PETRA against other pipeline-parallel trainers on the same ranks, timed
in alternated rounds (every contender once per round, in an order shuffled per round; medians,
with the range over the rounds).

- petra, backprop: our engine on RevNet18 (as `bench pipeline`), or with `--model revlm` on
  the reversible causal language model (configs/lm/shakespeare_cpu.yaml's size by default); its
  messages over MPI, or with `--transport torch` over gloo (comm.transport), as torch's are.
- delayed: our engine's delayed gradients with input buffers and weight stashing (the paper's
  Table 4): every block keeps its input, each in-flight micro-batch the weights of its forward,
  and the backward recomputes the forward; no reversibility used. pipedream: PETRA's engine with
  every block keeping the graph of every in-flight micro-batch (stored activations and stashed
  weights: PipeDream's 1F1B without flush), on the split the pipelines use for the same net.
- gpipe, 1f1b, zero_bubble: torch.distributed.pipelining's ScheduleGPipe, Schedule1F1B and
  ScheduleInterleavedZeroBubble (one stage per rank); interleaved_1f1b, zbv, dualpipev:
  ScheduleInterleaved1F1B, ScheduleZBVZeroBubble and ScheduleDualPipeV with two stages per
  rank (a loop, a V, a V); each on the plain twin of the same width (ResNet18, or the plain
  transformer `lm`), split by its own measured block costs, over gloo.
- 1f1b_checkpointed: Schedule1F1B with torch.utils.checkpoint around every block.
- every schedule again with the suffix _rev on PETRA's own net (RevNet18 or revlm) run with
  autograd, activations stored (what a user of torch's pipelining would run on this net), split
  by its measured autograd block costs. The record's "net" says which net each contender
  trains; "flops_per_microbatch" gives each net's forward and backward FLOPs (torch's flop
  counter) and PETRA's own, rebuild included.
- petra_budget_1f1b, petra_unlimited: PETRA with kept blocks (model.memory_budget,
  memory_plan.py) at a budget per rank of 1F1B's peak activation bytes there (on the same net
  when it ran; less PETRA's own), and without a limit; each on the split training would choose
  for its budget (the measured balance redone with the plan's costs) unless --partition fixes it.
- petra_rebuild_last: PETRA whose last stage rebuilds instead of holding its graph
  (model.rebuild_last_stage), on the split balanced for it; petra_budget_1f1b_checkpointed: the
  same with kept blocks at checkpointed 1F1B's peak per rank less its own.

`--contenders a,b` runs only those; `--layout FILE` takes the splits, kept plans and block costs
from a file that `--save-layout` wrote (peers_layout.py) instead of measuring and planning again.
A run of one contender also gives each rank's real peak memory: the process's high-water mark
(VmHWM), everything it touched. `--compile`: every contender's blocks through torch.compile.

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
import os
import random
import statistics
import sys
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ...engines.build import StageSpec, build_engine, build_stages, build_workers
from ...core.worker import WorkerHooks
from ...comm.world import World
from ...models import NetSpec, build_blocks, set_compiled
from ...core.optim import constant_lr
from ...core.planner import Layout
from ...core.schedule import Kind, PetraSchedule
from . import peers_layout
from .common import last_json_line, machine, process_memory_bytes, random_batch
from .meter import ActivationMeter
from .peers_report import report
from .pipelining import (LR, MOMENTUM, SCHEDULES, SPLIT_BACKWARD, pipelining_contenders,
                         stages_per_rank)
from .waterfall import ScheduleClock, draw, ours_model, pipeline_model, waterfall

SAME_NET = "_rev"  # suffix of the pipelining contenders on PETRA's own net
REBUILDS = "petra_rebuild_last"  # PETRA whose last stage rebuilds (model.rebuild_last_stage)
DELAYED = "delayed"  # Table 4's delayed gradients: inputs buffered, weights stashed, recomputed
PIPEDREAM = "pipedream"  # every in-flight micro-batch's graph and weights kept: PipeDream
# kept variants at a pipeline's peak memory per rank: name -> (that pipeline, the variant of ours
# whose own peak the budget adds to)
BUDGETS = {"petra_budget_1f1b": ("1f1b", "petra"),
           "petra_budget_1f1b_checkpointed": ("1f1b_checkpointed", REBUILDS)}
UNLIMITED = "petra_unlimited"
KEPT = (UNLIMITED, *BUDGETS)
REBUILDING = {REBUILDS, "petra_budget_1f1b_checkpointed"}
OURS = ("petra", "backprop", DELAYED, PIPEDREAM, REBUILDS, *KEPT)
PIPELINES = tuple(s + suffix for suffix in ("", SAME_NET) for s in SCHEDULES)
ZERO_BUBBLES = tuple(s + suffix for suffix in ("", SAME_NET) for s in SPLIT_BACKWARD)
# the ratios: ours named first, over every other contender that is not PETRA
RATIO_OURS = ("petra", "petra_budget_1f1b", UNLIMITED, REBUILDS, "petra_budget_1f1b_checkpointed")
RATIO_RIVALS = (DELAYED, PIPEDREAM, *(s + suffix for suffix in ("", SAME_NET)
                                      for s in ("1f1b", "1f1b_checkpointed", "zero_bubble",
                                                "interleaved_1f1b", "zbv", "dualpipev")))


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


def keeps_all(split) -> list:
    """PipeDream's plan on `split`: every block of every stage keeps the graph of every
    micro-batch the stage holds in flight (none on the last stage, which holds none)."""
    schedule = PetraSchedule(len(split))
    return [[schedule.in_flight(s)] * n for s, n in enumerate(split)]


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
    `context` token ids and a label per token; with `compiled`, every block's sub-modules
    through torch.compile (model.compile)."""
    arch: str
    plain: str
    width: int
    num_classes: int
    model_kw: dict
    context: int = 0  # a language model's window; 0: images
    compiled: bool = False

    @classmethod
    def from_args(cls, a):
        if a.model == "revlm":
            kw = {"depth": a.depth, "heads": a.heads, "context": a.context}
            return cls("revlm", "lm", a.width or 128, 256, kw, a.context, a.compile)
        return cls("revnet18", "resnet18", a.width or 32, 10, {}, compiled=a.compile)

    @property
    def input_shape(self) -> tuple:
        return (self.context,) if self.context else (3, 32, 32)

    @property
    def labels_per_sample(self) -> int:
        return self.context or 1

    def blocks(self, arch, compiled=None):
        blocks = build_blocks(arch, self.width, self.num_classes, **self.model_kw)
        set_compiled(blocks, self.compiled if compiled is None else compiled)
        return blocks

    def net(self, arch, compiled=None) -> NetSpec:
        return NetSpec(arch, self.width, self.num_classes, model_kw=self.model_kw,
                       compile=self.compiled if compiled is None else compiled)

    def stages(self, split, only=None, compiled=None, **spec):
        """The stages of PETRA's reversible net split as `split` (just stage `only`); spec:
        StageSpec's switches (method, buffer_inputs, stash_weights)."""
        return build_stages(StageSpec(self.net(self.arch, compiled), **spec), Layout(split),
                            only=only)

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
    p.add_argument("--rounds", type=int, default=3,
                   help="alternated rounds of each contender, in an order shuffled per round")
    p.add_argument("--seed", type=int, default=0, help="of the shuffled order of the rounds")
    p.add_argument("--transport", choices=("mpi", "torch"), default="mpi",
                   help="what carries PETRA's messages (comm.transport): mpi, or torch "
                        "(gloo, as torch's schedules always are)")
    p.add_argument("--threads", type=int, default=0, help="torch threads per rank (0: share)")
    p.add_argument("--contenders", type=_names_arg, metavar="A,B,...",
                   help="run only these (default: all; " + ", ".join((*OURS, *PIPELINES)) + ")")
    p.add_argument("--no-zero-bubble", action="store_true",
                   help="skip the zero-bubble schedules (zero_bubble, zbv, dualpipev)")
    p.add_argument("--compile", action="store_true",
                   help="every contender's blocks through torch.compile (model.compile); the "
                        "schedules that split the backward (zero bubble, ZB-V, DualPipeV) "
                        "cannot be compiled and are skipped")
    p.add_argument("--partition", type=_split_arg, metavar="A,B,...",
                   help="blocks per stage of the reversible net (default: by measured costs)")
    p.add_argument("--pt-partition", type=_split_arg, metavar="A,B,...",
                   help="blocks per stage of the plain twin (default: by measured costs)")
    p.add_argument("--layout", metavar="FILE",
                   help="the splits, kept plans and block costs from this file (--save-layout "
                        "wrote it) instead of measuring and planning again")
    p.add_argument("--save-layout", metavar="FILE",
                   help="write the splits, kept plans and block costs of this run (a new file)")
    p.add_argument("--timing-only", action="store_true",
                   help="after the timed rounds, no activation count, FLOPs nor waterfall")
    p.add_argument("--waterfall", metavar="PNG", help="draw the waterfalls to this file")
    p.add_argument("--plot", metavar="RUN.txt",
                   help="no run: draw the waterfalls of a saved output (its JSON last line)")
    return _checked(p, p.parse_args(argv))


def _checked(p, a):
    """The options that argparse cannot check alone, each refused in one line."""
    if a.accumulation < 1:
        p.error("--accumulation must be at least 1")
    if a.rounds < 1:
        p.error("--rounds must be at least 1")
    unknown = [n for n in a.contenders or () if n not in (*OURS, *PIPELINES)]
    if unknown:
        p.error(f"--contenders: no contender {', '.join(unknown)}")
    if a.layout and (a.partition or a.pt_partition):
        p.error("--layout gives the splits: no --partition or --pt-partition with it")
    if a.save_layout and os.path.exists(a.save_layout):
        p.error(f"--save-layout {a.save_layout}: exists (give a new file)")
    a.contenders = [n for n in a.contenders or (*OURS, *PIPELINES)
                    if not (a.no_zero_bubble and n in ZERO_BUBBLES)]
    return a


def _split_arg(text):
    return [int(n) for n in text.split(",")]


def _names_arg(text):
    return [n for n in text.split(",") if n]


def measured_splits(a, world, work):
    """(our split of the reversible net, the split for a last stage that rebuilds, the
    pipelines' splits {net: {stage count: split}}, the per-block costs measured on rank 0 (None
    elsewhere): {"ours": our BlockCosts (kept times included), net: autograd BlockCosts of each
    net}). Each split is balanced by its costs, as a user would balance it (training's default
    for ours; for the pipelines the autograd costs they run, of the plain twin and of the
    reversible net), unless --partition and --pt-partition give them (the memory a contender
    holds depends on its split): the pipelines on the reversible net then take --partition."""
    from ...core.blockcost import measure_autograd_costs, measure_net_costs
    J, measured, costs = world.size, None, None
    if world.rank == 0:
        costs = {"ours": measure_net_costs(work.net(work.arch), a.batch, time_kept=True)}
        splits = peers_layout.petra_splits(work.net(work.arch), J, costs["ours"])
        pt_splits = {}
        for net in (work.plain, work.arch):
            costs[net] = measure_autograd_costs(work.blocks(net), work.input_shape, a.batch,
                                                work.num_classes)
            pt_splits[net] = peers_layout.pipeline_splits(work.net(net), J, costs[net])
        measured = (splits["ours"], splits["rebuild_last"], pt_splits)
    petra_split, rebuild_split, pt_splits = world.bcast(measured)
    if a.partition and a.pt_partition:
        petra_split = rebuild_split = a.partition
        pt_splits = {net: {J: split, 2 * J: halved(split)}
                     for net, split in ((work.plain, a.pt_partition), (work.arch, a.partition))}
    return petra_split, rebuild_split, pt_splits, costs


def halved(split) -> list:
    """A given split of J stages as 2J stages, each stage's blocks in two (the schedules with two
    stages per rank); a stage of one block keeps it and its second half is empty, which torch's
    schedules cannot run, so they are skipped."""
    return [n for size in split for n in (size // 2, size - size // 2)]


def flops_per_microbatch(work, batch, stages):
    """FLOPs of one micro-batch (torch.utils.flop_counter): each net's forward and backward with
    autograd ({net: {"forward", "backward"}}), and PETRA's on `stages` (the whole net split as it
    runs: every stage's forward without graph, the last one's forward, loss and backward, and
    the other stages' backward, rebuild included). Eager nets: what is counted is the
    arithmetic, compiled or not."""
    from torch.utils.flop_counter import FlopCounterMode
    x, y = work.batch(batch, torch.Generator().manual_seed(0))
    flops = {}
    for net in (work.plain, work.arch):
        out = x
        with FlopCounterMode(display=False) as forward:
            for block in work.blocks(net, compiled=False):
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
    """The contenders of a.contenders on this rank: ours on one stage of the reversible net,
    the torch.distributed.pipelining schedules on their stages of either net, and the data they
    train on. `layout`: a layout read from --layout (peers_layout.py), or None: measured here."""

    def __init__(self, a, world, work, layout=None):
        self.a, self.world, self.work, self.layout = a, world, work, layout
        if layout:
            petra_split, rebuild_split, self.pt_splits = peers_layout.splits_of(layout)
            self.block_costs = peers_layout.costs_of(layout, a.batch) if world.rank == 0 else None
        else:
            petra_split, rebuild_split, self.pt_splits, self.block_costs = measured_splits(
                a, world, work)
        self.petra_split = self.sizes = a.partition or petra_split
        self.rebuild_split = a.partition or rebuild_split
        # the kept plans' costs: the measured ones, unless --partition fixes our split
        self.costs = None if a.partition or not self.block_costs else self.block_costs["ours"]
        self.sampler, self.clock = SampleAfterForward(), ForwardClock()
        self.stages = {}  # (split, switches) -> this rank's stage, shared by the variants on it
        # our contenders: name -> (engine, its stage on this rank, the stage's kept plan: None,
        # PETRA as in the paper)
        self.variants, self.net_of = {}, {}
        # kept variant -> its plan (peers_layout.plan_kept's entry), read or made here; the
        # budgets made here come from a pipeline's memory less ours: both run here too
        self.plans = {}
        if layout:
            self.add_planned(peers_layout.kept_of(layout, a.batch))
        to_plan = {n for n in BUDGETS if n in a.contenders} - set(self.plans)
        self.add_ours(to_plan)
        self.M = a.pt_microbatches
        self.add_pipelines({n for n in a.contenders if n in PIPELINES}
                           | {BUDGETS[n][0] + SAME_NET for n in to_plan})
        self.measured = {}  # contender -> [wall, compute, wait] seconds over its timed runs
        g = torch.Generator().manual_seed(0)
        self.data = [work.batch(a.batch, g) for _ in range(max(4, self.M))]
        self.full_x = torch.cat([d[0] for d in self.data[:self.M]])
        self.full_y = torch.cat([d[1] for d in self.data[:self.M]])
        self.pt_steps = max(1, round(a.microbatches / self.M))

    def add_ours(self, to_plan):
        """Our contenders of a.contenders, and PETRA and its rebuilding variant where a budget
        of `to_plan` is planned from their memory."""
        wanted, work = set(self.a.contenders), self.work
        for m in ("petra", "backprop"):
            if m in wanted or m == "petra" and "petra_budget_1f1b" in to_plan:
                self.variants[m] = self.ours_on(self.petra_split, m)
        if DELAYED in wanted:
            self.variants[DELAYED] = self.ours_on(self.petra_split, DELAYED, buffer_inputs=True,
                                                  stash_weights=True)
        if REBUILDS in wanted or "petra_budget_1f1b_checkpointed" in to_plan:
            self.variants[REBUILDS] = self.ours_on(self.rebuild_split, "petra")
        if PIPEDREAM in wanted:  # on the split of the pipelines that store their graphs too
            split = self.pt_splits[work.arch][self.world.size]
            engine, stage, _ = self.ours_on(split, "petra")
            self.variants[PIPEDREAM] = engine, stage, keeps_all(split)[self.world.rank]
        for name in self.variants:
            self.net_of[name] = work.arch

    def add_pipelines(self, names):
        """torch's schedules of `names` (those that cannot run skipped, with the reason), each
        watched by the schedule clock."""
        work, self.skipped = self.work, {}
        if self.a.compile:
            for name in sorted(names & set(ZERO_BUBBLES)):
                self.skipped[name] = ("torch.compile: torch's pipelining cannot split a compiled "
                                      "backward into input and weight gradients")
            names -= set(ZERO_BUBBLES)
        nets = {"": work.plain, SAME_NET: work.arch}
        self.pts, skipped = pipelining_contenders(
            self.world, {suffix: (lambda n=net: work.blocks(n), self.pt_splits[net])
                         for suffix, net in nets.items()},
            self.M, work.zeros(self.a.batch), names)
        self.skipped.update(skipped)
        for name in [*self.pts, *self.skipped]:
            self.net_of[name] = work.arch if name.endswith(SAME_NET) else work.plain
        self.schedule_clock = ScheduleClock()
        for pt in self.pts.values():
            for stage in pt.stages:
                self.schedule_clock.watch(stage, pt.opt)

    def ours_on(self, split, method, **switches):
        """(engine, stage, None) of our `method` on `split`: this rank's stage, shared with the
        other variants on the same split and switches (each with its own engine)."""
        key = (tuple(split), tuple(sorted(switches.items())))
        if key not in self.stages:
            # a stage with delayed's switches runs delayed's schedule (its in-flight counts are
            # PETRA's); PETRA and backprop share one of PETRA's
            spec = {"method": DELAYED, **switches} if switches else {}
            (self.stages[key],) = self.work.stages(split, self.world.rank, **spec)
        stage = self.stages[key]
        workers = build_workers([stage], constant_lr(LR), self.a.accumulation,
                                momentum=MOMENTUM, hooks=[self.sampler, self.clock],
                                method=method)
        engine = build_engine(workers, method, self.world, self.work.input_shape, self.a.batch,
                              labels_per_sample=self.work.labels_per_sample)
        return engine, stage, None

    def names(self):
        """The contenders that run, in a.contenders' order."""
        return [n for n in self.a.contenders if n in self.variants or n in self.pts]

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

    def add_planned(self, plans):
        """Run the kept variants of `plans` ({name: peers_layout.plan_kept's entry}) that were
        asked for, each on its plan's split."""
        for name, entry in plans.items():
            if name in self.a.contenders:
                self.plans[name] = entry
                engine, stage, _ = self.ours_on(entry["partition"], "petra")
                self.variants[name] = engine, stage, entry["plan"][self.world.rank]
                self.net_of[name] = self.work.arch

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

    def rounds(self) -> tuple:
        """({contender: images/s per round}, {our contender: steady-state images/s per round, on
        rank 0}, [each round's order]) over a.rounds rounds, each contender once per round in an
        order shuffled per round (seeded: the same on every rank), after a warm-up (a failing
        zero-bubble step would leave the other ranks waiting in gloo, so a schedule that raises
        here ends the run with its error)."""
        for name in self.names():
            if name in self.variants:
                self.petra_run(name, self.world.size + 2)
            else:
                self.pt_run(name, 1)
        speeds = {name: [] for name in self.names()}
        steady = {name: [] for name in self.variants}
        shuffle, orders = random.Random(self.a.seed), []
        for _ in range(self.a.rounds):
            order = self.names()
            shuffle.shuffle(order)
            orders.append(order)
            for name in order:
                speed, steady_speed = self.timed_run(name)
                speeds[name].append(speed)
                if steady_speed is not None:
                    steady[name].append(steady_speed)
        return speeds, {name: v for name, v in steady.items() if v}, orders


def plan_kept_here(bench, peaks):
    """PETRA with kept blocks, planned as training plans them: at a budget per rank of
    1F1B's peak activation bytes less PETRA's own there (`peaks`: per contender and rank, on
    rank 0), so that PETRA holds at most what 1F1B holds, and without a limit. Where our split
    was measured, each variant's split is the measured balance redone with its plan's costs
    (planner.plan_layout, as model.balance: measure does), and a variant whose split differs
    runs on stages of its own. The plans are made on rank 0 on a fresh copy of the net and sent
    to every rank."""
    a, world, work = bench.a, bench.world, bench.work
    wanted = [n for n in KEPT if n in a.contenders and n not in bench.plans]
    plans = None
    if world.rank == 0 and wanted:
        budgets = {UNLIMITED: (None, None)}
        for name, (rival, ours) in BUDGETS.items():
            rival = next((n for n in (rival + SAME_NET, rival) if n in peaks), None)
            if rival:  # the pipeline on PETRA's own net when it ran
                budgets[name] = ([max(0, f - p) for f, p in zip(peaks[rival], peaks[ours])],
                                 rival)
        plans = peers_layout.plan_kept(
            work.net(work.arch), world.size, {n: budgets[n] for n in wanted if n in budgets},
            bench.costs, a.batch, bench.sizes, bench.rebuild_split,
            bench.sizes if bench.costs is None else None, REBUILDING)
    bench.add_planned(world.bcast(plans) or {})


def activation_peaks(bench, names) -> tuple:
    """(peak activation bytes, peak bytes of kept graphs) of each of `names` from one untimed
    pass of `bench` (PeersBench) with the hooks on; per rank, gathered on rank 0. Ours count
    their FIFOs, what autograd saves, their kept graphs (Stage.kept_bytes: activations, stashed
    weights, inputs) and their stashed weights, together at every sample."""
    world, peaks, kept = bench.world, {}, {}
    for m in [n for n in names if n in bench.variants]:
        stage = bench.variants[m][1]
        meter = ActivationMeter(stage, lambda s=stage: (t for f in s.fifos for t in f),
                                extra=lambda s=stage: s.kept_bytes + s.stash_bytes)
        bench.sampler.meter = meter
        stage.reset_peaks()
        try:
            with meter.hooks():
                world.barrier()
                bench.petra_run(m, bench.a.microbatches)
        finally:
            bench.sampler.meter = None
        peaks[m], kept[m] = meter.peak, stage.peak_kept_bytes
    for n in [n for n in names if n in bench.pts]:
        world.barrier()
        peaks[n] = bench.pts[n].measure(bench.full_x, bench.full_y)
    return ({name: world.gather(peaks[name]) for name in names},
            {name: world.gather(kept[name]) for name in kept})


def waterfalls(bench, names) -> dict:
    """On rank 0, the waterfall (waterfall.py) of each of `names` over its timed runs of `bench`
    (PeersBench), where the model runs it; None elsewhere. The model's block costs are those
    measured at start-up, read from the layout, or measured now on rank 0 for what runs."""
    measured = {n: bench.world.gather(bench.measured[n]) for n in names}
    if bench.world.rank != 0:
        return None
    a, work, out = bench.a, bench.work, {}
    costs = bench.block_costs or {}
    for name, per_rank in measured.items():
        if name in bench.variants:
            method = name if name in ("backprop", DELAYED) else "petra"
            plan = (bench.plans[name]["plan"] if name in bench.plans else
                    keeps_all(bench.variants[name][1].partition) if name == PIPEDREAM else None)
            sizes = bench.variants[name][1].partition
            ours = costs.get("ours") or _measured_costs(work, a.batch, "ours")
            costs["ours"] = ours
            model = ours_model(method, ours.with_rebuilt_last() if name in REBUILDING else ours,
                               sizes, plan, a.microbatches, a.accumulation)
        else:
            net = bench.net_of[name]
            if stages_per_rank(name.removesuffix(SAME_NET)) > 1:
                continue  # the model runs schedules of one stage per rank
            costs[net] = costs.get(net) or _measured_costs(work, a.batch, net)
            model = pipeline_model(name.removesuffix(SAME_NET), costs[net],
                                   bench.pt_splits[net][bench.world.size], bench.M,
                                   bench.pt_steps)
        if model is not None:
            n = a.microbatches if name in bench.variants else bench.pt_steps * bench.M
            out[name] = waterfall(a.rounds, n, *model, per_rank)
    return out


def _measured_costs(work, batch, which):
    """Per-block costs at `batch`: ours (kept times included) or a net's under autograd."""
    from ...core.blockcost import measure_autograd_costs, measure_net_costs
    if which == "ours":
        return measure_net_costs(work.net(work.arch), batch, time_kept=True)
    return measure_autograd_costs(work.blocks(which), work.input_shape, batch, work.num_classes)


def run(a):
    """Time and measure every contender on every rank; the JSON record on rank 0, else None."""
    world = World.from_environment(a.transport)
    if world is None:
        raise SystemExit("run under mpirun (or torchrun with --transport torch) with at least 2 "
                         "ranks")
    record = measure(a, world)
    world.close()  # once the schedules, which hold process groups, are gone with measure's frame
    return record


def measure(a, world):
    """run's measurements over `world`: the JSON record on rank 0, else None."""
    base_rss = world.gather(process_memory_bytes()[1])  # before any net is built
    torch.set_num_threads(a.threads or world.thread_share())
    a.pt_microbatches = a.pt_microbatches or max(a.accumulation, world.size)
    world.torch_distributed()  # torch's schedules run over gloo
    work = Workload.from_args(a)
    bench = PeersBench(a, world, work, read_layout(a, world, work))
    # PETRA's kept budgets come from 1F1B's memory: measured first where they are planned here
    peak_bytes, kept_bytes = {}, {}
    if any(n in a.contenders and n not in bench.plans for n in KEPT):
        rivals = [n for n in (*bench.variants, *bench.pts) if n in ("petra", REBUILDS) or n in (
            r + suffix for r, _ in BUDGETS.values() for suffix in ("", SAME_NET))]
        peak_bytes, kept_bytes = activation_peaks(bench, rivals)
        plan_kept_here(bench, peak_bytes)
    names = bench.names()
    speeds, steady, orders = bench.rounds()
    # the real peak of each rank: what one contender alone made the process hold
    peak_rss = world.gather(process_memory_bytes()[0])
    extras = {}
    if not a.timing_only:
        more_peaks, more_kept = activation_peaks(bench, [n for n in names
                                                          if n not in peak_bytes])
        peak_bytes.update(more_peaks)
        kept_bytes.update(more_kept)
        extras["waterfall"] = waterfalls(bench, names)
        if world.rank == 0:
            extras["flops_per_microbatch"] = flops_per_microbatch(
                work, a.batch, work.stages(bench.sizes, compiled=False))
    if world.rank != 0:
        return None
    if a.save_layout:
        peers_layout.write(a.save_layout, peers_layout.make(
            work, world.size, bench.petra_split, bench.rebuild_split, bench.pt_splits,
            bench.block_costs, a.batch, bench.plans))
    record = record_of(bench, speeds, steady, orders, extras)
    record.update({"peak_activation_bytes": {n: peak_bytes[n] for n in names if n in peak_bytes},
                   "peak_kept_bytes": {n: kept_bytes[n] for n in kept_bytes if n in names},
                   "base_rss_bytes": base_rss})
    if len(names) == 1:  # the process ran one contender: its high-water mark is that one's
        record["peak_rss_bytes"] = {names[0]: peak_rss}
    return record


def read_layout(a, world, work):
    """The layout of --layout (None without it); a file that is not one for this run ends it on
    every rank, in one line from rank 0, exit status 2."""
    if not a.layout:
        return None
    try:
        return peers_layout.read(a.layout, work, world.size)
    except peers_layout.LayoutError as e:
        if world.rank == 0:
            print(f"petra_mpi.bench peers: {e}", file=sys.stderr)
        raise SystemExit(2)


def record_of(bench, speeds, steady, orders, extras) -> dict:
    """The JSON record of a run (on rank 0): its settings, splits and plans, each contender's
    images/s per round and median, the ratios, and `extras` (the waterfall, the FLOPs)."""
    a, work, J = bench.a, bench.work, bench.world.size
    record = {"bench": "peers", "ranks": J, "threads": torch.get_num_threads(),
              "machine": machine(), "compile": a.compile,
              "transport": {"ours": "mpi" if a.transport == "mpi" else "gloo",
                            "pipelining": "gloo"},
              "model": work.arch, "plain_model": work.plain, **work.model_kw,
              "batch": a.batch, "width": work.width, "microbatches": a.microbatches,
              "accumulation": a.accumulation, "pt_microbatches": a.pt_microbatches,
              "rounds": a.rounds, "seed": a.seed, "orders": orders,
              "layout": a.layout, "partition": bench.sizes,
              "pt_partition": bench.pt_splits[work.plain][J],
              "pt_partition_rev": bench.pt_splits[work.arch][J],
              "pt_partition_two_per_rank": {net: s.get(2 * J)
                                            for net, s in bench.pt_splits.items()},
              "net": {name: bench.net_of[name] for name in speeds},
              "images_per_s": {n: statistics.median(v) for n, v in speeds.items()},
              "images_per_s_rounds": speeds,
              "steady_images_per_s": {n: statistics.median(v) for n, v in steady.items()},
              "steady_images_per_s_rounds": steady, **extras,
              "kept": {name: dict(entry) for name, entry in bench.plans.items()}}
    record.update(ratios(speeds, steady))
    if work.context:  # a language model: every window is context tokens
        record["tokens_per_s"] = {n: v * work.context
                                  for n, v in record["images_per_s"].items()}
        record["steady_tokens_per_s"] = {n: v * work.context
                                         for n, v in record["steady_images_per_s"].items()}
    if bench.skipped:
        record["skipped"] = {n: why for n, why in bench.skipped.items() if n in a.contenders}
    return record


def spread(values) -> dict:
    """{"median", "min", "max"} of `values`."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def ratios(speeds, steady) -> dict:
    """"{ours}_vs_{rival}": the median over the rounds of our images/s over a rival's in the
    same round (timed segments alike: fill and drain in ours), "steady_{ours}_vs_{rival}" with
    ours in steady state, and "ratios": each with its median, min and max; for every rival of
    RATIO_RIVALS that ran (the rival's name says which net)."""
    out, spreads = {}, {}
    for ours in RATIO_OURS:
        for rival in RATIO_RIVALS:
            if ours not in speeds or rival not in speeds:
                continue
            for key, mine in ((f"{ours}_vs_{rival}", speeds[ours]),
                              (f"steady_{ours}_vs_{rival}", steady.get(ours))):
                if mine:
                    spreads[key] = spread([m / r for m, r in zip(mine, speeds[rival])])
                    out[key] = spreads[key]["median"]
    out["ratios"] = spreads
    return out
