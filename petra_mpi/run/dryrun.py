"""`--dry-run`: build every stage, push one batch of the configured shape through them, and print
the per-stage table of parameters, buffers and estimated memory; no training, and of the data
only the file's header (the image size the loader will deliver, see input_side). With
`--profile` every block is first timed on the run's device and batch (blockcost.py) and the
stages are those that balancing by measured cost gives."""
import dataclasses
import sys

import torch

from ..comm.compress import Codec
from ..core.compensation import DelayCompensation
from ..core.memory_plan import last_stage_graph_bytes
from ..core.optim import LRSchedule, StageOptimizer
from ..core.planner import plan_layout
from ..core.schedule import schedule_for
from ..engines.build import StageSpec, build_stages
from ..models import NetSpec
from .layout import config_layout


def input_side(cfg) -> tuple[int, str]:
    """(side of the images training feeds the net, where it was read). As the data loader
    delivers them: JPEG data cropped to data.crop (0: 7/8 of the stored side), array data (and
    the synthetic set) at their stored size, read from data.path's header. A file that cannot be
    read here (a dry run away from the data) falls back to what model.stem implies: data.crop
    (0: 224) for the ImageNet stem, else 32 (CIFAR, ImageNet 32x32)."""
    from ..data import open_split
    from ..data.augment import crop_side
    from ..data.synthetic import SIZE
    if cfg.data.path == "synthetic":
        return SIZE, "synthetic set"
    try:
        src = open_split(cfg.data.path, "train")
    except (OSError, ValueError):
        # ImageNet's stored side is 256
        guess = crop_side(256, cfg.data.crop) if cfg.model.stem == "imagenet" else 32
        return guess, f"model.stem {cfg.model.stem}: {cfg.data.path} not readable here"
    return (crop_side(src.image_size, cfg.data.crop) if src.kind == "jpeg" else src.image_size), \
        cfg.data.path


def stage_table(cfg, layout, dtype=torch.float32, side=None,
                as_the_paper_counts=False) -> list[dict]:
    """Per-stage figures for batch `data.batch_size` of the stages of `layout`
    (planner.Layout), from a real forward of a zero batch; `side`: of the input images (default:
    input_side). Stage s holds its in-flight count d_s of micro-batches' inputs (or weights) at
    its peak, its backward running before its forward within a tick, and at least one (backprop,
    a last stage that rebuilds); the paper's Table 3 counts one more (`as_the_paper_counts`).
    The last stage holds the graph of its whole part for one micro-batch (`graph_bytes`), or
    with model.rebuild_last_stage its buffered blocks' inputs of one micro-batch
    (`input_fifo_bytes`); its row gives both (`last_stage`)."""
    side = side or input_side(cfg)[0]
    # the blocks in fp32, whatever run.precision: the bytes as the table has always counted them
    net = dataclasses.replace(NetSpec.of_config(cfg, side), precision="fp32")
    stages = build_stages(StageSpec(net, cfg.train.method, cfg.train.buffer_inputs,
                                    cfg.train.stash_weights, dtype=dtype), layout)
    schedule = schedule_for(cfg.train.method, layout.num_stages)
    batch = cfg.data.batch_size
    x = net.zeros(1, dtype)  # token ids, or an image
    rows = []
    itemsize = torch.finfo(dtype).bits // 8
    # a FIFO keeps its inputs in comm.buffers' format (an int8 tensor's few scales not counted)
    buffer_codec = Codec(cfg.comm.buffers)
    fifo_itemsize = buffer_codec.code_dtype.itemsize if buffer_codec.active else itemsize
    for stage in stages:
        rebuilds = stage.is_last and cfg.model.rebuild_last_stage
        graph = (last_stage_graph_bytes(stage, x, batch) if stage.is_last else 0)
        stage.eval()
        in_shape = tuple(x.shape[1:])
        fifo = 0
        with torch.no_grad():
            for block, buffered in zip(stage.blocks, stage.buffered):
                if buffered:  # token ids are kept as they are
                    fifo += x.numel() * batch * (fifo_itemsize if x.is_floating_point()
                                                 else x.element_size())
                x = block(x)
        params = sum(p.numel() for p in stage.parameters()) * itemsize
        in_flight = max(schedule.in_flight(stage.index) + (1 if as_the_paper_counts else 0), 1)
        if stage.is_last:
            last = {"graph_bytes": graph, "rebuilt_bytes": fifo, "rebuilds": rebuilds}
            fifo, graph = (fifo, 0) if rebuilds else (0, graph)
        rows.append({
            "stage": stage.index, "blocks": len(stage.blocks),
            "kind": "+".join("rev" if not b else "buf" for b in stage.buffered),
            "classes": [type(b).__name__ for b in stage.blocks],
            "input": in_shape, "output": tuple(x.shape[1:]),
            "param_bytes": params,
            # SGD: one momentum buffer; AdamW: two moments; weight prediction: one more copy
            "optimizer_bytes": (2 * params if cfg.optim.name == "adamw"
                                else params if cfg.optim.momentum > 0 else 0)
            + (params if cfg.optim.delay_prediction and in_flight > 1 and not stage.is_last
               else 0),
            "input_fifo_bytes": fifo * in_flight,
            "stash_bytes": params * in_flight if cfg.train.stash_weights and not stage.is_last
            else 0,
            "graph_bytes": graph,
            **({"last_stage": last} if stage.is_last else {}),
        })
    return rows


