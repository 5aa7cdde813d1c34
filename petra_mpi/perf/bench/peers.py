"""Under `mpirun -n J`: PETRA against other pipeline-parallel trainers on the same ranks, alternated
in one run (round-robin over the contenders, medians of the rounds).

- petra, backprop: our MPI engine on RevNet18 (as `bench pipeline`), or with `--model revlm` on
  the reversible causal language model (configs/lm/shakespeare_cpu.yaml's size by default).
- gpipe, 1f1b, zero_bubble: torch.distributed.pipelining's ScheduleGPipe, Schedule1F1B and
  ScheduleInterleavedZeroBubble (one stage per rank) on the plain twin of the same width
  (ResNet18, or the plain transformer `lm`), split by its own measured block costs, over gloo.
- 1f1b_checkpointed: Schedule1F1B with torch.utils.checkpoint around every block.
- petra_budget_1f1b, petra_unlimited: PETRA with kept blocks (model.memory_budget,
  memory_plan.py) at a budget per rank of 1F1B's peak activation bytes there (less PETRA's own),
  and without a limit; each on the split training would choose for its budget (the measured
  balance redone with the plan's costs) unless --partition fixes it.

Every contender updates its weights once per K x micro-batch images (K = --accumulation, 4 by
default: the paper's CIFAR-10 recipe, micro-batch 64 and k = 4): PETRA and backprop accumulate K
micro-batches, a torch.distributed.pipelining step runs K micro-batches (at least J, which 1F1B
needs; --pt-microbatches overrides). Each update is SGD (momentum 0.9, Nesterov). Images/s
come from timed passes; activation memory from one separate untimed pass per contender (docs/peers.md
says how it is counted)."""
import argparse
import contextlib
import datetime
import socket
import statistics
import time
import weakref
from dataclasses import dataclass
from itertools import chain

import torch
import torch.nn.functional as F
import torch.utils.checkpoint as cp
from torch import nn

from ...engines.build import build_engine, build_stages, build_workers
from ...core.worker import WorkerHooks
from ...comm.world import World
from ...models import build_blocks
from ...core.optim import constant_lr
from ...core.partition import resolve_partition, split_blocks
from ...core.schedule import Kind
from .common import emit, random_batch


class SampleAfterForward(WorkerHooks):
    """Samples `meter` (when set) after each forward: the FIFO is at its fullest then."""
    meter = None

    def after(self, worker, action, x=None):
        if self.meter is not None and action.kind is Kind.FORWARD:
            self.meter.sample()

LR, MOMENTUM = 0.01, 0.9
ZERO_BUBBLE = "zero_bubble"


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

    def stages(self, J, **kw):
        return build_stages(self.arch, self.width, self.num_classes, J, seed=0,
                            model_kw=self.model_kw, **kw)

    def zeros(self, n):
        return (torch.zeros(n, self.context, dtype=torch.long) if self.context
                else torch.zeros(n, *self.input_shape))

    def batch(self, n, g):
        """(inputs, labels) of n random samples."""
        return random_batch(n, self.num_classes, g, self.context)


# ---------------------------------------------------------------------------------------------
# Activation memory: live bytes of tensors saved for backward plus tensors stored explicitly.

def _span(t):
    """(storage pointer, first byte, end byte) of the memory a tensor view reaches."""
    if t.numel() == 0:
        return None
    size = t.element_size()
    first = t.storage_offset() * size
    reach = 1 + sum((n - 1) * abs(st) for n, st in zip(t.shape, t.stride()))
    return t.untyped_storage().data_ptr(), first, first + reach * size


def _union_bytes(intervals) -> int:
    total, end = 0, -1
    for a, b in sorted(intervals):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


class _Saved:
    """What autograd keeps instead of a saved tensor while the meter is on; its death (the graph
    freed) releases the count."""
    __slots__ = ("t", "meter", "span", "__weakref__")

    def __init__(self, meter, span, t):
        self.t, self.meter, self.span = t, meter, span

    def __del__(self):
        self.meter.release(self.span)


