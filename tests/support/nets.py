"""Small nets, data and gradient helpers of the in-process tests."""
import torch
import torch.nn.functional as F

from petra_mpi.comm.compress import NO_COMPRESSION
from petra_mpi.core.planner import plan_layout
from petra_mpi.engines.build import StageSpec, build_stages, build_workers
from petra_mpi.engines.local import LocalEngine
from petra_mpi.core.optim import LRSchedule
from petra_mpi.core.schedule import Kind, updates_after
from petra_mpi.core.worker import WorkerHooks
from petra_mpi.models import NetSpec


def stages_of(arch, width, num_classes, J, *, partition=None, kept=None, only=None, replica=0,
              seed=0, image_size=32, imagenet_stem=False, model_kw=None, precision="fp32",
              **spec_kw):
    """build_stages of the net (models.NetSpec) on J stages: the split `partition`, else the
    estimate's (planner.plan_layout), with the kept plan `kept` (None: PETRA); spec_kw:
    StageSpec's fields (method, dtype, buffer_inputs, compression ...)."""
    net = NetSpec(arch, width, num_classes, imagenet_stem, image_size, model_kw, precision, seed)
    layout = plan_layout(net, J, partition=partition)
    layout.kept = kept
    return build_stages(StageSpec(net, **spec_kw), layout, only=only, replica=replica)


def make_batches(n, batch=4, size=8, dtype=torch.float64, seed=1, classes=10):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(batch, 3, size, size, generator=g, dtype=dtype),
             torch.randint(0, classes, (batch,), generator=g)) for _ in range(n)]


def flat_params(stages):
    return [p for s in stages for p in s.parameters()]


def run_engine(arch, J, k, batches, method="petra", lr=0.0, dtype=torch.float64, width=4,
               momentum=0.9, weight_decay=0.0, hooks=(), compression=NO_COMPRESSION,
               **stage_kw):
    """Train one segment on `batches` with the local engine (its messages and buffers compressed
    as `compression` says; hooks: WorkerHooks of every worker); returns the stages."""
    stages = stages_of(arch, width, 10, J, dtype=dtype, compression=compression, **stage_kw)
    workers = build_workers(stages, LRSchedule(lr, 10**6), k, momentum=momentum,
                            weight_decay=weight_decay, hooks=hooks)
    LocalEngine(workers, method, compression=compression).train_segment(iter(batches),
                                                                        len(batches))
    return stages


class AppliedGradients(WorkerHooks):
    """Sums, per parameter, the averaged gradient each optimizer step applies: before a step
    action a stage holds the gradients the step averages (one replica: nothing changes them in
    between)."""

    def __init__(self):
        self.sums = {}  # (stage, parameter index) -> sum

    def before(self, worker, action, x=None, labels=None):
        if action.kind is not Kind.STEP:
            return
        for i, p in enumerate(worker.stage.parameters()):
            g = p.grad / worker.optimizer.pending
            self.sums[(worker.index, i)] = self.sums.get((worker.index, i), 0) + g


def in_flight(stage) -> int:
    """How many micro-batches `stage` still holds something of: FIFO inputs, stashed weights or
    kept graphs (the longest of its queues); 0 after a drain."""
    return max((len(q) for q in stage.fifos + stage.stashes + stage.graphs), default=0)


def applied_gradients(arch, J, k, batches, method="petra", dtype=torch.float64, **kw):
    """Sum over the run of the averaged gradient each optimizer step applied, in network order."""
    applied = AppliedGradients()
    stages = run_engine(arch, J, k, batches, method, lr=0.0, dtype=dtype, hooks=[applied], **kw)
    return [applied.sums[key] for key in sorted(applied.sums)], stages


def end_to_end_gradients(arch, k, batches, dtype=torch.float64, width=4, **stage_kw):
    """The same sum computed by plain autograd on the whole network, one micro-batch at a time
    (stage_kw: more stages_of arguments, e.g. image_size and model_kw for revvit)."""
    (net,) = stages_of(arch, width, 10, 1, dtype=dtype, **stage_kw)
    params = list(net.parameters())
    total = [torch.zeros_like(p) for p in params]
    group = [torch.zeros_like(p) for p in params]
    count = 0
    for b, (x, y) in enumerate(batches):
        logits = x
        for block in net.blocks:
            logits = block(logits)
        grads = torch.autograd.grad(F.cross_entropy(logits, y), params)
        group = [a + g for a, g in zip(group, grads)]
        count += 1
        if updates_after(b, len(batches), k):
            total = [t + a / count for t, a in zip(total, group)]
            group, count = [torch.zeros_like(p) for p in params], 0
    return total


def max_relative_error(got, want, floor=0.0):
    """The largest relative error over the tensors, each measured against its own scale (its
    largest entry): a small tensor gets no slack from a large one elsewhere in the net, so a tiny
    gradient that came out zero, or wrong, is caught.

    A reference tensor that is exactly zero has no scale of its own: it is measured against the
    smallest normal number of its dtype, so passing needs the engine's tensor to be zero too.
    `floor` (a fraction of the largest reference entry, 0 by default) is for a test whose net has
    tensors that are zero in exact arithmetic but rounding noise in practice, where relative
    error means nothing: a tensor whose scale is below it is measured against it instead. A test
    that passes a floor must say which tensors need it and why."""
    assert len(got) == len(want), "different numbers of tensors"
    largest = max((w.abs().max().item() for w in want if w.numel()), default=0.0)
    worst = 0.0
    for g, w in zip(got, want):
        assert g.shape == w.shape, (g.shape, w.shape)
        if not w.numel():
            continue
        scale = max(w.abs().max().item(), floor * largest)
        if scale == 0.0:  # an exactly zero reference
            scale = torch.finfo(w.dtype).tiny
        worst = max(worst, (g - w).abs().max().item() / scale)
    return worst
