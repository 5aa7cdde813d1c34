"""`python -m petra_mpi.bench project`: the performance model (perf/model.py) on paper, at cluster
scale: RevNet-50 on ImageNet over J stages and R replicas of the pipeline, for links of a few
speeds. Per contender (PETRA, PETRA with kept blocks at a few budgets, 1F1B, zero bubble, data
parallelism alone on the same number of GPUs): images/s, hours per ImageNet-1k epoch and the peak
memory of the GPU that holds most. No ranks are started: every figure is the model's.

Per-block costs: Table 5's rate applied to the partitioner's estimate of each block
(emulation.estimated_profile), the paper's profile (`--costs paper`, its CIFAR networks) or a
JSON profile (`--costs FILE`, as `bench emulate --costs FILE` takes it, timed at `--batch`). The
assumptions are printed as a table (docs/performance.md, "At cluster scale")."""
import argparse
import math
from dataclasses import dataclass, replace

from .. import model as perfmodel
from ..emulation import (WaitingStage, balanced_profile, estimated_profile, file_profile,
                         kept_plan, kept_sizes, paper_profile, probe_shapes)
from ...core.planner import plan_layout
from ...models import NetSpec, build_blocks
from .common import emit
from .emulate import kept_stage_costs

EPOCH_IMAGES = 1_281_167  # ImageNet-1k's training set
SGD_COPIES = 3  # fp32 weights, their gradients and SGD's momentum
FLOAT_BYTES = 4
GIB = 2 ** 30
IDEAL = perfmodel.Link(0.0, float("inf"))


@dataclass
class Net:
    """The facts of the network a projection needs: PETRA's and the plain network's stage costs
    (per micro-batch), the split, and per block its parameter bytes and what autograd saves."""
    petra: list         # StageCosts per stage (PETRA: rebuild + VJP)
    plain: list         # StageCosts per stage of the plain network (autograd, 1F1B's)
    whole: list         # [StageCosts] of the whole plain network on one GPU
    sizes: list         # blocks per stage
    param_bytes: list   # per block
    saved_bytes: list   # per block: what a forward with graph saves, per micro-batch
    batch: int


@dataclass
class Contender:
    name: str
    family: str         # petra, 1f1b, zero_bubble, dp
    stages: list        # StageCosts per stage (dp: one, the whole network)
    grad_bytes: list    # per stage: the gradients its replicas all-reduce
    memory: list        # per rank: peak bytes (weights' state, held activations, working graph)
    held: list          # per rank: activations held between forward and backward
    kept: list = None   # PETRA's kept plan (memory_plan.Plan.kept)


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m petra_mpi.bench project", description=__doc__)
    p.add_argument("--arch", default="revnet50")
    p.add_argument("--stages", type=int, default=18, help="J (at most the number of blocks)")
    p.add_argument("--replicas", default="1,2,4,8,16", help="R values: pipelines side by side")
    p.add_argument("--gbits", default="25,100,400", help="link speeds, Gbit/s")
    p.add_argument("--latency-us", type=float, default=10.0, help="of every link")
    p.add_argument("--batch", type=int, default=64, help="samples per micro-batch (the paper's)")
    p.add_argument("--microbatches", type=int, default=32,
                   help="m per step of 1F1B and zero bubble; PETRA's accumulation k = m")
    p.add_argument("--image-size", type=int, default=224,
                   help="the ImageNet stem from 128 px up, the CIFAR stem below")
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--num-classes", type=int, default=1000)
    p.add_argument("--costs", default="estimate",
                   help="estimate (Table 5's rate x the cost estimate), paper, balanced (the "
                        "paper's CIFAR networks, per micro-batch whatever --batch), or a JSON "
                        "profile file")
    p.add_argument("--budgets", default="1f1b,zero_bubble,unlimited",
                   help="PETRA with kept blocks at each of these contenders' held activations "
                        "per rank, and without a limit")
    return p.parse_args(argv)


def cost_profile(a):
    if a.costs == "estimate":
        return estimated_profile(a.arch, a.batch, a.image_size, a.width, a.num_classes,
                                 imagenet_stem=a.image_size >= 128)
    if a.costs in ("paper", "balanced"):
        return (paper_profile if a.costs == "paper" else balanced_profile)(a.arch)
    return file_profile(a.costs)


