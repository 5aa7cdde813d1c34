"""Network blocks. Every block maps one tensor to one tensor, so any run of consecutive blocks can
form a pipeline stage and every message between stages is a single contiguous tensor.

Reversible nets carry two streams of equal width concatenated along channels: (x1, x2).
"""
import contextlib

import torch
import torch.nn.functional as F
from torch import nn

_bn_updates_running_stats = True
_bn_batch_stats = None  # a list while recorded_bn_stats is active


@contextlib.contextmanager
def frozen_bn_stats():
    """Within this context, training-mode batch norm normalises with batch statistics but leaves its
    running statistics alone (PETRA's forward pass; the backward recomputation updates them)."""
    global _bn_updates_running_stats
    saved, _bn_updates_running_stats = _bn_updates_running_stats, False
    try:
        yield
    finally:
        _bn_updates_running_stats = saved


@contextlib.contextmanager
def recorded_bn_stats(into: list):
    """Within this context (and frozen_bn_stats), each training-mode batch norm also appends
    (module, batch mean, unbiased batch variance) to `into`, taken from the normalisation itself,
    so that the running statistics can be updated later (BatchNorm2d.update_running_stats)
    without another pass over the input: what a kept forward needs (core/stages.py)."""
    global _bn_batch_stats
    saved, _bn_batch_stats = _bn_batch_stats, into
    try:
        yield
    finally:
        _bn_batch_stats = saved


class BatchNorm2d(nn.BatchNorm2d):
    def forward(self, x):
        if self.training and not _bn_updates_running_stats:
            if _bn_batch_stats is not None and self.track_running_stats:
                # with momentum 1 the buffers come out as the batch's mean and unbiased variance
                mean, var = torch.zeros_like(self.running_mean), torch.ones_like(self.running_var)
                _bn_batch_stats.append((self, mean, var))
                return F.batch_norm(x, mean, var, self.weight, self.bias, True, 1.0, self.eps)
            return F.batch_norm(x, None, None, self.weight, self.bias, True, 0.0, self.eps)
        return super().forward(x)

    @torch.no_grad()
    def update_running_stats(self, mean, var):
        """The running statistics' update of a training-mode forward whose batch had this mean
        and unbiased variance (nn.BatchNorm2d's rule, momentum None included)."""
        self.num_batches_tracked.add_(1)
        m = 1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum
        self.running_mean.copy_(m * mean + (1 - m) * self.running_mean)
        self.running_var.copy_(m * var + (1 - m) * self.running_var)


def joined(like, dim, op, a, b, other, op_first=True):
    """torch.cat([op(a, b), other], dim), or [other, op(a, b)] without op_first, shaped as
    `like`: op writes straight into its half of the result, which saves a temporary and a copy
    of it (a coupling block's two streams are one tensor). Bitwise the cat's result. Under
    autograd (an input that requires grad) it is the cat itself: an out= op records no graph."""
    if torch.is_grad_enabled() and (a.requires_grad or b.requires_grad or other.requires_grad):
        return torch.cat([op(a, b), other] if op_first else [other, op(a, b)], dim)
    out = torch.empty_like(like)
    first, second = out.split([a.shape[dim], other.shape[dim]] if op_first
                              else [other.shape[dim], a.shape[dim]], dim)
    into, rest = (first, second) if op_first else (second, first)
    op(a, b, out=into)
    rest.copy_(other)
    return out


PRECISIONS = {"fp32": None, "bf16": torch.bfloat16}


class MixedPrecision:
    """Mixed precision INSIDE a block: its sub-modules (branch, body, shortcut, head) run under
    torch.autocast(compute_dtype) and their outputs are cast back to the input's dtype before the
    block adds or concatenates them. So the tensors between blocks and both coupling streams keep
    the storage dtype (float32), and a coupling block's inverse x2 = y1 - F(y2) cancels F up to
    float32 rounding: F is a deterministic function of (y2 = x1, θ) whatever its inner precision."""
    compute_dtype = None  # None: no autocast (set per block by set_precision)
    compiled = None  # {sub-module: its torch.compile'd twin} once set_compiled has run

    def sub(self, module, x):
        if self.compiled is not None:
            module = self._compiled(module)
        if self.compute_dtype is None:
            return module(x)
        with torch.autocast(x.device.type, dtype=self.compute_dtype):
            out = module(x)
        return out.to(x.dtype)

    def _compiled(self, module):
        # torch.compile of the sub-module itself (not torch.nn.Module.compile, whose compiled
        # frame is torch's own _call_impl: dynamo skips it and would compile only our batch
        # norms). The twin sits in a plain dict, outside the module tree: the state dict, the
        # parameters and what torch's pipelining schedules inspect stay those of the eager
        # module.
        twin = self.compiled.get(module)
        if twin is None:
            twin = self.compiled[module] = torch.compile(module, dynamic=False)
        return twin


# Sequential.forward is one code object for every branch of a net, and dynamo keeps a graph per
# shape, dtype, grad mode and batch-norm mode of each: far more than its default of 8, past
# which it runs the rest eagerly without a word.
COMPILED_GRAPHS_PER_CODE = 512


def set_compiled(modules, on: bool = True):
    """Make every MixedPrecision block among `modules` (and their children) run its sub-modules
    (branches, shortcuts, bodies, heads) through torch.compile (model.compile): the forward, the
    inverse and the rebuild with its backward all call them, so all three are compiled, each
    graph once, at its first call (inductor: C++ on CPUs, Triton on GPUs)."""
    if on:
        import torch._dynamo
        config = torch._dynamo.config
        config.recompile_limit = max(config.recompile_limit, COMPILED_GRAPHS_PER_CODE)
        config.accumulated_recompile_limit = max(config.accumulated_recompile_limit,
                                                 4 * COMPILED_GRAPHS_PER_CODE)
    for top in modules:
        for m in top.modules():
            if isinstance(m, MixedPrecision):
                m.compiled = {} if on else None