def profile_blocks(cfg, net, num_stages: int, device, dtype):
    """--profile: time every block on the run's device, dtype and batch, print each block's
    cost, and return the Layout training would take from those times (planner.plan_layout, as
    layout.choose_layout plans it), whose PETRA split's stage costs it prints too."""
    from ..core.blockcost import measure_net_costs
    costs = measure_net_costs(net, cfg.data.batch_size, device=device, dtype=dtype,
                              time_kept=bool(cfg.model.memory_budget))
    layout = plan_layout(net, num_stages, partition=cfg.model.partition,
                         budget=cfg.model.memory_budget, batch_size=cfg.data.batch_size,
                         costs=costs, rebuild_last=cfg.model.rebuild_last_stage,
                         method=cfg.train.method, device=device, dtype=dtype)
    side = net.image_size
    what = (batch_input(cfg, side) if net.takes_tokens else f"of {side}x{side} images")
    print(f"measured on {device}, batch {cfg.data.batch_size} {what}, ms per micro-batch:")
    kept_header = (f" {'kept':>8}  (kept: forward + backward of a micro-batch it keeps)"
                   if costs.kept else "")  # timed under model.memory_budget only
    print(f"{'block':>5} {'forward':>8} {'backward':>8} {'in last':>8} {'step':>8}{kept_header}")
    for b, f in enumerate(costs.forward):
        print(f"{b:>5} {1e3 * f:>8.2f} {1e3 * costs.backward[b]:>8.2f} "
              f"{1e3 * costs.last[b]:>8.2f} {1e3 * costs.step[b]:>8.2f}"
              + (f" {1e3 * costs.kept[b]:>8.2f}" if costs.kept else ""))
    sizes = layout.petra_split
    per_stage = costs.stage_seconds(sizes)
    print(f"split {sizes} ({'model.partition' if cfg.model.partition else 'measured balance'}): "
          f"ms per micro-batch per stage {' '.join(f'{1e3 * c:.1f}' for c in per_stage)}; "
          f"slowest / mean {max(per_stage) / (sum(per_stage) / len(per_stage)):.2f}")
    return layout


def dry_run_layout(cfg, net, num_stages: int, device, dtype, profile: bool):
    """The Layout the dry run shows: with `profile` the one training takes from the blocks'
    times; else the estimate's, training's own under model.balance: estimate, and under measure
    (whose times it does not take) the kept plan, if any, on PETRA's estimated split."""
    if profile:
        return profile_blocks(cfg, net, num_stages, device, dtype)
    if cfg.model.balance == "estimate":
        return config_layout(cfg, net, num_stages, device, dtype)
    petra = plan_layout(net, num_stages, partition=cfg.model.partition)
    if not cfg.model.memory_budget:
        return petra
    return plan_layout(net, num_stages, partition=petra.split, budget=cfg.model.memory_budget,
                       batch_size=cfg.data.batch_size, method=cfg.train.method, device=device,
                       dtype=dtype)


def batch_input(cfg, side) -> str:
    """What one micro-batch's samples are: token windows for a language model, else images."""
    if NetSpec.of_config(cfg).takes_tokens:
        return (f"windows of {cfg.model.context} tokens "
                f"({cfg.data.batch_size * cfg.model.context} tokens a micro-batch)")
    return f"images {side}x{side}"


def print_kept_plan(cfg, layout, device):
    """model.memory_budget's plan (memory_plan.py, layout.plan): per stage, how many of every
    d_s in-flight micro-batches each block keeps, the kept bytes at the peak and the predicted
    time per micro-batch, and the slowest stage's time relative to PETRA's on its own split
    (layout.petra_split), in the plan's units."""
    from ..core.memory_plan import budget_bytes
    budget, plan = cfg.model.memory_budget, layout.plan
    limit = budget_bytes(budget, device)
    mib = 2 ** 20
    print(f"kept blocks, model.memory_budget {budget} "
          f"({'no limit' if limit is None else f'{limit / mib:.1f} MiB'} per stage), "
          f"blocks per stage {layout.split}; time per micro-batch estimated, 1 = PETRA's "
          f"slowest stage on its own split:")
    print(f"{'stage':>5} {'d_s':>4} {'kept MiB':>9} {'time':>6} {'PETRA':>6}  per block: kept of "
          f"every d_s micro-batches (- cannot keep)")
    scale = max(plan.petra_units_on(layout.petra_split))
    for s, window in enumerate(plan.windows):
        kept = " ".join(str(k) if window else "-" for k in plan.kept[s])
        print(f"{s:>5} {window:>4} {plan.kept_bytes[s] / mib:>9.2f} "
              f"{plan.units[s] / scale:>6.3f} {plan.petra_units[s] / scale:>6.3f}  {kept}")
    slowest = max(range(len(plan.units)), key=lambda s: plan.units[s])
    print(f"slowest stage {slowest}: {plan.units[slowest] / scale:.3f} of PETRA's time per "
          f"micro-batch")


