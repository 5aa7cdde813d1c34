"""Fully invertible RevNets (the bijective i-RevNet design of Jacobsen et al., 2018): every block
between the stem and the head is a bijection, downsampling included, so in PETRA no stage but the
stem's buffers an input (the head runs in the last stage's fused step and keeps nothing).

Invertible downsampling. Space-to-depth S (torch's pixel_unshuffle by 2) moves each 2x2 patch of a
channel into 4 channels at half the resolution: a permutation of the entries, exactly invertible.
The downsampling block is the coupling rule with S on both paths,

    (y1, y2) = (S(x2) + F(x1), S(x1)),    inverse  x1 = S⁻¹(y2),  x2 = S⁻¹(y1 − F(x1)),

with F a stride-2 branch from c to 4c channels. A bijection keeps the number of entries, so
every downsampling multiplies the stream width by 4 (RevNet's lossy transition doubles it): the
streams are width·4^i channels wide in layer i, and the branches keep RevNet's inner widths
(width·2^i) so the extra width costs the branches' outer convolutions only. There are no
stride-1 width changes (RevNet50's first block widens 64 -> 256 without downsampling; here layer 1
keeps the stem's width).
"""
import torch
import torch.nn.functional as F
from torch import nn

from ..archs import INVERTIBLE_ARCHS
from .blocks import BatchNorm2d, Head, ReversibleBlock, Stem, conv_bn



def squeeze(x):
    """Space-to-depth: (N, C, H, W) -> (N, 4C, H/2, W/2), a permutation of the entries."""
    return F.pixel_unshuffle(x, 2)


def unsqueeze(y):
    """The inverse of squeeze."""
    return F.pixel_shuffle(y, 2)


class InvertibleDownsampleBlock(ReversibleBlock):
    """i-RevNet's downsampling coupling (see the module docstring): a bijection from 2 streams of
    c channels at HxW to 2 streams of 4c channels at H/2 x W/2. Reversible like the coupling
    block, so a PETRA stage rebuilds its input instead of buffering it."""

    def forward(self, x):
        x1, x2 = x.chunk(2, dim=1)
        return torch.cat([squeeze(x2) + self.f(x1), squeeze(x1)], dim=1)

    def inverse(self, y):
        y1, y2 = y.chunk(2, dim=1)
        x1 = unsqueeze(y2)
        return torch.cat([x1, unsqueeze(y1 - self.f(x1))], dim=1)

    def backward_from_output(self, y, grad_y, need_grad_x=True):
        """As ReversibleBlock's: one forward of F under autograd rebuilds x2 and gives F's
        vector-Jacobian product. S is linear and orthogonal (a permutation), so the gradients pass
        through it by S⁻¹: δx1 = S⁻¹(δy2) + Fᵀ(δy1), δx2 = S⁻¹(δy1)."""
        y1, y2 = y.chunk(2, dim=1)
        g1, g2 = grad_y.chunk(2, dim=1)
        x1 = unsqueeze(y2.detach()).requires_grad_(need_grad_x)
        with torch.enable_grad():
            f = self.f(x1)
        x2 = unsqueeze(y1 - f.detach())
        f.backward(g1)
        x = torch.cat([x1.detach(), x2], dim=1)
        grad_x = torch.cat([unsqueeze(g2) + x1.grad, unsqueeze(g1)], dim=1) if need_grad_x else None
        return x, grad_x


class NormalizedHead(Head):
    """Batch norm and ReLU over both streams, then the head (i-RevNet's last layers). Nothing
    renormalises the streams of a fully invertible net on their way (RevNet's downsampling
    shortcuts end in batch norm), so their scale grows with depth; without this normalisation the
    logits follow it, and delayed gradients diverge where backprop's do not."""

    def __init__(self, cin, num_classes):
        super().__init__(cin, num_classes)
        self.norm = BatchNorm2d(cin)

    def _logits(self, x):
        return super()._logits(F.relu(self.norm(x)))


def branch(cin, mid, cout, stride, bottleneck):
    """F from cin to cout channels through `mid` inner channels: two 3x3 convolutions (basic), or
    1x1, 3x3 (carrying the stride), 1x1 (bottleneck); no ReLU at the end, as in ResNet."""
    if bottleneck:
        return nn.Sequential(conv_bn(cin, mid, 1), conv_bn(mid, mid, 3, stride),
                             conv_bn(mid, cout, 1, relu=False))
    return nn.Sequential(conv_bn(cin, mid, 3, stride), conv_bn(mid, cout, 3, 1, relu=False))


def build_invertible_blocks(arch, width, num_classes, imagenet_stem) -> list[nn.Module]:
    """[stem, couplings and invertible downsamplings..., head] of `arch` (INVERTIBLE_ARCHS)."""
    bottleneck, layers = INVERTIBLE_ARCHS[arch]
    blocks = [Stem(2 * width, imagenet_stem)]
    streams = width  # channels per stream
    for i, count in enumerate(layers):
        mid = width * 2 ** i
        for j in range(count):
            if j == 0 and i > 0:
                blocks.append(InvertibleDownsampleBlock(
                    branch(streams, mid, 4 * streams, 2, bottleneck)))
                streams *= 4
            else:
                blocks.append(ReversibleBlock(branch(streams, mid, streams, 1, bottleneck)))
    blocks.append(NormalizedHead(2 * streams, num_classes))
    return blocks