class ActivationMeter:
    """Peak over time of the bytes held for backward: the memory reached by every tensor saved
    by autograd (through saved_tensors_hooks) or held explicitly (`explicit()`: PETRA's FIFOs,
    pipelining's stage inputs/outputs of in-flight micro-batches), while alive, each byte once
    (the union of the views' byte ranges per storage: aliases and views count once, a slice
    of a bigger tensor counts its slice). Storages of the module's parameters and buffers are
    not activations and are skipped. `extra()`: bytes counted otherwise (a Stage's kept graphs,
    whose saved tensors its own hooks record)."""

    def __init__(self, module, explicit=lambda: (), extra=lambda: 0):
        self.skip = {t.untyped_storage().data_ptr()
                     for t in chain(module.parameters(), module.buffers())}
        self.live = {}  # span -> references
        self.explicit, self.extra, self.peak = explicit, extra, 0

    def add(self, t):
        span = _span(t)
        if span is None or span[0] in self.skip:
            return None
        self.live[span] = self.live.get(span, 0) + 1
        return span

    def release(self, span):
        if span in self.live:
            self.live[span] -= 1
            if self.live[span] == 0:
                del self.live[span]

    def current(self) -> int:
        spans = set(self.live)
        for t in self.explicit():
            span = _span(t)
            if span is not None and span[0] not in self.skip:
                spans.add(span)
        per_storage = {}
        for ptr, a, b in spans:
            per_storage.setdefault(ptr, []).append((a, b))
        return sum(_union_bytes(v) for v in per_storage.values()) + self.extra()

    def sample(self):
        self.peak = max(self.peak, self.current())

    def pack(self, t):
        span = self.add(t)
        if span is None:
            return t
        self.sample()
        return _Saved(self, span, t)

    @staticmethod
    def unpack(p):
        return p.t if isinstance(p, _Saved) else p

    def hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)


@contextlib.contextmanager
def counting_recomputation(meter):
    """torch.utils.checkpoint keeps a block's recomputed tensors outside the saved-tensor hooks
    of the caller (its own hooks are innermost); count them too, so that the checkpointed
    contender pays for its recomputation as PETRA pays for its own."""
    original = cp._recomputation_hook

    class Counting(original):
        def __init__(self, *args):
            super().__init__(*args)
            inner = self.pack_hook

            def pack(x):
                # a fresh tensor object (same memory) is what checkpoint keeps, so that its
                # death marks the end of the recomputed tensor's use
                y = x.detach()
                inner(y)
                span = meter.add(y)
                if span is not None:
                    meter.sample()
                    weakref.finalize(y, meter.release, span)
                return y
            self.pack_hook = pack

    cp._recomputation_hook = Counting
    try:
        yield
    finally:
        cp._recomputation_hook = original


# ---------------------------------------------------------------------------------------------
# torch.distributed.pipelining contenders

def init_gloo(world):
    """torch.distributed over gloo with MPI's ranks: rank 0 picks a free port for the TCP store
    on 127.0.0.1 (one node) and tells the others over MPI."""
    import torch.distributed as dist
    if world.local_size != world.size:
        raise SystemExit("bench peers runs on one node (the TCP store is on 127.0.0.1)")
    port = None
    if world.rank == 0:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
    port = world.comm.bcast(port, root=0)
    store = dist.TCPStore("127.0.0.1", port, world.size, world.rank == 0,
                          timeout=datetime.timedelta(seconds=300))
    dist.init_process_group("gloo", store=store, rank=world.rank, world_size=world.size)
    return dist


class PTStage(nn.Module):
    """One rank's consecutive blocks; with `checkpointed`, each block under
    torch.utils.checkpoint (non-reentrant): only block inputs are kept, each block is recomputed
    in backward."""

    def __init__(self, blocks, checkpointed=False):
        super().__init__()
        self.blocks, self.checkpointed = nn.ModuleList(blocks), checkpointed

    def forward(self, x):
        for b in self.blocks:
            if self.checkpointed and torch.is_grad_enabled():
                x = cp.checkpoint(b, x, use_reentrant=False)
            else:
                x = b(x)
        return x


def _loss(logits, target):
    return F.cross_entropy(logits, target)


