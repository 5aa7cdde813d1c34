"""torch.distributed.pipelining's schedules as contenders of `bench peers`: GPipe, 1F1B (plain
and with every block checkpointed) and interleaved zero bubble with one stage per rank, and
interleaved 1F1B, ZB-V and DualPipeV with two stages per rank (the net split into 2J stages),
over gloo, on any list of blocks run with autograd (activations stored): the plain twin of
PETRA's net, or PETRA's reversible net itself."""
import contextlib
from itertools import chain

import torch
import torch.nn.functional as F
import torch.utils.checkpoint as cp
from torch import nn

from ...core.partition import split_blocks
from .meter import ActivationMeter, counting_recomputation

LR, MOMENTUM = 0.01, 0.9
ZERO_BUBBLE = "zero_bubble"
# where a schedule's stages sit: one per rank (passed alone or in a list), or two per rank,
# rank r holding stages r and r + J (a loop) or r and 2J - 1 - r (a V)
ONE, ONE_IN_LIST, LOOP, V = "one", "one in a list", "loop", "v"
# name -> (schedule class name, where its stages sit, every block checkpointed)
SCHEDULES = {"gpipe": ("ScheduleGPipe", ONE, False), "1f1b": ("Schedule1F1B", ONE, False),
             "1f1b_checkpointed": ("Schedule1F1B", ONE, True),
             ZERO_BUBBLE: ("ScheduleInterleavedZeroBubble", ONE_IN_LIST, False),
             "interleaved_1f1b": ("ScheduleInterleaved1F1B", LOOP, False),
             "zbv": ("ScheduleZBVZeroBubble", V, False),
             "dualpipev": ("ScheduleDualPipeV", V, False)}
# the schedules that split the backward into input and weight gradients: torch refuses (ZB-V,
# DualPipeV) or cannot split (a compiled graph's backward is one node) compiled stages
SPLIT_BACKWARD = {ZERO_BUBBLE, "zbv", "dualpipev"}


def stage_indices(placement, rank, J) -> list[int]:
    """The pipeline stages that rank `rank` of J holds under `placement`."""
    if placement == LOOP:
        return [rank, rank + J]
    if placement == V:
        return [rank, 2 * J - 1 - rank]
    return [rank]


def stages_per_rank(name) -> int:
    return 2 if SCHEDULES[name][1] in (LOOP, V) else 1


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
    """One schedule on this rank's stages of `blocks`, a fresh net split as `sizes` (blocks per
    pipeline stage: J of them, or 2J for a schedule with two stages per rank)."""

    def __init__(self, schedule, blocks, sizes, world, microbatches, batch_input):
        import torch.distributed.pipelining as pipelining
        cls_name, placement, self.checkpointed = SCHEDULES[schedule]
        r, J = world.rank, world.size
        indices = stage_indices(placement, r, J)
        parts = split_blocks(blocks, sizes)
        self.modules = nn.ModuleList()
        self.stages = []
        for index in indices:
            x_in, x_out = _stage_shapes(blocks, sizes, index, batch_input)
            module = PTStage(parts[index], self.checkpointed)
            self.modules.append(module)
            self.stages.append(pipelining.PipelineStage(
                module, index, len(sizes), torch.device("cpu"),
                # the metadata says which gradients travel: a received input's and every output's
                input_args=torch.empty_like(x_in).requires_grad_(
                    index > 0 and x_in.is_floating_point()),
                output_args=torch.empty_like(x_out).requires_grad_()))
        self.first = 0 in indices
        self.last = len(sizes) - 1 in indices
        self.schedule = getattr(pipelining, cls_name)(
            self.stages[0] if placement == ONE else self.stages, microbatches, loss_fn=_loss)
        self.opt = torch.optim.SGD(self.modules.parameters(), lr=LR, momentum=MOMENTUM,
                                   nesterov=True)

    def step(self, x, labels):
        """One step of the schedule (the data where this rank holds the first stage, the labels
        where it holds the last: both on rank 0 of a V), then the optimizer's."""
        args = (x,) if self.first else ()
        target = {"target": labels} if self.last else {}
        self.schedule.step(*args, return_outputs=False, **target)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)

    def measure(self, x, labels) -> int:
        def explicit():
            for stage in self.stages:
                for outputs, inputs in stage.fwd_cache.values():
                    yield from (t for t in chain(outputs, inputs) if isinstance(t, torch.Tensor))
        meter = ActivationMeter(self.modules, explicit)
        recount = counting_recomputation(meter) if self.checkpointed else contextlib.nullcontext()
        with meter.hooks(), recount:
            self.step(x, labels)
        return meter.peak


def _stage_shapes(blocks, sizes, index, batch_input):
    """(input, output) of pipeline stage `index` for one micro-batch, from a no-graph pass in
    eval mode (batch-norm statistics untouched)."""
    start = sum(sizes[:index])
    x = batch_input
    with torch.no_grad():
        for i, b in enumerate(blocks[:start + sizes[index]]):
            b.eval()
            if i == start:
                x_in = x
            x = b(x)
            b.train()
    return x_in, x


def pipelining_contenders(world, nets, microbatches, batch_input, names):
    """({name: PTContender}, {name: why it did not build}) for every schedule of `names` (a
    schedule's name plus a net's suffix) on the nets of `nets` ({suffix: (make_blocks,
    {stage count: split})}: a split of J stages, and one of 2J for the schedules with two
    stages per rank where the net has enough blocks); a contender that fails to build on any
    rank is dropped on every rank, so no rank waits on a schedule the others skip."""
    pts, skipped = {}, {}
    for suffix, (make_blocks, splits) in nets.items():
        for schedule in SCHEDULES:
            name = schedule + suffix
            if name not in names:
                continue
            stages = stages_per_rank(schedule) * world.size
            try:
                if stages not in splits or 0 in splits[stages]:
                    raise ValueError(f"{stages} pipeline stages need at least {stages} blocks, "
                                     "one per stage")
                torch.manual_seed(0)
                pts[name] = PTContender(schedule, make_blocks(), splits[stages], world,
                                        microbatches, batch_input)
                err = None
            except Exception as e:  # noqa: BLE001 - reported, the others still run
                err = f"{type(e).__name__}: {e}".splitlines()[0]
            errors = [e for e in world.allgather(err) if e]
            if errors:
                pts.pop(name, None)
                skipped[name] = errors[0]
    return pts, skipped