def describe(a, profile):
    """(Net, BlockShapes) of the network of `a` under `profile`."""
    stem = a.image_size >= 128
    blocks = build_blocks(a.arch, a.width, a.num_classes, stem)
    if len(profile.forward) != len(blocks):
        raise SystemExit(f"the profile has {len(profile.forward)} blocks, {a.arch} "
                         f"{len(blocks)}")
    if not 1 <= a.stages <= len(blocks):
        raise SystemExit(f"{a.arch} has {len(blocks)} blocks: 1 to {len(blocks)} stages")
    shapes = probe_shapes(a.arch, a.width, a.num_classes, a.image_size, stem)
    out = [FLOAT_BYTES * a.batch * math.prod(s) for s in shapes.outputs]
    in_bytes = FLOAT_BYTES * a.batch * 3 * a.image_size ** 2
    petra_bc, plain_bc = profile.petra_costs(out, in_bytes), profile.plain_costs(out, in_bytes)
    sizes = plan_layout(NetSpec(a.arch, a.width, a.num_classes, stem), a.stages,
                        costs=petra_bc).split
    net = Net(perfmodel.stage_costs(petra_bc, sizes),
              perfmodel.stage_costs(plain_bc, sizes, rebuilt_down=[False] * a.stages,
                                    weight=profile.weight),
              perfmodel.stage_costs(plain_bc, [len(blocks)], weight=profile.weight), sizes,
              [FLOAT_BYTES * sum(p.numel() for p in b.parameters()) for b in blocks],
              [a.batch * z for z in shapes.saved], a.batch)
    return net, shapes


def per_stage(net, values, combine=sum):
    """`values` per block combined per stage of the split."""
    out, i = [], 0
    for n in net.sizes:
        out.append(combine(values[i:i + n]))
        i += n
    return out


def pipeline_contender(net, family) -> Contender:
    """1F1B or zero bubble on the plain network: each rank holds what autograd saves for every
    micro-batch between its forward and its (weight) backward."""
    J = len(net.sizes)
    orders, release = ((perfmodel.one_f_one_b_order(J, 1 << 10), perfmodel.BACKWARD)
                       if family == "1f1b" else
                       (perfmodel.zero_bubble_order(J, 1 << 10), "backward_weight"))
    saved = per_stage(net, net.saved_bytes)
    held = [perfmodel.peak_in_flight(o, release) * z for o, z in zip(orders, saved)]
    grads = per_stage(net, net.param_bytes)
    memory = [SGD_COPIES * g + h for g, h in zip(grads, held)]
    return Contender(family, family, net.plain, grads, memory, held)


def dp_contender(net) -> Contender:
    """Data parallelism alone: every GPU the whole plain network and one micro-batch's graph."""
    grads = sum(net.param_bytes)
    held = sum(net.saved_bytes)
    return Contender("dp", "dp", net.whole, [grads], [SGD_COPIES * grads + held], [held])


def petra_contenders(a, net, shapes, profile, budgets) -> list:
    """PETRA (nothing kept) and PETRA with kept blocks under each budget of `budgets`
    ({name: held bytes per rank, None: no limit}), planned as `bench emulate` plans them: a
    rank's budget less its FIFOs goes to kept graphs (emulation.kept_plan). A rank's memory:
    the weights' state, what it holds with d_s micro-batches in flight, and the graph of the
    backward it runs (one block's; the last stage: its whole part's)."""
    J = len(net.sizes)
    stem = a.image_size >= 128
    firsts = [sum(net.sizes[:s]) for s in range(J)]
    stages = [WaitingStage(s, J, shapes, firsts[s], [(0.0, 0.0, 0.0)] * n, a.batch,
                           a.num_classes) for s, n in enumerate(net.sizes)]
    fifo = [st.steady_held_bytes() for st in stages]
    working = [per_stage(net, net.saved_bytes, max)[s] if s < J - 1 else
               per_stage(net, net.saved_bytes)[s] for s in range(J)]
    grads = per_stage(net, net.param_bytes)
    out = [Contender("petra", "petra", net.petra, grads,
                     [SGD_COPIES * g + f + w for g, f, w in zip(grads, fifo, working)], fifo)]
    if not budgets:
        return out
    kept_bytes, shared = kept_sizes(a.arch, a.width, a.batch, net.sizes, a.num_classes,
                                    a.image_size, stem)
    for name, budget in budgets.items():
        limits = ([None] * J if budget is None else
                  [max(0, b - f) for b, f in zip(budget, fifo)])
        plan = kept_plan(profile, net.sizes, kept_bytes, limits, shared)
        held = []
        for s, st in enumerate(stages):
            st.set_kept(plan.kept[s], kept_bytes[s], shared[s])
            held.append(st.steady_held_bytes())
        costs = kept_stage_costs(net.petra, plan.kept, profile.rebuild, net.sizes)
        out.append(Contender(f"petra @{name}", "petra", costs, grads,
                             [SGD_COPIES * g + h + w for g, h, w in zip(grads, held, working)],
                             held, plan.kept))
    return out