class PTContender:
    def __init__(self, name, schedule_cls, multi, checkpointed, a, world, sizes, work):
        from torch.distributed.pipelining import PipelineStage
        r, J = world.rank, world.size
        torch.manual_seed(0)
        blocks = work.blocks(work.plain)
        start = sum(sizes[:r])
        with torch.no_grad():  # shapes of this rank's micro-batch input and output
            x = work.zeros(a.batch)
            for i, b in enumerate(blocks[:start + sizes[r]]):
                b.eval()
                if i == start:
                    x_in = x
                x = b(x)
                b.train()
        self.module = PTStage(split_blocks(blocks, sizes)[r], checkpointed)
        self.stage = PipelineStage(self.module, r, J, torch.device("cpu"),
                                   # the metadata says which gradients travel: a received
                                   # input's and every output's
                                   input_args=torch.empty_like(x_in).requires_grad_(
                                       r > 0 and x_in.is_floating_point()),
                                   output_args=torch.empty_like(x).requires_grad_())
        self.schedule = schedule_cls([self.stage] if multi else self.stage, a.pt_microbatches,
                                     loss_fn=_loss)
        self.opt = torch.optim.SGD(self.module.parameters(), lr=LR, momentum=MOMENTUM,
                                   nesterov=True)
        self.name, self.checkpointed, self.world = name, checkpointed, world

    def step(self, x, labels):
        r, J = self.world.rank, self.world.size
        if r == 0:
            self.schedule.step(x, return_outputs=False)
        elif r == J - 1:
            self.schedule.step(target=labels, return_outputs=False)
        else:
            self.schedule.step(return_outputs=False)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)

    def measure(self, x, labels) -> int:
        def explicit():
            for outputs, inputs in self.stage.fwd_cache.values():
                yield from (t for t in chain(outputs, inputs) if isinstance(t, torch.Tensor))
        meter = ActivationMeter(self.module, explicit)
        recount = counting_recomputation(meter) if self.checkpointed else contextlib.nullcontext()
        with meter.hooks(), recount:
            self.step(x, labels)
        return meter.peak


# ---------------------------------------------------------------------------------------------

def main(argv):
    a = parse_args(argv)
    report(a, run(a))


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
    p.add_argument("--threads", type=int, default=0, help="torch threads per rank (0: share)")
    p.add_argument("--no-zero-bubble", action="store_true", help="skip the zero-bubble schedule")
    p.add_argument("--partition", type=_split_arg, metavar="A,B,...",
                   help="blocks per stage of the reversible net (default: by measured costs)")
    p.add_argument("--pt-partition", type=_split_arg, metavar="A,B,...",
                   help="blocks per stage of the plain twin (default: by measured costs)")
    a = p.parse_args(argv)
    if a.accumulation < 1:
        p.error("--accumulation must be at least 1")
    return a


def _split_arg(text):
    return [int(n) for n in text.split(",")]


def measured_splits(a, world, work):
    """(reversible net's split, plain twin's split, the reversible net's measured BlockCosts):
    each net split by its own measured block costs, as a user would balance it (training's
    default for ours; for the twin the autograd costs that pipelining runs); None for either
    split when there is one block per stage. --partition and --pt-partition, when both are
    given, replace the measurement (the memory a contender holds depends on its split). The
    costs: on rank 0, where the kept plans are made, and only when our split was measured."""
    J = world.size
    if a.partition and a.pt_partition:
        return a.partition, a.pt_partition, None
    measured, costs = None, None
    plain = work.blocks(work.plain)
    if world.rank == 0 and J < len(plain):
        from ...core.blockcost import measure_autograd_costs, measured_partition
        petra_split, costs = measured_partition(work.arch, work.width, work.num_classes, J,
                                                work.input_shape, a.batch, time_kept=True,
                                                **work.model_kw)
        measured = (petra_split, resolve_partition(
            plain, J, costs=measure_autograd_costs(plain, work.input_shape, a.batch,
                                                   work.num_classes)))
    petra_split, pt_split = world.comm.bcast(measured, root=0) or (None, None)
    return petra_split, pt_split, None if a.partition else costs


