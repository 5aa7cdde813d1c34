"""Under `mpirun -n J`: an emulated pipeline of J stages with real messages. Every rank runs the
real engine and transport (PETRA and backprop: our MPI engine; gpipe, 1f1b, zero_bubble:
torch.distributed.pipelining over gloo) on stand-in stages whose compute is a wait of its cost
(petra_mpi/perf/emulation.py) and whose outputs have the real shapes, so J = 10 or 18 ranks run on a
few cores. Costs: `--costs paper` (derived from the paper's Table 5), `measured` (this machine's
per-block costs) or a JSON file. Methods alternate in rounds, for m micro-batches per step (PETRA:
accumulation k = m). Reports images/s, each rank's busy fraction and peak held activations, the
performance model's prediction beside each run, and the emulation's own overhead (the same runs
at zero cost); `--real` (J = 2, measured costs) also times the real stages to validate the
emulation. `python -m petra_mpi.bench emulate --plot A.json B.json ...` draws images/s against
J per method from the last lines of several runs.

Throughput against memory: PETRA also runs with kept blocks (model.memory_budget, memory_plan.py)
at a budget per rank equal to each contender's peak held bytes on that rank, and without a limit
(`--budgets`); the emulated stages follow the plan (a kept micro-batch skips its rebuild and
holds its graph's bytes, probed on the real stages). `--pareto FILE.png` draws images/s against
the peak held bytes per rank (the largest over the ranks) of every run, the Pareto front marked."""
import argparse
import os
import statistics
import sys
import time
from dataclasses import replace

import torch

from .. import model as perfmodel
from ..emulation import (Clock, WaitingOptimizer, WaitingPlainStage, WaitingStage,
                         balanced_profile, fifo_bytes, file_profile, kept_plan, kept_sizes,
                         measured_profile, paper_profile, probe_shapes)
from ...core.worker import StageWorker
from ...engines.build import build_engine
from ...models import NetSpec, build_blocks
from ...core.planner import Layout, plan_layout
from ...core.schedule import PetraSchedule
from .common import emit, last_json_line, measure_link, sleeping_barrier

PETRA_METHODS = ("petra", "backprop")
PIPELINING = ("gpipe", "1f1b", "zero_bubble", "1f1b_checkpointed")
UNLIMITED = "unlimited"
ZERO_COST_REPEATS = 5


def step_counts(spec, J):
    """The m values of `--microbatches` ("4,2J,8J" style)."""
    out = []
    for item in spec.split(","):
        item = item.strip().upper()
        out.append(int(item[:-1] or 1) * J if item.endswith("J") else int(item))
    return sorted(set(out))


def pipelining_orders(schedule, method, J, m):
    """Each rank's operations in one step of a torch.distributed.pipelining schedule, for the
    performance model (zero bubble: the schedule's own plan)."""
    if method == "gpipe":
        return perfmodel.gpipe_order(J, m)
    if method in ("1f1b", "1f1b_checkpointed"):
        return perfmodel.one_f_one_b_order(J, m)
    names = {"F": "forward", "I": "backward_input", "W": "backward_weight", "B": "backward",
             "FULL_BACKWARD": "backward", "FORWARD": "forward", "BACKWARD_INPUT": "backward_input",
             "BACKWARD_WEIGHT": "backward_weight"}
    orders = []
    for rank in range(J):
        order = []
        for action in schedule.pipeline_order[rank]:
            if action is None:
                continue
            kind = str(action.computation_type).split(".")[-1]
            order.append((names[kind], action.microbatch_index))
        orders.append(order + [("step", m)])
    return orders


def main(argv):
    a = parse_args(argv)
    if a.plot:
        plot(a.plot, a.png or "runs/bench/emulate.png")
        if a.pareto:
            plot_pareto(last_json_line(a.plot[-1]), a.pareto)
        return
    report(a, run(a))