def throughput(c, replicas, J, link, batch, m) -> tuple:
    """(images/s of every GPU together, seconds an epoch takes) of contender c with `replicas`
    pipelines of J stages (dp: replicas x J GPUs). The gradients' ring all-reduce among a
    stage's replicas (dp: among every GPU) is not overlapped: each optimizer step waits for it.
    PETRA: its steady rate (t(2n) - t(n) over n micro-batches), fill and drain once per epoch;
    the pipelines: steps of m micro-batches, each with its fill and drain; dp: steps of
    ceil(m / J) micro-batches per GPU (about the pipelines' batch per step)."""
    members = replicas * J if c.family == "dp" else replicas
    stages = [replace(s, step=s.step + perfmodel.ring_allreduce_seconds(g, members, link))
              for s, g in zip(c.stages, c.grad_bytes)]
    if c.family == "petra":
        n = m * math.ceil(2 * J / m)
        t1, t2 = (perfmodel.simulate(perfmodel.petra_orders("petra", J, size, m), stages, link,
                                     busy_links=True) for size in (n, 2 * n))
        rate = members * n * batch / (t2 - t1)
        return rate, EPOCH_IMAGES / rate + (2 * t1 - t2)  # t1 - n micro-batches' steady time
    if c.family == "dp":
        steps = math.ceil(m / J)
        orders = perfmodel.one_f_one_b_order(1, steps)
        rate = members * steps * batch / perfmodel.simulate(orders, stages, link)
        return rate, EPOCH_IMAGES / rate
    orders = (perfmodel.one_f_one_b_order(J, m) if c.family == "1f1b"
              else perfmodel.zero_bubble_order(J, m))
    rate = members * m * batch / perfmodel.simulate(orders, stages, link, busy_links=True)
    return rate, EPOCH_IMAGES / rate


def contenders(a, net, shapes, profile) -> list:
    pipes = [pipeline_contender(net, f) for f in ("1f1b", "zero_bubble")]
    wanted = [b.strip() for b in a.budgets.split(",") if b.strip()]
    budgets = {}
    for name in wanted:
        if name == "unlimited":
            budgets[name] = None
        elif name in ("1f1b", "zero_bubble"):
            budgets[name] = next(p.held for p in pipes if p.name == name)
        else:
            raise SystemExit(f"unknown --budgets {name!r}: 1f1b, zero_bubble or unlimited")
    return petra_contenders(a, net, shapes, profile, budgets) + pipes + [dp_contender(net)]


