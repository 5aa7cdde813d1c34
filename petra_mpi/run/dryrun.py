"""`--dry-run`: build every stage, push one batch of the configured shape through them, and print
the per-stage table of parameters, buffers and estimated memory; no training, and of the data
only the file's header (the image size the loader will deliver, see input_side). With
`--profile` every block is first timed on the run's device and batch (blockcost.py) and the
stages are those that balancing by measured cost gives."""
import sys

import torch

from ..archs import LM_ARCHS
from ..config import model_kwargs
from ..comm.compress import Codec
from ..core.compensation import DelayCompensation, delay_steps
from ..core.memory_plan import last_stage_graph_bytes
from ..core.optim import LRSchedule, StageOptimizer
from ..engines.build import build_stages
from ..core.schedule import delay


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


def stage_table(cfg, num_stages: int, dtype=torch.float32, partition=None,
                side=None, as_the_paper_counts=False) -> list[dict]:
    """Per-stage figures for batch `data.batch_size`, from a real forward of a zero batch;
    `partition`: blocks per stage (default model.partition, else the estimate); `side`: of the
    input images (default: input_side). Stage s holds delay(J, s) micro-batches' inputs (or
    weights) at its peak, its backward running before its forward within a tick; the paper's
    Table 3 counts one more (`as_the_paper_counts`). The last stage holds the graph of its whole
    part for one micro-batch (`graph_bytes`), or with model.rebuild_last_stage its buffered
    blocks' inputs of one micro-batch (`input_fifo_bytes`); its row gives both (`last_stage`)."""
    side = side or input_side(cfg)[0]
    stages = build_stages(cfg.model.arch, cfg.model.width, cfg.model.num_classes, num_stages,
                          seed=cfg.run.seed, imagenet_stem=cfg.model.stem == "imagenet",
                          partition=partition or cfg.model.partition,
                          buffer_inputs=cfg.train.buffer_inputs,
                          stash_weights=cfg.train.stash_weights, dtype=dtype,
                          image_size=side, model_kw=model_kwargs(cfg))
    batch = cfg.data.batch_size
    x = (torch.zeros(1, cfg.model.context, dtype=torch.long) if cfg.model.arch in LM_ARCHS
         else torch.zeros(1, 3, side, side, dtype=dtype))  # token ids, or an image
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
        in_flight = (1 if cfg.train.method == "backprop" or rebuilds else
                     delay(num_stages, stage.index) + (1 if as_the_paper_counts else 0))
        if stage.is_last:
            last = {"graph_bytes": graph, "rebuilt_bytes": fifo, "rebuilds": rebuilds}
            fifo, graph = (fifo, 0) if rebuilds else (0, graph)
        rows.append({
            "stage": stage.index, "blocks": len(stage.blocks),
            "kind": "+".join("rev" if not b else "buf" for b in stage.buffered),
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


def profile_blocks(cfg, num_stages: int, device, dtype, side: int):
    """Time every block on `side`x`side` images, print each block's and each stage's cost,
    return (PETRA's split, the split training uses, the plan's unit per block): the one
    minimising the slowest stage by the measured costs, redone with the plan's costs in the
    measured units under model.memory_budget (as run/layout.choose_layout does), or
    model.partition when it is fixed."""
    from ..core.blockcost import measured_partition_for
    from ..core.memory_plan import measured_units
    shape = (cfg.model.context,) if cfg.model.arch in LM_ARCHS else (3, side, side)
    sizes, costs, split, kept = measured_partition_for(cfg, num_stages, shape, device, dtype)
    sizes = list(cfg.model.partition or sizes)
    what = (batch_input(cfg, side) if cfg.model.arch in LM_ARCHS
            else f"of {side}x{side} images")
    print(f"measured on {device}, batch {cfg.data.batch_size} {what}, ms per micro-batch:")
    kept_header = (f" {'kept':>8}  (kept: forward + backward of a micro-batch it keeps)"
                   if costs.kept else "")  # timed under model.memory_budget only
    print(f"{'block':>5} {'forward':>8} {'backward':>8} {'in last':>8} {'step':>8}{kept_header}")
    for b, f in enumerate(costs.forward):
        print(f"{b:>5} {1e3 * f:>8.2f} {1e3 * costs.backward[b]:>8.2f} "
              f"{1e3 * costs.last[b]:>8.2f} {1e3 * costs.step[b]:>8.2f}"
              + (f" {1e3 * costs.kept[b]:>8.2f}" if costs.kept else ""))
    per_stage = costs.stage_seconds(sizes)
    print(f"split {sizes} ({'model.partition' if cfg.model.partition else 'measured balance'}): "
          f"ms per micro-batch per stage {' '.join(f'{1e3 * c:.1f}' for c in per_stage)}; "
          f"slowest / mean {max(per_stage) / (sum(per_stage) / len(per_stage)):.2f}")
    if kept is None:  # the plan, if any, is build_stages' own (estimated units)
        return sizes, sizes, None
    return sizes, split, measured_units(costs)


def batch_input(cfg, side) -> str:
    """What one micro-batch's samples are: token windows for a language model, else images."""
    if cfg.model.arch in LM_ARCHS:
        return (f"windows of {cfg.model.context} tokens "
                f"({cfg.data.batch_size * cfg.model.context} tokens a micro-batch)")
    return f"images {side}x{side}"


def split_with_plan(cfg, num_stages: int, device, dtype, side) -> list[int]:
    """The split training uses under model.memory_budget when the split is its to choose: PETRA's
    estimated balance redone with the plan's costs (memory_plan.balance_with_plan), built as
    run/assemble.py builds it (the device's memory for a fractional budget, the precision)."""
    (stage,) = build_stages(cfg.model.arch, cfg.model.width, cfg.model.num_classes, num_stages,
                            seed=cfg.run.seed, imagenet_stem=cfg.model.stem == "imagenet",
                            device=device, dtype=dtype, image_size=side,
                            model_kw=model_kwargs(cfg), precision=cfg.run.precision, only=0,
                            memory_budget=cfg.model.memory_budget,
                            batch_size=cfg.data.batch_size)
    return stage.partition


def print_kept_plan(cfg, num_stages: int, device, dtype, partition, side, petra_split=None,
                    units=None):
    """model.memory_budget's plan (memory_plan.py): per stage, how many of every d_s in-flight
    micro-batches each block keeps, the kept bytes at the peak and the predicted time per
    micro-batch, and the slowest stage's time relative to PETRA's on its own split
    (`petra_split`, None: the estimate); `units`: the plan's per block (None: estimated)."""
    from ..core.memory_plan import budget_bytes, plan_stages

    def stages_on(split):
        return build_stages(cfg.model.arch, cfg.model.width, cfg.model.num_classes, num_stages,
                            seed=cfg.run.seed, imagenet_stem=cfg.model.stem == "imagenet",
                            partition=split or cfg.model.partition, dtype=dtype,
                            image_size=side, model_kw=model_kwargs(cfg),
                            precision=cfg.run.precision)

    def make_input(n):  # token ids, or images
        return (torch.zeros(n, cfg.model.context, dtype=torch.long)
                if cfg.model.arch in LM_ARCHS else torch.zeros(n, 3, side, side, dtype=dtype))

    def plan_on(split, budget):
        return plan_stages(stages_on(split), make_input, cfg.data.batch_size, budget, device,
                           side, units)

    budget = cfg.model.memory_budget
    stages = stages_on(partition)
    plan = plan_on(partition, budget)
    petra = plan if partition == petra_split else plan_on(petra_split, 0)
    limit = budget_bytes(budget, device)
    mib = 2 ** 20
    print(f"kept blocks, model.memory_budget {budget} "
          f"({'no limit' if limit is None else f'{limit / mib:.1f} MiB'} per stage), "
          f"blocks per stage {stages[0].partition}; time per micro-batch estimated, 1 = PETRA's "
          f"slowest stage on its own split:")
    print(f"{'stage':>5} {'d_s':>4} {'kept MiB':>9} {'time':>6} {'PETRA':>6}  per block: kept of "
          f"every d_s micro-batches (- cannot keep)")
    scale = max(petra.petra_units)
    for s, stage in enumerate(stages):
        kept = " ".join(str(k) if stage.can_keep else "-" for k in plan.kept[s])
        print(f"{s:>5} {stage.window:>4} {plan.kept_bytes[s] / mib:>9.2f} "
              f"{plan.units[s] / scale:>6.3f} {plan.petra_units[s] / scale:>6.3f}  {kept}")
    slowest = max(range(len(stages)), key=lambda s: plan.units[s])
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
    """Each stage's delay and what delay compensation (optim.delay_*) makes of it, as each
    stage's optimizer sees it (built on a stand-in parameter, at a learning rate of 1)."""
    optim = cfg.optim
    comp = DelayCompensation.from_config(optim, steps_per_epoch=1)
    print(f"delays (D = d_s / k optimizer steps) and delay compensation "
          f"({'on' if comp.active else 'off'}; optim.delay_*):")
    print(f"{'stage':>5} {'d_s':>4} {'D':>6} {'momentum' if optim.name == 'sgd' else 'beta1':>8} "
          f"{'predicts (steps)':>16} {'lr factor at start':>18}")
    for s in range(num_stages):
        d = delay(num_stages, s)
        opt = StageOptimizer(torch.nn.Linear(1, 1), LRSchedule(1.0, 10**9), optim.momentum,
                             optim.nesterov, name=optim.name, betas=optim.betas,
                             delay=delay_steps(cfg.train.method, d, cfg.train.accumulation),
                             compensation=comp)
        print(f"{s:>5} {d:>4} {opt.delay:>6.2f} {opt.momentum:>8.3f} "
              f"{opt.prediction_horizon:>16.2f} {opt.lr(0):>18.3f}")
    if optim.delay_spike:
        print("spike compensation: a gradient D steps late gets the momentum it missed at once")


def report(cfg, num_stages: int, world=None, device="cpu", dtype=torch.float32,
           profile=False) -> int:
    if world is not None and world.rank != 0:
        world.barrier()
        return 0
    side, where = input_side(cfg)
    # PETRA's split and the one training uses (None: the estimate), the plan's units
    petra_split, partition, units = (profile_blocks(cfg, num_stages, device, dtype, side)
                                     if profile else (None, None, None))
    if (cfg.model.memory_budget and cfg.model.balance == "estimate"
            and not (partition or cfg.model.partition)):
        partition = split_with_plan(cfg, num_stages, device, dtype, side)
    rows = stage_table(cfg, num_stages, dtype, partition, side)
    mib = 2 ** 20
    print(f"{cfg.model.arch} width {cfg.model.width}, {num_stages} stages, method "
          f"{cfg.train.method}, batch {cfg.data.batch_size} (config {cfg.source}), "
          f"{batch_input(cfg, side)} ({where})")
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
    print_last_stage(rows[-1]["last_stage"])
    if cfg.model.memory_budget:
        print_kept_plan(cfg, num_stages, device, dtype, partition, side, petra_split, units)
    if cfg.train.method != "backprop" and num_stages > 1:
        print_delays(cfg, num_stages)
    sys.stdout.flush()
    if world is not None:
        world.barrier()
    return 0
