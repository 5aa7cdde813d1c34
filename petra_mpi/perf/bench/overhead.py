"""One steady-state PETRA tick over all stages (every stage forwards one micro-batch and
backwards another, rebuilding or popping its inputs, then steps) against one plain autograd
training step of the same network on the same batch. Ideal ratio 4/3: one extra forward.
`--device cuda` times on the GPU (synchronised around every timed call), `--precision bf16` with
bf16 autocast inside the blocks (run.precision); the tick is also the time per micro-batch of
the whole net in one process."""
import argparse

import torch
import torch.nn.functional as F

from ...comm.devices import synchronize
from ...core.planner import plan_layout
from ...engines.build import StageSpec, build_stages, build_workers
from ...models import PRECISIONS, NetSpec, num_blocks
from ...models.lm import LM_ARCHS
from ...models.vit import VIT_ARCHS
from ...core.optim import StageOptimizer, constant_lr
from .common import alternate, emit, random_batch


def main(argv):
    a = parse_args(argv)
    report(a, run(a))


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m petra_mpi.bench overhead", description=__doc__)
    p.add_argument("--arch", default="revnet18")
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--stages", type=int, default=0, help="0: one block per stage")
    p.add_argument("--depth", type=int, default=0,
                   help="revvit/vit/revlm/lm: blocks (0: the default; 4 for a language model)")
    p.add_argument("--heads", type=int, default=0,
                   help="revvit/vit/revlm/lm: heads (0: width / 64)")
    p.add_argument("--patch", type=int, default=4, help="revvit/vit: patch side")
    p.add_argument("--context", type=int, default=64,
                   help="revlm/lm: tokens per window (a micro-batch is --batch windows of random "
                        "byte ids, a label per token)")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    p.add_argument("--precision", choices=tuple(PRECISIONS), default="fp32")
    return p.parse_args(argv)


def run(a) -> dict:
    """Time the tick and the plain step; the figures of the JSON line."""
    if a.threads:
        torch.set_num_threads(a.threads)
    device = torch.device(a.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device is visible")
    sync = lambda: synchronize(device)  # noqa: E731
    lm = a.arch in LM_ARCHS
    workers, model, (x0, labels) = build(a, device, lm)
    plain_opt = StageOptimizer(model, constant_lr())
    inputs, x = [], x0
    for w in workers[:-1]:  # fills each FIFO with one entry: the steady state of a tick
        inputs.append(x)
        x = w.forward(0, x)
    inputs.append(x)
    grads = [torch.randn_like(inputs[s + 1]) for s in range(len(workers) - 1)]
    counter = [0]

    def petra_tick():
        b = counter[0] = counter[0] + 1
        for s, w in enumerate(workers):
            if w.is_last:
                w.forward_backward(b, inputs[s], labels)
            else:  # the schedule's order within a tick: backward, forward, step
                w.backward(b, inputs[s + 1], grads[s])
                w.forward(b, inputs[s])
            w.step(b)

    def plain_step():
        F.cross_entropy(model(x0), labels).backward()
        plain_opt.accumulated()
        plain_opt.step()

    alternate({"petra": petra_tick, "plain": plain_step}, 1, sync)  # warm-up
    med = alternate({"petra": petra_tick, "plain": plain_step}, a.repeats, sync)
    where = (torch.cuda.get_device_name(device) if device.type == "cuda"
             else f"cpu, {torch.get_num_threads()} threads")
    return {"bench": "overhead", "arch": a.arch, "width": a.width, "batch": a.batch,
            "stages": len(workers), "threads": torch.get_num_threads(), "device": where,
            "precision": a.precision, "petra_tick_s": med["petra"],
            "plain_step_s": med["plain"], "ratio": med["petra"] / med["plain"],
            **({"context": a.context, "tokens_per_s": a.batch * a.context / med["petra"]}
               if lm else {})}


def build(a, device, lm):
    """(the PETRA workers of J stages, the same net as one plain module, a random batch
    (inputs, labels) on `device`)."""
    classes, depth = (256, a.depth or 4) if lm else (10, a.depth)
    model_kw = None
    if a.arch in VIT_ARCHS:
        model_kw = dict(depth=depth, heads=a.heads, patch=a.patch)
    elif lm:
        model_kw = dict(depth=depth, heads=a.heads, context=a.context)
    net = NetSpec(a.arch, a.width, classes, model_kw=model_kw, precision=a.precision)
    spec = StageSpec(net, device=device)
    J = a.stages or num_blocks(a.arch, depth)
    workers = build_workers(build_stages(spec, plan_layout(net, J)), constant_lr())
    for w in workers:
        w.begin_segment()
    (whole,) = build_stages(spec, plan_layout(net, 1))
    batch = random_batch(a.batch, classes, torch.Generator().manual_seed(0),
                         a.context if lm else 0)
    return workers, torch.nn.Sequential(*whole.blocks), [t.to(device) for t in batch]


def report(a, r: dict):
    print(f"{r['arch']} width {r['width']}, batch {r['batch']}, {r['stages']} stages, "
          f"{r['precision']}, {r['device']}, median of {a.repeats} alternated runs")
    print(f"  PETRA tick over all stages : {r['petra_tick_s'] * 1e3:9.1f} ms")
    print(f"  plain autograd step        : {r['plain_step_s'] * 1e3:9.1f} ms")
    print(f"  ratio                      : {r['ratio']:9.3f}   (ideal 4/3 = 1.333, target <= 1.45)")
    emit(r)