def parse_args(argv):
    p = argparse.ArgumentParser(prog="mpirun -n J python -m petra_mpi.bench emulate",
                                description=__doc__)
    p.add_argument("--arch", default="revnet18", help="revnet18 or revnet34 (the paper's)")
    p.add_argument("--costs", default="paper",
                   help="paper (Table 5), balanced (its total work, every block the same), "
                        "measured, or a JSON profile file")
    p.add_argument("--cost-scale", type=float, default=1.0,
                   help="multiply every cost of the profile (more compute per operation next to "
                        "what this machine spends on each; the framework costs stay)")
    p.add_argument("--width", type=int, default=8, help="of the messages (and measured costs)")
    p.add_argument("--batch", type=int, default=16, help="of the messages (and measured costs)")
    p.add_argument("--microbatches", default="4,2J,8J", help="m values: micro-batches per step")
    p.add_argument("--segment", type=int, default=0,
                   help="micro-batches per PETRA segment (0: max(4J, m))")
    p.add_argument("--backprop-segment", type=int, default=4,
                   help="micro-batches per backprop segment (0: skip backprop)")
    p.add_argument("--methods", default="petra,gpipe,1f1b,zero_bubble,1f1b_checkpointed",
                   help="of petra, gpipe, 1f1b, zero_bubble, 1f1b_checkpointed (activation "
                        "checkpointing around every block) (backprop: --backprop-segment)")
    p.add_argument("--budgets", default="all",
                   help="PETRA with kept blocks at a memory budget per rank equal to the peak "
                        "held bytes of each run of these methods (all: every pipelining method "
                        "run), and 'unlimited'; '' for none")
    p.add_argument("--rounds", type=int, default=1, help="alternated rounds of every run")
    p.add_argument("--poll-sleep", type=float, default=0.0005,
                   help="seconds a waiting rank sleeps between tests of its requests")
    p.add_argument("--framework", metavar="JSON",
                   help="take the pipelines' framework costs (and ours, without backprop) from "
                        "this earlier run's last line (e.g. J = 2, where the zero-cost runs do "
                        "not crowd the cores) instead of this run's")
    p.add_argument("--real", action="store_true",
                   help="also time the real stages (J = 2 with --costs measured: validation)")
    p.add_argument("--png", default="", help="draw this run's images/s per method")
    p.add_argument("--plot", nargs="+", metavar="JSON",
                   help="no run: draw images/s vs J from these files' last JSON lines to --png "
                        "(and the last file's throughput against memory to --pareto)")
    p.add_argument("--pareto", default="", metavar="PNG",
                   help="draw images/s against peak held bytes per rank, Pareto front marked")
    a = p.parse_args(argv)
    if not a.cost_scale > 0:
        p.error(f"--cost-scale must be above 0, got {a.cost_scale:g}")
    if a.real and a.cost_scale != 1:
        p.error("--real times the real stages against their own measured costs: no --cost-scale")
    return a


def shared_profile(a, world):
    """The cost profile, built on rank 0 (measuring takes a while) and sent to every rank."""
    profile = None
    if world.rank == 0:
        profile = (paper_profile(a.arch) if a.costs == "paper" else
                   balanced_profile(a.arch) if a.costs == "balanced" else
                   measured_profile(a.arch, a.width, a.batch) if a.costs == "measured" else
                   file_profile(a.costs)).scaled(a.cost_scale)
    # the others sleep meanwhile: a rank spinning in MPI's Bcast would take a core from rank 0
    # while it times the blocks
    sleeping_barrier(world, a.poll_sleep)
    return world.bcast(profile)


