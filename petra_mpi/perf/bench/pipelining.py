"""torch.distributed.pipelining's schedules as contenders of `bench peers`: GPipe, 1F1B (plain
and with every block checkpointed) and interleaved zero bubble, one stage per rank over gloo, on
any list of blocks run with autograd (activations stored): the plain twin of PETRA's net, or
PETRA's reversible net itself."""
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
# name -> (schedule class name, takes a list of stages, every block checkpointed)
SCHEDULES = {"gpipe": ("ScheduleGPipe", False, False), "1f1b": ("Schedule1F1B", False, False),
             "1f1b_checkpointed": ("Schedule1F1B", False, True),
             ZERO_BUBBLE: ("ScheduleInterleavedZeroBubble", True, False)}


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
    """One schedule on this rank's part (`sizes`: blocks per rank) of `blocks`, a fresh net."""

    def __init__(self, schedule, blocks, sizes, world, microbatches, batch_input):
        import torch.distributed.pipelining as pipelining
        cls_name, multi, self.checkpointed = SCHEDULES[schedule]
        r, J = world.rank, world.size
        start = sum(sizes[:r])
        with torch.no_grad():  # shapes of this rank's micro-batch input and output
            x = batch_input
            for i, b in enumerate(blocks[:start + sizes[r]]):
                b.eval()
                if i == start:
                    x_in = x
                x = b(x)
                b.train()
        self.module = PTStage(split_blocks(blocks, sizes)[r], self.checkpointed)
        self.stage = pipelining.PipelineStage(
            self.module, r, J, torch.device("cpu"),
            # the metadata says which gradients travel: a received input's and every output's
            input_args=torch.empty_like(x_in).requires_grad_(r > 0 and x_in.is_floating_point()),
            output_args=torch.empty_like(x).requires_grad_())
        self.schedule = getattr(pipelining, cls_name)([self.stage] if multi else self.stage,
                                                      microbatches, loss_fn=_loss)
        self.opt = torch.optim.SGD(self.module.parameters(), lr=LR, momentum=MOMENTUM,
                                   nesterov=True)
        self.world = world

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


def pipelining_contenders(world, nets, microbatches, batch_input, zero_bubble=True):
    """({name: PTContender}, {name: why it did not build}) for every schedule on every net of
    `nets` ({suffix: (make_blocks, sizes)}: contender names are the schedule's plus the suffix);
    a contender that fails to build on any rank is dropped on every rank, so no rank waits on a
    schedule the others skip."""
    pts, skipped = {}, {}
    for suffix, (make_blocks, sizes) in nets.items():
        for schedule in SCHEDULES:
            if schedule == ZERO_BUBBLE and not zero_bubble:
                continue
            name = schedule + suffix
            try:
                torch.manual_seed(0)
                pts[name] = PTContender(schedule, make_blocks(), sizes, world, microbatches,
                                        batch_input)
                err = None
            except Exception as e:  # noqa: BLE001 - reported, the others still run
                err = f"{type(e).__name__}: {e}".splitlines()[0]
            errors = [e for e in world.allgather(err) if e]
            if errors:
                pts.pop(name, None)
                skipped[name] = errors[0]
    return pts, skipped