def assumptions(a, net, profile) -> list:
    """(what, value) rows: every assumption the figures rest on."""
    J = len(net.sizes)
    return [
        ("network", f"{a.arch}, width {a.width}, {a.num_classes} classes, {a.image_size} px, "
                    f"{len(net.param_bytes)} blocks, {sum(net.param_bytes) / 4e6:.1f} M weights"),
        ("stages", f"J = {J}, split {net.sizes} (one GPU each); R replicas of the pipeline"),
        ("per-block costs", profile.source),
        ("micro-batch", f"{a.batch} samples; fp32 messages and weights"),
        ("step", f"1F1B, zero bubble: m = {a.microbatches} micro-batches per step; PETRA: "
                 f"k = {a.microbatches}; dp: ceil(m / J) = {math.ceil(a.microbatches / J)} per "
                 f"GPU on R x J GPUs"),
        ("point-to-point link", f"{a.latency_us:g} us + bytes / bandwidth, one message at a "
                                "time per direction, sends overlap compute"),
        ("all-reduce", "ring over a stage's R replicas (dp: all R x J GPUs), 2(n-1)/n x "
                       "gradient bytes / bandwidth + 2(n-1) latencies, once per step, NOT "
                       "overlapped: the step waits"),
        ("bandwidth shared", "by nothing: each direction of each neighbour link, and each "
                             "GPU's all-reduce ring, has the full speed"),
        ("framework cost", "none: compute, messages and all-reduce only"),
        ("memory per GPU", f"fp32 weights x {SGD_COPIES} (with gradients, SGD momentum) + held "
                           "activations (PETRA: FIFOs, kept graphs; pipelines: autograd's saved "
                           "tensors per micro-batch in flight; dp: one micro-batch's) + PETRA's "
                           "working graph of one backward; no allocator slack, no messages"),
        ("epoch", f"{EPOCH_IMAGES} images (ImageNet-1k train); PETRA: steady rate, one fill "
                  "and drain"),
    ]


def report(a, record):
    print("assumptions:")
    for what, value in record["assumptions"]:
        print(f"  {what:<20} {value}")
    print("\nper contender: peak memory per GPU (the fullest rank), its held activations, "
          "and images/s of one pipeline over an ideal link (no latency, no bandwidth limit)")
    for name, mem in record["memory"].items():
        kept = f"  kept {[k[0] if len(k) == 1 else k for k in mem['kept']]}" if mem.get(
            "kept") else ""
        print(f"  {name:<18} {mem['peak_bytes'] / GIB:7.2f} GiB on rank {mem['rank']:<3} "
              f"held {mem['held_bytes'] / GIB:6.2f} GiB  {mem['ideal_images_per_s']:7.0f} "
              f"images/s{kept}")
    rs = sorted({p["replicas"] for p in record["points"]})
    for gbits in sorted({p["gbits"] for p in record["points"]}):
        print(f"\n{gbits:g} Gbit/s: images/s (hours per epoch) by R; GPUs = R x J "
              f"(dp: the same GPUs)")
        print(f"  {'contender':<18}" + "".join(f"{f'R = {r}':>20}" for r in rs))
        for name in record["memory"]:
            cells = {p["replicas"]: p for p in record["points"]
                     if p["gbits"] == gbits and p["contender"] == name}
            print(f"  {name:<18}" + "".join(
                f"{cells[r]['images_per_s']:>11.0f} ({cells[r]['hours_per_epoch']:6.3f})"
                for r in rs))
    emit(record)


def main(argv):
    a = parse_args(argv)
    profile = cost_profile(a)
    net, shapes = describe(a, profile)
    J = len(net.sizes)
    record = {"bench": "project", "arch": a.arch, "stages": J, "split": net.sizes,
              "batch": a.batch, "microbatches": a.microbatches, "costs": profile.source,
              "latency_s": a.latency_us * 1e-6, "epoch_images": EPOCH_IMAGES,
              "assumptions": assumptions(a, net, profile), "memory": {}, "points": []}
    for c in contenders(a, net, shapes, profile):
        rank = max(range(len(c.memory)), key=c.memory.__getitem__)
        record["memory"][c.name] = {"peak_bytes": c.memory[rank], "rank": rank,
                                    "held_bytes": max(c.held), "per_rank_bytes": c.memory,
                                    "kept": c.kept, "ideal_images_per_s": throughput(
                                        c, 1, J, IDEAL, a.batch, a.microbatches)[0]}
        for gbits in [float(g) for g in a.gbits.split(",")]:
            link = perfmodel.Link(a.latency_us * 1e-6, gbits * 1e9 / 8)
            for r in [int(r) for r in a.replicas.split(",")]:
                rate, seconds = throughput(c, r, J, link, a.batch, a.microbatches)
                record["points"].append({"contender": c.name, "gbits": gbits, "replicas": r,
                                         "gpus": r * J, "images_per_s": rate,
                                         "hours_per_epoch": seconds / 3600})
    report(a, record)