def pipelining_contenders(a, world, pt_sizes, work):
    """({name: PTContender}, {name: why it did not build}); a contender that fails to build on
    any rank is dropped on every rank, so no rank waits on a schedule the others skip."""
    from torch.distributed.pipelining import (Schedule1F1B, ScheduleGPipe,
                                              ScheduleInterleavedZeroBubble)
    specs = [("gpipe", ScheduleGPipe, False, False), ("1f1b", Schedule1F1B, False, False),
             ("1f1b_checkpointed", Schedule1F1B, False, True)]
    if not a.no_zero_bubble:
        specs.append((ZERO_BUBBLE, ScheduleInterleavedZeroBubble, True, False))
    pts, skipped = {}, {}
    for name, cls, multi, ckpt in specs:
        try:
            pts[name] = PTContender(name, cls, multi, ckpt, a, world, pt_sizes, work)
            err = None
        except Exception as e:  # noqa: BLE001 - reported, the others still run
            err = f"{type(e).__name__}: {e}".splitlines()[0]
        errors = [e for e in world.comm.allgather(err) if e]
        if errors:
            pts.pop(name, None)
            skipped[name] = errors[0]
    return pts, skipped


class PeersBench:
    """Every contender on this rank: PETRA and backprop on one stage of the reversible net, the
    torch.distributed.pipelining schedules on one stage of its plain twin, and the data they
    train on."""

    def __init__(self, a, world, work):
        self.a, self.world, self.work = a, world, work
        J = world.size
        self.M = a.pt_microbatches
        petra_split, pt_split, self.costs = measured_splits(a, world, work)
        (self.stage,) = work.stages(J, only=world.rank, partition=a.partition or petra_split)
        self.sizes = self.stage.partition
        self.pt_sizes = (a.pt_partition or pt_split
                         or resolve_partition(work.blocks(work.plain), J))
        self.sampler = SampleAfterForward()
        # our contenders: name -> (engine, its stage on this rank, the stage's kept plan: None,
        # PETRA as in the paper)
        self.variants = {m: (engine, self.stage, None)
                         for m, engine in self.engines_on(self.stage, "petra", "backprop")}
        # kept variant -> (memory_plan.Plan, kept budget per rank or None, its split, the
        # planner's time over PETRA's on PETRA's split)
        self.plans = {}
        self.pts, self.skipped = pipelining_contenders(a, world, self.pt_sizes, work)
        g = torch.Generator().manual_seed(0)
        self.data = [work.batch(a.batch, g) for _ in range(max(4, self.M))]
        self.full_x = torch.cat([d[0] for d in self.data[:self.M]])
        self.full_y = torch.cat([d[1] for d in self.data[:self.M]])
        self.pt_steps = max(1, round(a.microbatches / self.M))

    def engines_on(self, stage, *methods):
        """(method, our engine of that method over `stage`) for each of `methods`."""
        workers = build_workers([stage], constant_lr(LR), self.a.accumulation,
                                momentum=MOMENTUM, hooks=[self.sampler])
        return [(m, build_engine(workers, m, self.world, self.work.input_shape, self.a.batch,
                                 labels_per_sample=self.work.labels_per_sample))
                for m in methods]

    def names(self):
        return [*self.variants, *self.pts]

    def petra_run(self, name, n):
        """Images trained by one segment of n micro-batches of our engine, with the variant's
        kept plan (the stage holds nothing between segments, so the plan may change)."""
        engine, stage, kept = self.variants[name]
        stage.set_kept(kept)
        batches = ((self.data[i % len(self.data)] for i in range(n)) if self.world.rank == 0
                   else None)
        engine.train_segment(batches, n)
        return n * self.a.batch

    def add_kept_variants(self, peaks):
        """PETRA with kept blocks, planned as training plans them: at a budget per rank of
        1F1B's peak activation bytes less PETRA's own there (`peaks`: per contender and rank,
        on rank 0), so that PETRA holds at most what 1F1B holds, and without a limit. Where our
        split was measured, each variant's split is the measured balance redone with its plan's
        costs (memory_plan.split_for_budget, as model.balance: measure does), and a variant
        whose split differs runs on stages of its own. The plans are made on rank 0 on a fresh
        copy of the net and sent to every rank."""
        from ...core.memory_plan import AUTO, measured_units, plan_blocks, split_for_budget
        a, world, work = self.a, self.world, self.work
        plans = None
        if world.rank == 0:
            budgets = {"petra_unlimited": None}
            if "1f1b" in peaks:
                budgets["petra_budget_1f1b"] = [max(0, f - p) for f, p in
                                                zip(peaks["1f1b"], peaks["petra"])]
            where = {"image_size": work.input_shape[-1]}
            units = None if self.costs is None else measured_units(self.costs)
            # the planner's time of PETRA on its own split: what each plan is set against
            petra = max(plan_blocks(work.blocks(work.arch), self.sizes, 0, a.batch,
                                    units=units, **where).units)
            plans = {}
            for name, budget in sorted(budgets.items()):
                budget = AUTO if budget is None else budget
                blocks = work.blocks(work.arch)
                if self.costs is None:
                    split = self.sizes
                    plan = plan_blocks(blocks, split, budget, a.batch, **where)
                else:
                    split, plan = split_for_budget(blocks, self.sizes, budget, a.batch,
                                                   costs=self.costs, **where)
                plans[name] = (plan, budgets[name], split, max(plan.units) / petra)
        self.plans = world.comm.bcast(plans, root=0)
        for name, (plan, _, split, _) in self.plans.items():
            engine, stage, _ = self.variants["petra"]
            if split != self.sizes:
                (stage,) = work.stages(world.size, only=world.rank, partition=split)
                ((_, engine),) = self.engines_on(stage, "petra")
            self.variants[name] = (engine, stage, plan.kept[world.rank])
        return list(self.plans)

    def pt_run(self, name, steps):
        """Images trained by `steps` steps of a pipelining schedule."""
        for _ in range(steps):
            self.pts[name].step(self.full_x, self.full_y)
        return steps * self.M * self.a.batch

    def timed_run(self, name):
        """images/s of one timed segment of a contender, between barriers."""
        self.world.comm.Barrier()
        start = time.perf_counter()
        if name in self.variants:
            images = self.petra_run(name, self.a.microbatches)
        else:
            images = self.pt_run(name, self.pt_steps)
        self.world.comm.Barrier()
        return images / (time.perf_counter() - start)

    def images_per_s(self) -> dict:
        """Median images/s of each contender over a.rounds round-robin rounds, after a warm-up
        (a failing zero-bubble step would leave the other ranks waiting in gloo, so a schedule
        that raises here ends the run with its error)."""
        for name in self.variants:
            self.petra_run(name, self.world.size + 2)
        for n in self.pts:
            self.pt_run(n, 1)
        speeds = {name: [] for name in self.names()}
        for _ in range(self.a.rounds):
            for name in speeds:
                speeds[name].append(self.timed_run(name))
        return {name: statistics.median(v) for name, v in speeds.items()}

    def peak_bytes(self, names) -> tuple:
        """(peak activation bytes, peak bytes of kept graphs) of each of `names` from one
        untimed pass with the hooks on; per rank, gathered on rank 0. Ours count their FIFOs,
        what autograd saves and their kept graphs (Stage.kept_bytes: activations, stashed
        weights, inputs), together at every sample."""
        comm, peaks, kept = self.world.comm, {}, {}
        for m in [n for n in names if n in self.variants]:
            stage = self.variants[m][1]
            meter = ActivationMeter(stage, lambda s=stage: (t for f in s.fifos for t in f),
                                    extra=lambda s=stage: s.kept_bytes)
            self.sampler.meter = meter
            stage.reset_peaks()
            try:
                with meter.hooks():
                    comm.Barrier()
                    self.petra_run(m, self.a.microbatches)
            finally:
                self.sampler.meter = None
            peaks[m], kept[m] = meter.peak, stage.peak_kept_bytes
        for n in [n for n in names if n in self.pts]:
            comm.Barrier()
            peaks[n] = self.pts[n].measure(self.full_x, self.full_y)
        return ({name: comm.gather(peaks[name], root=0) for name in names},
                {name: comm.gather(kept[name], root=0) for name in kept})