def set_precision(modules, precision: str):
    """Make every MixedPrecision block among `modules` (and their children) compute in
    `precision` (fp32 or bf16; see PRECISIONS)."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    for top in modules:
        for m in top.modules():
            if isinstance(m, MixedPrecision):
                m.compute_dtype = PRECISIONS[precision]


def conv_bn(cin, cout, kernel, stride=1, relu=True):
    layers = [nn.Conv2d(cin, cout, kernel, stride, kernel // 2, bias=False), BatchNorm2d(cout)]
    if relu:
        layers.append(nn.ReLU(inplace=True))
    return nn.Sequential(*layers)


def basic_branch(cin, cout, stride):
    """The residual branch of a ResNet basic block, without the skip connection."""
    return nn.Sequential(conv_bn(cin, cout, 3, stride), conv_bn(cout, cout, 3, 1, relu=False))


def bottleneck_branch(cin, cout, stride):
    """The residual branch of a ResNet bottleneck block (expansion 4), without the skip."""
    mid = cout // 4
    return nn.Sequential(conv_bn(cin, mid, 1), conv_bn(mid, mid, 3, stride),
                         conv_bn(mid, cout, 1, relu=False))


class Stem(MixedPrecision, nn.Module):
    """CIFAR stem: 3x3 conv. ImageNet stem: 7x7 stride-2 conv and 3x3 stride-2 max-pool."""
    reversible = False

    def __init__(self, cout, imagenet):
        super().__init__()
        if imagenet:
            self.body = nn.Sequential(conv_bn(3, cout, 7, 2), nn.MaxPool2d(3, 2, 1))
        else:
            self.body = conv_bn(3, cout, 3)

    def forward(self, x):
        return self.sub(self.body, x)


class ResidualBlock(MixedPrecision, nn.Module):
    """Plain ResNet block: relu(branch(x) + shortcut(x))."""
    reversible = False

    def __init__(self, branch, shortcut):
        super().__init__()
        self.branch, self.shortcut = branch, shortcut

    def forward(self, x):
        return F.relu(self.sub(self.branch, x) + self.sub(self.shortcut, x))


class ReversibleBlock(MixedPrecision, nn.Module):
    """Coupling block (paper Fig. 2b): (y1, y2) = (x2 + F(x1), x1); inverse x1 = y2, x2 = y1 - F(y2)."""
    reversible = True

    def __init__(self, branch):
        super().__init__()
        self.branch = branch

    def f(self, x1):
        """The branch F, in the block's compute precision, returned in x1's dtype."""
        return self.sub(self.branch, x1)

    def forward(self, x):
        x1, x2 = x.chunk(2, dim=1)
        return joined(x, 1, torch.add, x2, self.f(x1), x1)

    def inverse(self, y):
        y1, y2 = y.chunk(2, dim=1)
        return joined(y, 1, torch.sub, y1, self.f(y2), y2, op_first=False)

    def backward_from_output(self, y, grad_y, need_grad_x=True):
        """Rebuild x from y with the current weights while recording the graph of F (one forward
        of F, not two), and back-propagate δy: accumulates the parameter gradients and returns
        (x, δx) (δx None when not needed)."""
        y1, y2 = y.chunk(2, dim=1)
        g1, g2 = grad_y.chunk(2, dim=1)
        x1 = y2.detach().requires_grad_(need_grad_x)
        with torch.enable_grad():
            f = self.f(x1)
        x = joined(y, 1, torch.sub, y1, f.detach(), y2, op_first=False)
        f.backward(g1)
        grad_x = joined(grad_y, 1, torch.add, g2, x1.grad, g1) if need_grad_x else None
        return x, grad_x


class PadShortcut(nn.Module):
    """Parameter-free shortcut (option A of He et al.): subsample by the stride, zero-pad channels."""

    def __init__(self, cin, cout, stride):
        super().__init__()
        self.pad, self.stride = cout - cin, stride

    def forward(self, x):
        x = x[:, :, ::self.stride, ::self.stride]
        return F.pad(x, (0, 0, 0, 0, 0, self.pad))


class DownsampleBlock(MixedPrecision, nn.Module):
    """Non-reversible transition of a RevNet between stream widths/resolutions.

    The coupling rule with its identities replaced by shortcuts: (y1, y2) = (S(x2) + F(x1), T(x1)),
    S a 1x1 projection; T a projection in bottleneck nets and parameter-free in basic-block nets,
    which puts the parameter counts of all three RevNets within 1% of the paper's Table 2.
    """
    reversible = False

    def __init__(self, branch, shortcut, transfer):
        super().__init__()
        self.branch, self.shortcut, self.transfer = branch, shortcut, transfer

    def forward(self, x):
        x1, x2 = x.chunk(2, dim=1)
        return torch.cat([self.sub(self.shortcut, x2) + self.sub(self.branch, x1),
                          self.sub(self.transfer, x1)], dim=1)


class Head(MixedPrecision, nn.Module):
    """Global average pooling and the linear classifier."""
    reversible = False

    def __init__(self, cin, num_classes):
        super().__init__()
        self.fc = nn.Linear(cin, num_classes)

    def forward(self, x):
        return self.sub(self._logits, x)

    def _logits(self, x):
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))