def print_last_stage(last: dict):
    """What the last stage holds for its micro-batch, with its graph and rebuilt
    (model.rebuild_last_stage), and what rebuilding costs."""
    mib = 2 ** 20
    graph, rebuilt = last["graph_bytes"] / mib, last["rebuilt_bytes"] / mib
    if last["rebuilds"]:
        print(f"last stage: rebuilds (no graph), model.rebuild_last_stage: holds {rebuilt:.2f} "
              f"MiB of buffered inputs instead of its graph's {graph:.2f} MiB, for one more "
              f"forward per micro-batch (4 forwards' worth per block instead of 3)")
    else:
        print(f"last stage: keeps the graph of its micro-batch ({graph:.2f} MiB); "
              f"model.rebuild_last_stage would hold {rebuilt:.2f} MiB instead, for one more "
              f"forward per micro-batch (4 forwards' worth per block instead of 3)")


def print_delays(cfg, num_stages: int):
    """Each stage's delay, in micro-batches (d_s, the schedule's in-flight count) and in
    optimizer updates (d_s / k), and what delay compensation (optim.delay_*) makes of it, as
    each stage's optimizer sees it (built on a stand-in parameter, at a learning rate of 1)."""
    optim, k = cfg.optim, cfg.train.accumulation
    schedule = schedule_for(cfg.train.method, num_stages, k)
    comp = DelayCompensation.from_config(optim, steps_per_epoch=1)
    print(f"delays (d_s micro-batches; d_s / k optimizer updates, k = {k}) and delay "
          f"compensation ({'on' if comp.active else 'off'}; optim.delay_*):")
    print(f"{'stage':>5} {'d_s':>4} {'updates':>7} "
          f"{'momentum' if optim.name == 'sgd' else 'beta1':>8} "
          f"{'predicts (steps)':>16} {'lr factor at start':>18}")
    for s in range(num_stages):
        opt = StageOptimizer(torch.nn.Linear(1, 1), LRSchedule(1.0, 10**9), optim.momentum,
                             optim.nesterov, name=optim.name, betas=optim.betas,
                             delay=schedule.delay_in_updates(s), compensation=comp)
        print(f"{s:>5} {schedule.in_flight(s):>4} {opt.delay:>7.2f} {opt.momentum:>8.3f} "
              f"{opt.prediction_horizon:>16.2f} {opt.lr(0):>18.3f}")
    if optim.delay_spike:
        print("spike compensation: a gradient D steps late gets the momentum it missed at once")


def report(cfg, num_stages: int, world=None, device="cpu", dtype=torch.float32,
           profile=False) -> int:
    if world is not None and world.rank != 0:
        world.barrier()
        return 0
    side, where = input_side(cfg)
    layout = dry_run_layout(cfg, NetSpec.of_config(cfg, side), num_stages, device, dtype,
                            profile)
    rows = stage_table(cfg, layout, dtype, side)
    mib = 2 ** 20
    print(f"{cfg.model.arch} width {cfg.model.width}, {num_stages} stages, method "
          f"{cfg.train.method}, batch {cfg.data.batch_size} (config {cfg.source}), "
          f"{batch_input(cfg, side)} ({where})")
    print(f"blocks per stage {layout.split}: {layout.why}")
    print(f"{'stage':>5} {'blocks':>6} {'kind':<14} {'input':<16} {'output':<16} "
          f"{'params MiB':>10} {'optim MiB':>9} {'FIFO MiB':>9} {'stash MiB':>9} {'graph MiB':>9} "
          f"{'total MiB':>9}")
    total = 0
    for r in rows:
        t = (r["param_bytes"] + r["optimizer_bytes"] + r["input_fifo_bytes"] + r["stash_bytes"]
             + r["graph_bytes"])
        total += t
        print(f"{r['stage']:>5} {r['blocks']:>6} {r['kind']:<14} {str(r['input']):<16} "
              f"{str(r['output']):<16} {r['param_bytes'] / mib:>10.2f} "
              f"{r['optimizer_bytes'] / mib:>9.2f} {r['input_fifo_bytes'] / mib:>9.2f} "
              f"{r['stash_bytes'] / mib:>9.2f} {r['graph_bytes'] / mib:>9.2f} {t / mib:>9.2f}")
    print(f"total estimated memory (without activations of the running op): {total / mib:.1f} MiB")
    print("blocks per stage (rev: rebuilds its input, buf: keeps it):")
    for r in rows:
        print(f"{r['stage']:>5}  " + ", ".join(f"{name} ({kind})" for name, kind in
                                             zip(r["classes"], r["kind"].split("+"))))
    print_last_stage(rows[-1]["last_stage"])
    if cfg.model.memory_budget:
        print_kept_plan(cfg, layout, device)
    schedule = schedule_for(cfg.train.method, num_stages)
    if any(schedule.in_flight(s) for s in range(num_stages)):  # some stage's gradients are late
        print_delays(cfg, num_stages)
    sys.stdout.flush()
    if world is not None:
        world.barrier()
    return 0