class Emulation:
    """This rank's waiting stages, the runs (name, method, m) over them, and their timing.
    PETRA and backprop: the real worker and MPI engine on a waiting stage; pipelining: its
    schedules on waiting stages of the plain network."""

    def __init__(self, a, world):
        self.a, self.world = a, world
        r, J = world.rank, world.size
        self.methods = [m for m in a.methods.split(",") if m]
        unknown = set(self.methods) - {"petra", *PIPELINING}
        if unknown:
            raise SystemExit(f"unknown --methods {sorted(unknown)}")
        self.ms = step_counts(a.microbatches, J)
        self.profile = profile = shared_profile(a, world)
        self.shapes = probe_shapes(profile.arch, a.width)
        self.out_bytes = [4 * a.batch * torch.Size(s).numel() for s in self.shapes.outputs]
        in_bytes = 4 * a.batch * 3 * 32 * 32
        self.petra_bc = profile.petra_costs(self.out_bytes, in_bytes)
        self.plain_bc = profile.plain_costs(self.out_bytes, in_bytes)
        blocks = build_blocks(profile.arch, a.width, 10)
        if J > len(blocks):
            raise SystemExit(f"{profile.arch} has {len(blocks)} blocks: at most {len(blocks)} "
                             f"ranks")
        net = NetSpec(profile.arch, a.width, 10)
        self.sizes = plan_layout(net, J, costs=self.petra_bc).split
        self.plain_sizes = plan_layout(net, J, costs=self.plain_bc).split
        plain_first = sum(self.plain_sizes[:r])
        self.plain_mine = list(range(plain_first, plain_first + self.plain_sizes[r]))
        self.clock = Clock()
        self.build_petra()
        self.segment_of = {m: a.segment or max(4 * J, m) for m in self.ms}
        self.runs = []  # (name, method, m)
        if "petra" in self.methods:
            self.runs += [(f"petra m={m}", "petra", m) for m in self.ms]
        if a.backprop_segment:
            self.runs.append(("backprop", "backprop", a.backprop_segment))
        self.pt, self.skipped = {}, {}
        if set(self.methods) & set(PIPELINING):
            self.build_pipelining()
            self.runs += [(name, method, m) for name, (_, _, method, m) in self.pt.items()]
        # PETRA with kept blocks (add_budget_runs below): run name -> (memory_plan.Plan, the budget
        # per rank in held bytes, None: unlimited, and the run it comes from)
        self.plans = {}
        self.block_kept_bytes = None  # per stage, per block: bytes of one kept micro-batch
        self.block_shared = None  # per stage: what its blocks' kept graphs share

    def build_petra(self):
        a, r, J, bc = self.a, self.world.rank, self.world.size, self.petra_bc
        first = sum(self.sizes[:r])
        mine = range(first, first + self.sizes[r])
        self.stage = WaitingStage(r, J, self.shapes, first,
                                  [(bc.forward[b], bc.backward[b], bc.last[b]) for b in mine],
                                  a.batch, clock=self.clock,
                                  rebuild=[self.profile.rebuild[b] for b in mine])
        self.worker = StageWorker(self.stage,
                                  WaitingOptimizer(sum(bc.step[b] for b in mine), self.clock))
        self.engines = {m: build_engine([self.worker], m, self.world, (3, 32, 32), a.batch,
                                        poll_sleep=a.poll_sleep) for m in PETRA_METHODS}
        self.x0 = torch.zeros(a.batch, 3, 32, 32)
        self.y0 = torch.zeros(a.batch, dtype=torch.int64)

    def build_pipelining(self):
        """One schedule per pipelining method and m; one that fails to build on any rank is
        dropped on every rank, so no rank waits on a schedule the others skip."""
        self.world.torch_distributed()
        from torch.distributed.pipelining import (Schedule1F1B, ScheduleGPipe,
                                                  ScheduleInterleavedZeroBubble)
        classes = {"gpipe": (ScheduleGPipe, False), "1f1b": (Schedule1F1B, False),
                   "zero_bubble": (ScheduleInterleavedZeroBubble, True),
                   "1f1b_checkpointed": (Schedule1F1B, False)}
        for method in [m for m in self.methods if m in PIPELINING]:
            cls, multi = classes[method]
            for m in self.ms:
                name = f"{method} m={m}"
                err = None
                try:
                    module, schedule = self.pipelining_schedule(
                        cls, multi, m, checkpointed=method == "1f1b_checkpointed")
                except Exception as e:  # noqa: BLE001 - reported, the others still run
                    err = f"{type(e).__name__}: {e}".splitlines()[0]
                errors = [e for e in self.world.allgather(err) if e]
                if errors:
                    self.skipped[name] = errors[0]
                    continue
                self.pt[name] = (module, schedule, method, m)
        self.pt_x = {m: torch.zeros(m * self.a.batch, 3, 32, 32) for m in self.ms}
        self.pt_y = {m: torch.zeros(m * self.a.batch, dtype=torch.int64) for m in self.ms}

    def pipelining_schedule(self, cls, multi, m, checkpointed=False):
        """(this rank's waiting plain stage, a `cls` schedule of m micro-batches over it)."""
        from torch.distributed.pipelining import PipelineStage
        r, J, bc, mine = self.world.rank, self.world.size, self.plain_bc, self.plain_mine
        weight = [self.profile.weight[b] if b > 0 else bc.backward[b]
                  for b in mine]  # stage 0 computes no input gradient
        module = WaitingPlainStage(self.shapes, mine, sum(bc.forward[b] for b in mine),
                                   sum(bc.backward[b] for b in mine), sum(weight), self.a.batch,
                                   self.clock, checkpointed=checkpointed)
        ps = PipelineStage(module, r, J, torch.device("cpu"),
                           input_args=torch.zeros(module.in_shape).requires_grad_(r > 0),
                           output_args=torch.zeros(module.out_shape).requires_grad_())
        return module, cls([ps] if multi else ps, m, loss_fn=_loss)

    def petra_run(self, method, n, k):
        self.worker.accumulate_over(k)
        batches = ((self.x0, self.y0) for _ in range(n)) if self.world.rank == 0 else None
        self.stage.forward_starts.clear()
        self.engines[method].train_segment(batches, n)
        return n

    def pt_run(self, name):
        module, schedule, method, m = self.pt[name]
        r, J = self.world.rank, self.world.size
        if r == 0:
            schedule.step(self.pt_x[m], return_outputs=False)
        elif r == J - 1:
            schedule.step(target=self.pt_y[m], return_outputs=False)
        else:
            schedule.step(return_outputs=False)
        self.clock.wait(sum(self.plain_bc.step[b] for b in self.plain_mine))  # optimizer step
        return m

    def holder(self, name):
        """The waiting stage that counts run `name`'s held bytes on this rank."""
        return self.pt[name][0] if name in self.pt else self.stage

    def run_once(self, name, method, m):
        """One step (pipelining) or segment (ours) of a run: the micro-batches it did."""
        if method in PETRA_METHODS:  # its kept plan (none: PETRA as in the paper)
            r, plan = self.world.rank, self.plans.get(name)
            self.stage.set_kept(*((plan[0].kept[r], self.block_kept_bytes[r],
                                   self.block_shared[r]) if plan else ()))
        if method == "petra":
            return self.petra_run("petra", self.segment_of[m], m)
        if method == "backprop":
            return self.petra_run("backprop", m, m)
        return self.pt_run(name)

    def timed(self, fn, *args):
        """(what fn returned, wall seconds, emulated busy seconds, CPU seconds) of fn(*args)."""
        sleeping_barrier(self.world, self.a.poll_sleep)
        busy, cpu, start = self.clock.busy, time.process_time(), time.perf_counter()
        count = fn(*args)
        busy = self.clock.busy - busy
        sleeping_barrier(self.world, self.a.poll_sleep)  # a run ends when its last rank is done
        # CPU seconds this process used (every thread): what the emulation itself costs a core
        return count, time.perf_counter() - start, busy, time.process_time() - cpu

    def zero_cost(self, runs=None):
        """(median wall seconds of ZERO_COST_REPEATS runs of each run at zero cost, after a
        warm-up; this rank's peak held bytes of each): the emulation's own overhead, and the
        frameworks' costs for the model. Runs of a few milliseconds are noisy, and the
        frameworks' costs are fitted to them."""
        self.clock.scale = 0.0
        zero, peaks = {}, {}
        for run in self.runs if runs is None else runs:
            self.run_once(*run)  # warm-up
            self.holder(run[0]).reset_peak()
            zero[run[0]] = statistics.median(self.timed(self.run_once, *run)[1]
                                             for _ in range(ZERO_COST_REPEATS))
            peaks[run[0]] = self.holder(run[0]).peak_held_bytes
        self.clock.scale = 1.0
        return zero, peaks

    def timed_rounds(self):
        """(timings per run, peak held bytes per run, PETRA's steady rates on rank 0) of
        a.rounds rounds of every run, alternated."""
        results = {name: [] for name, *_ in self.runs}
        peaks = {name: 0 for name, *_ in self.runs}
        steady = {name: [] for name, *_ in self.runs}
        for _ in range(self.a.rounds):
            for name, method, m in self.runs:
                held = self.holder(name)
                held.reset_peak()
                results[name].append(self.timed(self.run_once, name, method, m))
                peaks[name] = max(peaks[name], held.peak_held_bytes)
                if method == "petra" and self.world.rank == 0:
                    steady[name].append(_steady_rate(self.stage.forward_starts,
                                                     self.world.size))
        return results, peaks, steady

    def orders_of(self, name, method, m, zb_orders):
        """Each rank's operations in one run, for the performance model."""
        J = self.world.size
        if method in PETRA_METHODS:
            n = self.segment_of[m] if method == "petra" else m
            return perfmodel.petra_orders(method, J, n, m)
        return zb_orders.get(name) or pipelining_orders(None, method, J, m)