def run(a):
    """Time and measure every contender on every rank; the JSON record on rank 0, else None."""
    world = World.from_environment()
    if world is None:
        raise SystemExit("run under mpirun with at least 2 ranks")
    torch.set_num_threads(a.threads or world.thread_share())
    a.pt_microbatches = a.pt_microbatches or max(a.accumulation, world.size)
    dist = init_gloo(world)
    work = Workload.from_args(a)
    bench = PeersBench(a, world, work)
    # the contenders' memory first: PETRA's kept budget comes from 1F1B's
    peak_bytes, kept_bytes = bench.peak_bytes(bench.names())
    kept_names = bench.add_kept_variants(peak_bytes)
    images_per_s = bench.images_per_s()
    more_peaks, more_kept = bench.peak_bytes(kept_names)
    peak_bytes.update(more_peaks)
    kept_bytes.update(more_kept)
    dist.destroy_process_group()
    if world.rank != 0:
        return None
    record = {"bench": "peers", "ranks": world.size, "threads": torch.get_num_threads(),
              "model": work.arch, "plain_model": work.plain, **work.model_kw,
              "batch": a.batch, "width": work.width, "microbatches": a.microbatches,
              "accumulation": a.accumulation, "pt_microbatches": a.pt_microbatches,
              "partition": bench.sizes, "pt_partition": bench.pt_sizes,
              "images_per_s": images_per_s,
              "peak_activation_bytes": {name: peak_bytes[name] for name in images_per_s},
              "peak_kept_bytes": kept_bytes,
              "kept": {name: {"budget_bytes": budget, "plan": plan.kept,
                              "planned_kept_bytes": plan.kept_bytes,
                              "planned_relative_time": relative, "partition": split}
                       for name, (plan, budget, split, relative) in bench.plans.items()}}
    for other in ("1f1b", "1f1b_checkpointed"):
        if other in images_per_s:
            record[f"petra_vs_{other}"] = images_per_s["petra"] / images_per_s[other]
            if "petra_budget_1f1b" in images_per_s:
                record[f"petra_budget_1f1b_vs_{other}"] = (images_per_s["petra_budget_1f1b"] /
                                                          images_per_s[other])
    if work.context:  # a language model: every window is context tokens
        record["tokens_per_s"] = {n: v * work.context for n, v in images_per_s.items()}
    if bench.skipped:
        record["skipped"] = bench.skipped
    return record


