"""Under `mpirun -n J`: an emulated pipeline of J stages with real messages. Every rank runs the
real engine and transport (PETRA and backprop: our MPI engine; gpipe, 1f1b, zero_bubble:
torch.distributed.pipelining over gloo) on stand-in stages whose compute is a wait of its cost
(petra_mpi/emulation.py) and whose outputs have the real shapes, so J = 10 or 18 ranks run on a
few cores. Costs: `--costs paper` (derived from the paper's Table 5), `measured` (this machine's
per-block costs) or a JSON file. Methods alternate in rounds, for m micro-batches per step (PETRA:
accumulation k = m). Reports images/s, each rank's busy fraction and peak held activations, the
performance model's prediction beside each run, and the emulation's own overhead (the same runs
at zero cost); `--real` (J = 2, measured costs) also times the real stages to validate the
emulation. `python -m petra_mpi.bench emulate --plot A.json B.json ...` draws images/s against
J per method from the last lines of several runs."""
import argparse
import json
import os
import statistics
import sys
import time

import torch

from .. import perfmodel
from ..emulation import (Clock, WaitingOptimizer, WaitingPlainStage, WaitingStage, file_profile,
                         measured_profile, paper_profile, probe_shapes)
from ..engine.worker import StageWorker
from ..models import build_blocks
from ..partition import resolve_partition
from .common import emit, sleeping_barrier

PETRA_METHODS = ("petra", "backprop")
PIPELINING = ("gpipe", "1f1b", "zero_bubble")