def budget_methods(budgets: str):
    """The methods whose runs' peaks PETRA gets as budgets (--budgets), and whether it also
    runs without a limit."""
    wanted = [b.strip() for b in budgets.split(",") if b.strip()]
    if "all" in wanted:
        wanted = [*PIPELINING, UNLIMITED]
    unknown = set(wanted) - {*PIPELINING, UNLIMITED}
    if unknown:
        raise SystemExit(f"unknown --budgets {sorted(unknown)}")
    return [w for w in wanted if w != UNLIMITED], UNLIMITED in wanted


def add_budget_runs(em, peaks) -> list:
    """PETRA with kept blocks: for each run of a --budgets method, at a budget per rank of
    that run's peak held bytes on the rank (`peaks`: this rank's, per run; a rank's peak
    depends on its order of operations, not on time, so a zero-cost run gives it), and
    without a limit. Of a budget, the FIFOs' peak is PETRA's anyway; the rest is the kept
    graphs' (model.memory_budget). The new runs, added to em.runs."""
    methods, unlimited = budget_methods(em.a.budgets)
    sources = [run for run in em.runs if run[1] in methods]
    if not sources and not unlimited:
        return []
    a, J = em.a, em.world.size
    sizes = None
    if em.world.rank == 0:
        sizes = kept_sizes(em.profile.arch, a.width, a.batch, em.sizes)
    em.block_kept_bytes, em.block_shared = em.world.bcast(sizes)
    fifo = fifo_bytes(em.shapes, em.sizes, a.batch)
    new = []
    for name, method, m in sources:
        budget = em.world.allgather(peaks[name])
        plan = kept_plan(em.profile, em.sizes, em.block_kept_bytes,
                         [max(0, b - f) for b, f in zip(budget, fifo)], em.block_shared)
        new.append((f"petra @{name}", "petra", m))
        em.plans[new[-1][0]] = (plan, budget, name)
    if unlimited:
        plan = kept_plan(em.profile, em.sizes, em.block_kept_bytes, [None] * J, em.block_shared)
        new.append((f"petra {UNLIMITED}", "petra", em.ms[0]))
        em.plans[new[-1][0]] = (plan, None, UNLIMITED)
    em.runs += new
    return new


def real_stages(em, results) -> dict:
    """Wall seconds of the real stages for our runs (validation of the emulation at small
    J, measured costs); two more emulated runs of each are added to `results`."""
    from ...engines.build import StageSpec, build_stages, build_workers
    a, r, J = em.a, em.world.rank, em.world.size
    (real_stage,) = build_stages(StageSpec(NetSpec(em.profile.arch, a.width, 10)),
                                 Layout(em.sizes), only=r)
    workers = build_workers([real_stage])
    real_worker = workers[0]
    engines = {m: build_engine(workers, m, em.world, (3, 32, 32), a.batch)
               for m in PETRA_METHODS}
    g = torch.Generator().manual_seed(0)
    data = [(torch.randn(a.batch, 3, 32, 32, generator=g),
             torch.randint(0, 10, (a.batch,), generator=g)) for _ in range(4)]
    real = {}
    for name, method, m in [x for x in em.runs
                            if x[1] in PETRA_METHODS and x[0] not in em.plans]:
        n = em.segment_of[m] if method == "petra" else m
        real_worker.accumulate_over(m)
        real_segment(engines[method], data, r, J + 2)
        real[name] = [em.timed(real_segment, engines[method], data, r, n)[1]
                      for _ in range(3)]
        for _ in range(2):  # the emulation again, alternated with the real runs
            results[name].append(em.timed(em.run_once, name, method, m))
    return real