def report(a, r):
    """The table on rank 0, then the JSON line (nothing on the other ranks)."""
    if r is None:
        return
    mib, M = 2.0 ** 20, r["pt_microbatches"]
    net, plain = r["model"], r["plain_model"]
    unit = "tokens/s" if "tokens_per_s" in r else "images/s"
    speeds = r.get("tokens_per_s", r["images_per_s"])
    print(f"width {r['width']}, micro-batch {a.batch}, {r['ranks']} ranks x {r['threads']} "
          f"threads, median of {a.rounds} alternated rounds")
    print(f"petra/backprop: {net}, {a.microbatches} micro-batches per timed segment (fill "
          f"and drain included), k = {a.accumulation}; pipelining: {plain}, {M} micro-batches "
          f"per step, {max(1, round(a.microbatches / M))} step(s) per timed segment; blocks per "
          f"stage: {net} {r['partition']}, {plain} {r['pt_partition']}")
    # a cluster sizes every GPU for the rank that holds most: the fullest rank first
    print(f"{'contender':<18} {unit:>9}  {'fullest':>8}  peak activation MiB per rank")
    for name, speed in speeds.items():
        held = r["peak_activation_bytes"][name]
        per_rank = " ".join(f"{b / mib:8.2f}" for b in held)
        print(f"{name:<18} {speed:>9.1f}  {max(held) / mib:8.2f}  {per_rank}")
    for name, why in r.get("skipped", {}).items():
        print(f"{name:<18} did not run: {why}")
    for name, k in r["kept"].items():
        budget = ("no limit" if k["budget_bytes"] is None else "budget " + " ".join(
            f"{b / mib:.2f}" for b in k["budget_bytes"]) + " MiB per rank")
        print(f"{name}: blocks per stage {k['partition']}, kept graphs ({budget}) per stage "
              f"{k['plan']}, peak kept MiB per rank "
              f"{' '.join(f'{b / mib:.2f}' for b in r['peak_kept_bytes'][name])}; planned "
              f"time {k['planned_relative_time']:.3f} of PETRA's on its split")
    for other in ("1f1b", "1f1b_checkpointed"):
        for ours in ("petra", "petra_budget_1f1b"):
            if f"{ours}_vs_{other}" in r:
                print(f"{ours} / {other}: {r[f'{ours}_vs_{other}']:.2f} ({unit})")
    emit(r)