def measure_link(comm, nbytes, poll_sleep, repeats=10) -> perfmodel.Link:
    """Latency and bandwidth between ranks 0 and 1, with the emulation's sleeping waits (half a
    ping-pong round trip)."""
    import numpy as np

    def wait(request):
        while not request.Test():
            time.sleep(poll_sleep)

    def half_round_trip(size):
        buf = np.zeros(max(1, size), dtype=np.uint8)
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            if comm.rank == 0:
                wait(comm.Isend(buf, dest=1))
                wait(comm.Irecv(buf, source=1))
            elif comm.rank == 1:
                wait(comm.Irecv(buf, source=0))
                wait(comm.Isend(buf, dest=0))
            times.append((time.perf_counter() - start) / 2)
        return statistics.median(times)

    small, large = half_round_trip(8), half_round_trip(nbytes)
    link = perfmodel.Link(small, nbytes / max(large - small, 1e-9))
    return comm.bcast(link, root=0)


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
    if method == "1f1b":
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
    p = argparse.ArgumentParser(prog="mpirun -n J python -m petra_mpi.bench emulate",
                                description=__doc__)
    p.add_argument("--arch", default="revnet18", help="revnet18 or revnet34 (the paper's)")
    p.add_argument("--costs", default="paper", help="paper, measured, or a JSON profile file")
    p.add_argument("--width", type=int, default=8, help="of the messages (and measured costs)")
    p.add_argument("--batch", type=int, default=16, help="of the messages (and measured costs)")
    p.add_argument("--microbatches", default="4,2J,8J", help="m values: micro-batches per step")
    p.add_argument("--segment", type=int, default=0,
                   help="micro-batches per PETRA segment (0: max(4J, m))")
    p.add_argument("--backprop-segment", type=int, default=4,
                   help="micro-batches per backprop segment (0: skip backprop)")
    p.add_argument("--methods", default="petra,gpipe,1f1b,zero_bubble",
                   help="of petra, gpipe, 1f1b, zero_bubble (backprop: --backprop-segment)")
    p.add_argument("--rounds", type=int, default=1, help="alternated rounds of every run")
    p.add_argument("--poll-sleep", type=float, default=0.0005,
                   help="seconds a waiting rank sleeps between tests of its requests")
    p.add_argument("--framework", metavar="JSON",
                   help="take the frameworks' costs from this earlier run's last line (e.g. J = 2, "
                        "where the zero-cost runs do not crowd the cores) instead of this run's")
    p.add_argument("--real", action="store_true",
                   help="also time the real stages (J = 2 with --costs measured: validation)")
    p.add_argument("--png", default="", help="draw this run's images/s per method")
    p.add_argument("--plot", nargs="+", metavar="JSON",
                   help="no run: draw images/s vs J from these files' last JSON lines to --png")
    a = p.parse_args(argv)
    if a.plot:
        return plot(a.plot, a.png or "runs/bench/emulate.png")
    from ..mpi.world import World
    world = World.from_environment()
    if world is None:
        raise SystemExit("run under mpirun with at least 2 ranks")
    torch.set_num_threads(1)
    comm, r, J = world.comm, world.rank, world.size
    methods = [m for m in a.methods.split(",") if m]
    unknown = set(methods) - {"petra", *PIPELINING}
    if unknown:
        raise SystemExit(f"unknown --methods {sorted(unknown)}")
    ms = step_counts(a.microbatches, J)

    # Costs and shapes: rank 0 builds the profile (measuring takes a while), everyone probes.
    profile = None
    if r == 0:
        profile = (paper_profile(a.arch) if a.costs == "paper" else
                   measured_profile(a.arch, a.width, a.batch) if a.costs == "measured" else
                   file_profile(a.costs))
    # the others sleep meanwhile: a rank spinning in MPI's Bcast would take a core from rank 0
    # while it times the blocks
    sleeping_barrier(comm, a.poll_sleep)
    profile = comm.bcast(profile, root=0)
    shapes = probe_shapes(profile.arch, a.width)
    out_bytes = [4 * a.batch * torch.Size(s).numel() for s in shapes.outputs]
    in_bytes = 4 * a.batch * 3 * 32 * 32
    petra_bc = profile.petra_costs(out_bytes, in_bytes)
    plain_bc = profile.plain_costs(out_bytes, in_bytes)
    blocks = build_blocks(profile.arch, a.width, 10)
    if J > len(blocks):
        raise SystemExit(f"{profile.arch} has {len(blocks)} blocks: at most {len(blocks)} ranks")
    sizes = resolve_partition(blocks, J, costs=petra_bc)
    plain_sizes = resolve_partition(blocks, J, costs=plain_bc)
    first = sum(sizes[:r])
    mine = range(first, first + sizes[r])
    plain_first = sum(plain_sizes[:r])
    plain_mine = list(range(plain_first, plain_first + plain_sizes[r]))

    # PETRA and backprop: the real worker and MPI engine on a waiting stage.
    from ..mpi.engine import MPIEngine
    clock = Clock()
    stage = WaitingStage(r, J, shapes, first,
                         [(petra_bc.forward[b], petra_bc.backward[b], petra_bc.last[b])
                          for b in mine], a.batch, clock=clock)
    worker = StageWorker(stage, WaitingOptimizer(sum(petra_bc.step[b] for b in mine), clock))
    engines = {m: MPIEngine(worker, m, world, torch.float32, (3, 32, 32), a.batch)
               for m in PETRA_METHODS}
    for engine in engines.values():
        engine.transport.poll_sleep = a.poll_sleep
    x0 = torch.zeros(a.batch, 3, 32, 32)
    y0 = torch.zeros(a.batch, dtype=torch.int64)

    def petra_run(method, n, k):
        worker.k = k
        batches = ((x0, y0) for _ in range(n)) if r == 0 else None
        stage.forward_starts.clear()
        engines[method].train_segment(batches, n)
        return n

    runs = []  # (name, method, m, function returning micro-batches done)
    segment_of = {m: a.segment or max(4 * J, m) for m in ms}
    if "petra" in methods:
        runs += [(f"petra m={m}", "petra", m, lambda m=m: petra_run("petra", segment_of[m], m))
                 for m in ms]
    if a.backprop_segment:
        runs.append(("backprop", "backprop", a.backprop_segment,
                     lambda: petra_run("backprop", a.backprop_segment, a.backprop_segment)))

    # torch.distributed.pipelining: its schedules on waiting stages of the plain network.
    pt = {}
    skipped = {}
    if set(methods) & set(PIPELINING):
        from .peers import init_gloo
        init_gloo(world)
        from torch.distributed.pipelining import (PipelineStage, Schedule1F1B, ScheduleGPipe,
                                                  ScheduleInterleavedZeroBubble)
        classes = {"gpipe": (ScheduleGPipe, False), "1f1b": (Schedule1F1B, False),
                   "zero_bubble": (ScheduleInterleavedZeroBubble, True)}
        for method in [m for m in methods if m in PIPELINING]:
            cls, multi = classes[method]
            for m in ms:
                name = f"{method} m={m}"
                err = None
                try:
                    weight = [profile.weight[b] if b > 0 else plain_bc.backward[b]
                              for b in plain_mine]  # stage 0 computes no input gradient
                    module = WaitingPlainStage(
                        shapes, plain_mine, sum(plain_bc.forward[b] for b in plain_mine),
                        sum(plain_bc.backward[b] for b in plain_mine), sum(weight), a.batch, clock)
                    ps = PipelineStage(
                        module, r, J, torch.device("cpu"),
                        input_args=torch.zeros(module.in_shape).requires_grad_(r > 0),
                        output_args=torch.zeros(module.out_shape).requires_grad_())
                    schedule = cls([ps] if multi else ps, m, loss_fn=_loss)
                except Exception as e:  # noqa: BLE001 - reported, the others still run
                    err = f"{type(e).__name__}: {e}".splitlines()[0]
                errors = [e for e in comm.allgather(err) if e]
                if errors:  # every rank drops it, so no rank waits on a schedule others skip
                    skipped[name] = errors[0]
                    continue
                pt[name] = (module, schedule, method, m)
        pt_x = {m: torch.zeros(m * a.batch, 3, 32, 32) for m in ms}
        pt_y = {m: torch.zeros(m * a.batch, dtype=torch.int64) for m in ms}

        def pt_run(name):
            module, schedule, method, m = pt[name]
            if r == 0:
                schedule.step(pt_x[m], return_outputs=False)
            elif r == J - 1:
                schedule.step(target=pt_y[m], return_outputs=False)
            else:
                schedule.step(return_outputs=False)
            clock.wait(sum(plain_bc.step[b] for b in plain_mine))  # the optimizer step
            return m
        runs += [(name, method, m, lambda name=name: pt_run(name))
                 for name, (_, _, method, m) in pt.items()]

    def timed(fn):
        sleeping_barrier(comm, a.poll_sleep)
        busy, cpu, start = clock.busy, time.process_time(), time.perf_counter()
        count = fn()
        busy = clock.busy - busy
        sleeping_barrier(comm, a.poll_sleep)  # a run ends when its last rank is done
        # CPU seconds this process used (every thread): what the emulation itself costs a core
        return count, time.perf_counter() - start, busy, time.process_time() - cpu

    # 1. The same runs at zero cost: the emulation's own overhead, and the frameworks' costs
    # for the model (warm-up too).
    clock.scale = 0.0
    zero = {}
    for name, method, m, fn in runs:
        fn()  # warm-up
        zero[name] = statistics.median(timed(fn)[1] for _ in range(2))
    clock.scale = 1.0
    link = measure_link(comm, max(out_bytes), a.poll_sleep)

    # 2. Timed runs, alternated.
    results = {name: [] for name, *_ in runs}
    peaks = {name: 0 for name, *_ in runs}
    steady = {name: [] for name, *_ in runs}
    for _ in range(a.rounds):
        for name, method, m, fn in runs:
            held = pt[name][0] if name in pt else stage
            held.peak_in_flight = 0
            results[name].append(timed(fn))
            peaks[name] = max(peaks[name], held.peak_held_bytes)
            if method == "petra" and r == 0:
                steady[name].append(_steady_rate(stage.forward_starts, J))

    # 3. The real stages (validation of the emulation at small J, measured costs).
    real = {}
    if a.real:
        from ..engine.build import build_stages, build_workers
        from ..optim import LRSchedule
        (real_stage,) = build_stages(profile.arch, a.width, 10, J, seed=0, only=r,
                                     partition=sizes)
        (real_worker,) = build_workers([real_stage], LRSchedule(0.01, 10**6))
        real_engines = {m: MPIEngine(real_worker, m, world, torch.float32, (3, 32, 32), a.batch)
                        for m in PETRA_METHODS}
        g = torch.Generator().manual_seed(0)
        data = [(torch.randn(a.batch, 3, 32, 32, generator=g),
                 torch.randint(0, 10, (a.batch,), generator=g)) for _ in range(4)]
        for name, method, m, _ in [x for x in runs if x[1] in PETRA_METHODS]:
            n = segment_of[m] if method == "petra" else m
            real_worker.k = m

            def real_run(method=method, n=n):
                batches = (data[i % 4] for i in range(n)) if r == 0 else None
                real_engines[method].train_segment(batches, n)
                return n
            real_run(method, J + 2)
            real[name] = [timed(real_run)[1] for _ in range(3)]
            for _ in range(2):  # the emulation again, alternated with the real runs
                results[name].append(timed(dict((x[0], x[3]) for x in runs)[name]))

    # 4. Gather and report.
    busy = {name: comm.gather(sum(v[2] for v in rs) / sum(v[1] for v in rs), root=0)
            for name, rs in results.items()}
    cpu = {name: comm.gather(sum(v[3] for v in rs) / sum(v[1] for v in rs), root=0)
           for name, rs in results.items()}
    peak_bytes = {name: comm.gather(peaks[name], root=0) for name in results}
    zb_orders = {name: pipelining_orders(pt[name][1], "zero_bubble", J, pt[name][3])
                 for name in pt if pt[name][2] == "zero_bubble"}
    if r != 0:
        return
    petra_stages = perfmodel.stage_costs(petra_bc, sizes)
    plain_stages = perfmodel.stage_costs(plain_bc, plain_sizes, rebuilt_down=[False] * J,
                                         weight=profile.weight)
    zero_stages = {"petra": [_zero(c) for c in petra_stages],
                   "plain": [_zero(c) for c in plain_stages]}

    def orders_of(name, method, m, k=1):
        if method in PETRA_METHODS:
            n = segment_of[m] if method == "petra" else m
            return perfmodel.petra_orders(method, J, n, k)
        return zb_orders.get(name) or pipelining_orders(None, method, J, m)

    frameworks = {}
    if a.framework:
        with open(a.framework) as f:
            given = json.loads(f.read().strip().splitlines()[-1])["framework"]
        frameworks = {k: perfmodel.Framework(v["per_message_s"], v["per_step_s"])
                      for k, v in given.items()}
    for family, names in (("ours", [x for x in runs if x[1] in PETRA_METHODS]),
                          ("pipelining", [x for x in runs if x[1] in PIPELINING])):
        if names and family not in frameworks:
            key = "petra" if family == "ours" else "plain"
            frameworks[family] = perfmodel.fit_framework(
                [orders_of(n, mt, m, m) for n, mt, m, _ in names],
                [zero_stages[key]] * len(names), [link] * len(names),
                [zero[n] for n, *_ in names])
    rows = []
    bound = 1.0 / max(_stage_seconds(c, s, J) for s, c in enumerate(petra_stages))
    for name, method, m, _ in runs:
        count = results[name][0][0]
        wall = statistics.median(v[1] for v in results[name])
        family = "ours" if method in PETRA_METHODS else "pipelining"
        costs = petra_stages if family == "ours" else plain_stages
        predicted = count * a.batch / perfmodel.simulate(
            orders_of(name, method, m, m), costs, link, frameworks[family])
        row = {"name": name, "method": method, "m": m, "microbatches": count,
               "images_per_s": count * a.batch / wall, "predicted_images_per_s": predicted,
               "model_error": predicted / (count * a.batch / wall) - 1,
               "busy_fraction": busy[name], "cpu_fraction": cpu[name],
               "peak_held_bytes": peak_bytes[name],
               "zero_cost_s": zero[name],
               "walls_s": [v[1] for v in results[name]]}
        if method == "petra":
            # the model's steady rate: what 4J more micro-batches add to the segment
            n = segment_of[m]
            more = perfmodel.simulate(perfmodel.petra_orders("petra", J, n + 4 * J, m), costs,
                                      link, frameworks[family])
            row["model_steady_images_per_s"] = 4 * J * a.batch / (
                more - count * a.batch / predicted)
            rate = statistics.median(steady[name]) if steady[name] else None
            row["steady_images_per_s"] = rate * a.batch if rate else None
            row["bound_images_per_s"] = bound * a.batch
            row["of_bound"] = rate / bound if rate else None
        if name in real:
            real_rate = count * a.batch / statistics.median(real[name])
            row["real_images_per_s"] = real_rate
            row["emulation_error"] = row["images_per_s"] / real_rate - 1
        rows.append(row)

    # the emulation's own overhead: PETRA at zero cost, ticks per second
    petra_zero = [(name, m) for name, method, m, _ in runs if method == "petra"]
    overhead = None
    if petra_zero:
        name, m = petra_zero[0]
        from ..schedule import num_ticks
        overhead = {"run": name, "ticks": num_ticks("petra", J, segment_of[m]),
                    "seconds": zero[name],
                    "ms_per_tick": 1e3 * zero[name] / num_ticks("petra", J, segment_of[m])}

    print(f"emulated {profile.arch}, J = {J} ranks on {os.cpu_count()} cores, costs: "
          f"{profile.source}; messages of width {a.width}, batch {a.batch}; split {sizes} "
          f"(plain {plain_sizes}); link {1e6 * link.latency:.0f} us, "
          f"{link.bandwidth / 1e9:.2f} GB/s; {a.rounds} round(s)")
    origin = f"from {a.framework}" if a.framework else "fitted at zero compute"
    for family, fw in frameworks.items():
        print(f"framework costs ({family}, {origin}): "
              f"{1e6 * fw.per_message:.0f} us per message, {1e3 * fw.per_step:.2f} ms per step")
    if overhead:
        print(f"emulation overhead: PETRA at zero cost {overhead['ms_per_tick']:.2f} ms per tick "
              f"(a tick of the profile costs {1e3 / bound:.1f} ms)")
    cpu_all = [c for row in rows for c in row["cpu_fraction"]]
    print(f"CPU used per rank while emulating: {min(cpu_all):.3f}-{max(cpu_all):.3f} of a core "
          f"(mean {statistics.mean(cpu_all):.3f})")
    print(f"{'run':<18} {'images/s':>9} {'model':>8} {'err':>6}  busy fraction per rank | "
          f"peak held MiB per rank")
    for row in rows:
        extra = ""
        if row["method"] == "petra" and row["of_bound"]:
            extra = (f"  steady {row['steady_images_per_s']:.1f} = {row['of_bound']:.3f} of "
                     f"bound {row['bound_images_per_s']:.1f}")
        if "real_images_per_s" in row:
            extra += (f"  real {row['real_images_per_s']:.1f} "
                      f"({100 * row['emulation_error']:+.1f}%)")
        print(f"{row['name']:<18} {row['images_per_s']:>9.1f} "
              f"{row['predicted_images_per_s']:>8.1f} {100 * row['model_error']:>+5.1f}%  "
              f"{' '.join(f'{b:.2f}' for b in row['busy_fraction'])} | "
              f"{' '.join(f'{b / 2**20:.1f}' for b in row['peak_held_bytes'])}{extra}")
    for name, why in skipped.items():
        print(f"{name:<18} did not run: {why}")
    record = {"bench": "emulate", "arch": profile.arch, "ranks": J, "costs": profile.source,
              "width": a.width, "batch": a.batch, "split": sizes, "plain_split": plain_sizes,
              "microbatches": ms, "rounds": a.rounds, "poll_sleep_s": a.poll_sleep,
              "cpus": os.cpu_count(),
              "link": {"latency_s": link.latency, "bandwidth_bytes_per_s": link.bandwidth},
              "framework": {f: {"per_message_s": fw.per_message, "per_step_s": fw.per_step}
                            for f, fw in frameworks.items()},
              "framework_from": a.framework or "zero-cost runs of this run",
              "overhead": overhead, "rows": rows,
              "cpu_fraction_mean": statistics.mean(cpu_all),
              "validation": [{"name": row["name"], "model_error": row["model_error"],
                              **({"emulation_error": row["emulation_error"]}
                                 if "emulation_error" in row else {})} for row in rows]}
    if skipped:
        record["skipped"] = skipped
    if a.png:
        plot_record(record, a.png)
    sys.stdout.flush()
    emit(record)