def real_segment(engine, data, rank, n):
    """One segment of n micro-batches of the real stages: the micro-batches done."""
    batches = (data[i % 4] for i in range(n)) if rank == 0 else None
    engine.train_segment(batches, n)
    return n


def run(a):
    """Emulate every run on every rank; the JSON record on rank 0, None elsewhere."""
    from ...comm.world import World
    world = World.from_environment()
    if world is None:
        raise SystemExit("run under mpirun with at least 2 ranks")
    record = emulate(a, world)
    world.close()  # once torch's schedules (they hold process groups) went with emulate's frame
    return record


def emulate(a, world):
    """run's emulation over `world`: the JSON record on rank 0, None elsewhere."""
    torch.set_num_threads(1)
    em = Emulation(a, world)
    J = world.size
    # 1. The same runs at zero cost (warm-up too). 2. Timed runs. 3. The real stages.
    zero, zero_peaks = em.zero_cost()
    zero.update(em.zero_cost(add_budget_runs(em, zero_peaks))[0])
    link = measure_link(world, max(em.out_bytes), repeats=10, poll_sleep=a.poll_sleep)
    results, peaks, steady = em.timed_rounds()
    real = real_stages(em, results) if a.real else {}
    # 4. Gather on rank 0.
    busy = {name: world.gather(sum(v[2] for v in rs) / sum(v[1] for v in rs))
            for name, rs in results.items()}
    cpu = {name: world.gather(sum(v[3] for v in rs) / sum(v[1] for v in rs))
           for name, rs in results.items()}
    peak_bytes = {name: world.gather(peaks[name]) for name in results}
    zb_orders = {name: pipelining_orders(em.pt[name][1], "zero_bubble", J, em.pt[name][3])
                 for name in em.pt if em.pt[name][2] == "zero_bubble"}
    if world.rank != 0:
        return None
    measured = {"zero": zero, "link": link, "results": results, "steady": steady, "real": real,
                "busy": busy, "cpu": cpu, "peak_bytes": peak_bytes}
    return Prediction(a, em, link, zb_orders).record(measured)


class Prediction:
    """Rank 0: the performance model, with the frameworks' costs fitted to zero-cost runs (or
    given), and its prediction beside each measured run."""

    def __init__(self, a, em, link, zb_orders):
        self.a, self.em, self.link, self.zb_orders = a, em, link, zb_orders
        J = em.world.size
        self.petra_stages = perfmodel.stage_costs(em.petra_bc, em.sizes)
        self.plain_stages = perfmodel.stage_costs(em.plain_bc, em.plain_sizes,
                                                  rebuilt_down=[False] * J,
                                                  weight=em.profile.weight)
        # PETRA's ticks per second when the slowest stage sets the pace
        self.bound = _bound(self.petra_stages)

    def costs_of(self, name, method):
        """The model's stage costs of run `name`: PETRA's with its kept plan (each stage's
        backward, averaged over its d_s micro-batches, less the rebuilds its kept ones skip),
        a plain stage's, checkpointed: with the forward again in the backward."""
        if method in PETRA_METHODS:
            plan = self.em.plans.get(name)
            return (kept_stage_costs(self.petra_stages, plan[0].kept, self.em.profile.rebuild,
                                     self.em.sizes) if plan else self.petra_stages)
        if method == "1f1b_checkpointed":
            return [replace(c, backward=c.backward + c.forward) for c in self.plain_stages]
        return self.plain_stages

    def frameworks(self, zero) -> dict:
        """Each family's framework costs and where they come from, {family: (Framework, from)}.
        At zero compute the ranks compete for the cores whenever several work at once, so each
        family's costs come from runs in which they do not:
        - ours: its cost per operation, fitted on this run's backprop at zero cost (one rank
          works at a time); without backprop, as the pipelines';
        - the pipelines: from --framework (a J = 2 run, whose two ranks have a core each), else
          fitted on this run's zero-cost runs."""
        given = {}
        if self.a.framework:
            given = {k: perfmodel.Framework.from_record(v)
                     for k, v in last_json_line(self.a.framework)["framework"].items()}
        runs = self.em.runs
        ours = [x for x in runs if x[1] in PETRA_METHODS]
        backprop = [x for x in ours if x[1] == "backprop"]
        frameworks = {}
        if backprop:
            frameworks["ours"] = (self.fit(self.petra_stages, backprop, zero, ("per_op",)),
                                  "fitted on backprop at zero compute")
        for family, stages, family_runs in (("ours", self.petra_stages, ours),
                                            ("pipelining", self.plain_stages,
                                             [x for x in runs if x[1] in PIPELINING])):
            if not family_runs or family in frameworks:
                continue
            frameworks[family] = ((given[family], f"from {self.a.framework}") if family in given
                                  else (self.fit(stages, family_runs, zero,
                                                 perfmodel.FRAMEWORK_COSTS),
                                        "fitted at zero compute"))
        return frameworks

    def fit(self, stages, runs, zero, names):
        """perfmodel.fit_framework of `names` on the zero-cost timings of `runs` over `stages`."""
        free = [_zero(c) for c in stages]
        return perfmodel.fit_framework(
            [self.em.orders_of(n, mt, m, self.zb_orders) for n, mt, m in runs],
            [free] * len(runs), [self.link] * len(runs), [zero[n] for n, *_ in runs],
            names=names)

    def row(self, run, measured, frameworks) -> dict:
        """One run's measured and predicted figures."""
        a, J, (name, method, m) = self.a, self.em.world.size, run
        results = measured["results"][name]
        count = results[0][0]
        wall = statistics.median(v[1] for v in results)
        family = "ours" if method in PETRA_METHODS else "pipelining"
        costs = self.costs_of(name, method)
        framework = frameworks[family][0]
        orders = self.em.orders_of(name, method, m, self.zb_orders)
        predicted = count * a.batch / perfmodel.simulate(orders, costs, self.link, framework)
        # the model's account of the zero-cost run, to set beside the measured zero_cost_s: the
        # framework's costs are fitted to make the two agree
        zero_model = perfmodel.simulate(orders, [_zero(c) for c in costs], self.link, framework)
        row = {"name": name, "method": method, "m": m, "microbatches": count,
               "images_per_s": count * a.batch / wall, "predicted_images_per_s": predicted,
               "model_error": predicted / (count * a.batch / wall) - 1,
               "busy_fraction": measured["busy"][name], "cpu_fraction": measured["cpu"][name],
               "peak_held_bytes": measured["peak_bytes"][name],
               "zero_cost_s": measured["zero"][name], "zero_cost_model_s": zero_model,
               "walls_s": [v[1] for v in results]}
        if method == "petra":
            # the model's steady rate: what 4J more micro-batches add to the segment
            n = self.em.segment_of[m]
            more = perfmodel.simulate(perfmodel.petra_orders("petra", J, n + 4 * J, m), costs,
                                      self.link, framework)
            row["model_steady_images_per_s"] = 4 * J * a.batch / (
                more - count * a.batch / predicted)
            steady = measured["steady"][name]
            rate = statistics.median(steady) if steady else None
            row["steady_images_per_s"] = rate * a.batch if rate else None
            bound = _bound(costs)
            row["bound_images_per_s"] = bound * a.batch
            row["of_bound"] = rate / bound if rate else None
        if name in self.em.plans:
            plan, budget, source = self.em.plans[name]
            row.update({"budget_of": source, "budget_bytes": budget, "kept": plan.kept,
                        "planned_kept_bytes": plan.kept_bytes,
                        "planned_relative_time": plan.relative_time})
        if name in measured["real"]:
            real_rate = count * a.batch / statistics.median(measured["real"][name])
            row["real_images_per_s"] = real_rate
            row["emulation_error"] = row["images_per_s"] / real_rate - 1
        return row

    def overhead(self, zero):
        """The emulation's own overhead: PETRA at zero cost, ticks per second (None without
        PETRA runs)."""
        petra_zero = [(name, m) for name, method, m in self.em.runs if method == "petra"]
        if not petra_zero:
            return None
        from ...core.schedule import num_ticks
        name, m = petra_zero[0]
        ticks = num_ticks("petra", self.em.world.size, self.em.segment_of[m])
        return {"run": name, "ticks": ticks, "seconds": zero[name],
                "ms_per_tick": 1e3 * zero[name] / ticks}

    def record(self, measured) -> dict:
        """The JSON record of the run."""
        a, em, link = self.a, self.em, self.link
        frameworks = self.frameworks(measured["zero"])
        rows = [self.row(run, measured, frameworks) for run in em.runs]
        cpu_all = [c for row in rows for c in row["cpu_fraction"]]
        record = {"bench": "emulate", "arch": em.profile.arch, "ranks": em.world.size,
                  "costs": em.profile.source, "width": a.width, "batch": a.batch,
                  "split": em.sizes, "plain_split": em.plain_sizes,
                  "microbatches": em.ms, "rounds": a.rounds, "poll_sleep_s": a.poll_sleep,
                  "cpus": os.cpu_count(),
                  "link": {"latency_s": link.latency, "bandwidth_bytes_per_s": link.bandwidth},
                  "framework": {f: fw.to_record() for f, (fw, _) in frameworks.items()},
                  "framework_from": {f: origin for f, (_, origin) in frameworks.items()},
                  "overhead": self.overhead(measured["zero"]), "rows": rows,
                  "cpu_fraction_mean": statistics.mean(cpu_all),
                  "validation": [{"name": row["name"], "model_error": row["model_error"],
                                  **({"emulation_error": row["emulation_error"]}
                                     if "emulation_error" in row else {})} for row in rows]}
        record["pareto"] = pareto_front(memory_points(rows))
        if em.skipped:
            record["skipped"] = em.skipped
        return record