def _loss(logits, target):
    return torch.nn.functional.cross_entropy(logits, target)


def _zero(c):
    return perfmodel.StageCosts(0.0, 0.0, 0.0, 0.0, c.out_bytes, c.down_bytes, 0.0)


def _stage_seconds(c, s, J):
    return c.forward_backward if s == J - 1 else c.forward + c.backward


def _steady_rate(starts, J):
    """Micro-batches per second of rank 0's forwards once the pipeline is full, or None for a
    segment too short to have a steady state. Its forward of micro-batch 2(J-1) opens the first
    full tick, but that tick's backward waits for the first gradient to come back: the rate is
    counted from the next forward, the first one paced by the full pipeline."""
    full = starts[2 * (J - 1) + 1:]
    if len(full) < 3:
        return None
    return (len(full) - 1) / (full[-1] - full[0])


def plot_record(record, png):
    plot([record], png)


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
        with open(src) as f:
            records.append(json.loads(f.read().strip().splitlines()[-1]))
    series = {}  # (arch, method, m label) -> {J: [images/s of every run]}
    for rec in records:
        J = rec["ranks"]
        for row in rec["rows"]:
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
    colours = {"petra": "C3", "backprop": "C7", "gpipe": "C0", "1f1b": "C1", "zero_bubble": "C2"}
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