def report(a, r):
    """The table on rank 0 (and the figure with --png), then the JSON line."""
    if r is None:
        return
    link = r["link"]
    print(f"emulated {r['arch']}, J = {r['ranks']} ranks on {r['cpus']} cores, costs: "
          f"{r['costs']}; messages of width {a.width}, batch {a.batch}; split {r['split']} "
          f"(plain {r['plain_split']}); link {1e6 * link['latency_s']:.0f} us, "
          f"{link['bandwidth_bytes_per_s'] / 1e9:.2f} GB/s; {a.rounds} round(s)")
    for family, fw in r["framework"].items():
        print(f"framework costs ({family}, {r['framework_from'][family]}): "
              f"{1e6 * fw['per_op_s']:.0f} us per operation, "
              f"{1e6 * fw['per_message_s']:.0f} us per message, "
              f"{1e3 * fw['per_step_s']:.2f} ms per step")
    overhead = r["overhead"]
    if overhead:
        petra_row = next(row for row in r["rows"] if row["method"] == "petra")
        tick_ms = 1e3 * a.batch / petra_row["bound_images_per_s"]
        print(f"emulation overhead: PETRA at zero cost {overhead['ms_per_tick']:.2f} ms per tick "
              f"(a tick of the profile costs {tick_ms:.1f} ms)")
    cpu_all = [c for row in r["rows"] for c in row["cpu_fraction"]]
    print(f"CPU used per rank while emulating: {min(cpu_all):.3f}-{max(cpu_all):.3f} of a core "
          f"(mean {r['cpu_fraction_mean']:.3f})")
    print(f"{'run':<30} {'images/s':>9} {'model':>8} {'err':>6}  busy fraction per rank | "
          f"peak held MiB per rank")
    for row in r["rows"]:
        print(row_line(row))
    for name, why in r.get("skipped", {}).items():
        print(f"{name:<30} did not run: {why}")
    print_memory_table(r)
    if a.png:
        plot([r], a.png)
    if a.pareto:
        plot_pareto(r, a.pareto)
    sys.stdout.flush()
    emit(r)


def memory_points(rows) -> list:
    """(name, peak held bytes on the rank that holds most, images/s) of every run: PETRA's
    steady rate where one was measured (training's segments are long: fill and drain are a
    segment's, not the method's), a pipeline's images/s per step (its bubble is the method's)."""
    return [(row["name"], max(row["peak_held_bytes"]),
             (row.get("steady_images_per_s") or row["images_per_s"])) for row in rows]


def pareto_front(points) -> list:
    """Names of the points (name, bytes, images/s) that no other point beats: none holds at
    most as much and runs at least as fast, and better in one of the two."""
    return [name for name, mem, speed in points
            if not any(m <= mem and v >= speed and (m < mem or v > speed)
                       for _, m, v in points)]


def print_memory_table(r):
    """Throughput against memory: every run by its peak held bytes, the Pareto front starred,
    the kept plans beside PETRA's budget runs."""
    front = set(r["pareto"])
    rows = {row["name"]: row for row in r["rows"]}
    print("throughput against memory (peak held MiB: the rank that holds most; * Pareto front)")
    for name, mem, speed in sorted(memory_points(r["rows"]), key=lambda p: (p[1], -p[2])):
        row, extra = rows[name], ""
        if "kept" in row:
            budget = row["budget_bytes"]
            limit = "unlimited" if budget is None else f"{max(budget) / 2**20:.1f} MiB (largest)"
            extra = (f"  budget {limit}  kept {row['kept']}  planned time "
                     f"{row['planned_relative_time']:.3f} of PETRA's")
        print(f"{'*' if name in front else ' '} {name:<28} {mem / 2**20:>8.1f} MiB "
              f"{speed:>8.1f} images/s{extra}")


def plot_pareto(record, png):
    """images/s against the peak held bytes per rank (the largest over the ranks), one point
    per run, the Pareto front joined."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    points = memory_points(record["rows"])
    front = set(pareto_front(points))
    method = {row["name"]: row["method"] for row in record["rows"]}
    colours = {"petra": "C3", "backprop": "C7", "gpipe": "C0", "1f1b": "C1", "zero_bubble": "C2",
               "1f1b_checkpointed": "C4"}
    fig, ax = plt.subplots(figsize=(8, 5))
    labels = {}  # runs of one method that hold the same bytes (PETRA under budgets that give
    #              one plan): one label
    for name, mem, speed in points:
        ax.scatter(mem / 2**20, speed, color=colours.get(method[name], "k"),
                   marker="*" if name in front else "o", s=90 if name in front else 30)
        labels.setdefault((mem, method[name]), []).append((speed, name))
    for (mem, _), runs in labels.items():
        runs.sort(reverse=True)
        ax.annotate("\n".join(name for _, name in runs), (mem / 2**20, runs[0][0]), fontsize=6,
                    xytext=(3, 3), textcoords="offset points", va="top")
    on_front = sorted((mem / 2**20, speed) for name, mem, speed in points if name in front)
    if on_front:
        ax.step(*zip(*on_front), where="post", color="k", linewidth=0.8, label="Pareto front")
        ax.legend(fontsize=8)
    ax.set_xlabel("peak held MiB per rank (the largest over the ranks)")
    ax.set_ylabel("images/s, emulated (PETRA: steady)")
    ax.set_title(f"{record['arch']}, J = {record['ranks']}, costs: {record['costs']}",
                 fontsize=9)
    os.makedirs(os.path.dirname(png) or ".", exist_ok=True)
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    print(f"wrote {png}")


def row_line(row) -> str:
    """One run's line of the table."""
    extra = ""
    if row["method"] == "petra" and row["of_bound"]:
        extra = (f"  steady {row['steady_images_per_s']:.1f} = {row['of_bound']:.3f} of "
                 f"bound {row['bound_images_per_s']:.1f}")
    if "real_images_per_s" in row:
        extra += (f"  real {row['real_images_per_s']:.1f} "
                  f"({100 * row['emulation_error']:+.1f}%)")
    return (f"{row['name']:<30} {row['images_per_s']:>9.1f} "
            f"{row['predicted_images_per_s']:>8.1f} {100 * row['model_error']:>+5.1f}%  "
            f"{' '.join(f'{b:.2f}' for b in row['busy_fraction'])} | "
            f"{' '.join(f'{b / 2**20:.1f}' for b in row['peak_held_bytes'])}{extra}")


def _loss(logits, target):
    return torch.nn.functional.cross_entropy(logits, target)


def _zero(c):
    return perfmodel.StageCosts(0.0, 0.0, 0.0, 0.0, c.out_bytes, c.down_bytes, 0.0)


def _stage_seconds(c, s, J):
    return c.forward_backward if s == J - 1 else c.forward + c.backward


def _bound(stages):
    """Micro-batches per second of PETRA when its slowest stage sets the pace."""
    return 1.0 / max(_stage_seconds(c, s, len(stages)) for s, c in enumerate(stages))


def kept_stage_costs(stages, kept, rebuild, sizes):
    """PETRA's StageCosts under a kept plan (kept[s][i]: kept micro-batches of every d_s of
    block i of stage s): a kept micro-batch's backward skips the block's rebuild (rebuild[b]:
    block b's), so a stage's backward costs on average rebuild x kept / d_s less per block."""
    petra, out, first = PetraSchedule(len(stages)), [], 0
    for s, (c, n) in enumerate(zip(stages, sizes)):
        window = petra.in_flight(s)
        saved = sum(rebuild[first + i] * k / window for i, k in enumerate(kept[s]) if k)
        out.append(replace(c, backward=c.backward - saved))
        first += n
    return out


def _steady_rate(starts, J):
    """Micro-batches per second of rank 0's forwards once the pipeline is full, or None for a
    segment too short to have a steady state. Its forward of micro-batch 2(J-1) opens the first
    full tick, but that tick's backward waits for the first gradient to come back: the rate is
    counted from the next forward, the first one paced by the full pipeline."""
    full = starts[2 * (J - 1) + 1:]
    if len(full) < 3:
        return None
    return (len(full) - 1) / (full[-1] - full[0])


def plot(sources, png):
    """images/s against J: one colour per method, one line style per m (PETRA: its steady rate,
    the same for every m), one marker per network."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    records = []
    for src in sources:
        if isinstance(src, dict):
            records.append(src)
            continue
        records.append(last_json_line(src))
    series = {}  # (arch, method, m label) -> {J: [images/s of every run]}
    for rec in records:
        J = rec["ranks"]
        for row in rec["rows"]:
            if "kept" in row:
                continue  # the kept plans' runs: --pareto draws them
            m = row["m"]
            if row["method"] in PETRA_METHODS:
                label = ""
                value = row.get("steady_images_per_s") or row["images_per_s"]
            else:
                label = "m=4" if m == 4 else f"m={m // J}J" if m % J == 0 else f"m={m}"
                value = row["images_per_s"]
            key = (rec["arch"], row["method"], label)
            if row["method"] == "petra" and J in series.get(key, {}):
                continue  # one PETRA point per run: its steady rate does not depend on m
            series.setdefault(key, {}).setdefault(J, []).append(value)
    colours = {"petra": "C3", "backprop": "C7", "gpipe": "C0", "1f1b": "C1", "zero_bubble": "C2",
               "1f1b_checkpointed": "C4"}
    styles = {"": "-", "m=4": ":", "m=2J": "--", "m=8J": "-"}
    markers = {"revnet18": "o", "revnet34": "s"}
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for (arch, method, label), points in sorted(series.items()):
        js = sorted(points)
        ax.plot(js, [statistics.median(points[j]) for j in js], styles.get(label, "-."),
                color=colours.get(method), marker=markers.get(arch, "^"),
                linewidth=2.5 if method == "petra" else 1.2,
                label=f"{arch} {method}" + (f" {label}" if label else
                                             " (steady)" if method == "petra" else ""))
    ax.set_xlabel("stages J (ranks)")
    ax.set_ylabel("images/s, emulated (median of runs)")
    ax.set_title("emulated pipelines, costs: " + ", ".join(sorted({r["costs"] for r in records})),
                 fontsize=9)
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
    os.makedirs(os.path.dirname(png) or ".", exist_ok=True)
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    print(f"wrote {png}")
