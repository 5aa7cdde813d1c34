"""A reversible U-Net-like encoder for pictures: a network of one's own that PETRA trains from
its import path (docs/own_model.md; examples/revunet.yaml):

    model:
      arch: examples.revunet:build
      width: 8                # channels per stream at full resolution
      depth: 2                # couplings per level
      options: {levels: 2}    # levels, each at half the resolution of the one before

The blocks: [stem, (coupling × depth, squeeze) × levels without the last squeeze, head]. Each
coupling's branches F and G are small U-Nets: a skip at the block's resolution, down by a
strided convolution, across, up by a transposed convolution and fused with the skip, so every
branch sees context at twice its scale. The levels are joined by a space-to-depth squeeze,
which moves each 2 × 2 patch of a channel into 4 channels: a permutation of the values, so
exactly invertible, and it keeps the two streams apart. The squeeze has no backward of its own:
the stage rebuilds its input with inverse() and differentiates its forward again. The stem and
the head are ordinary blocks. Batch norm is petra_mpi.models.BatchNorm2d, which PETRA's forward
leaves alone and its backward updates once per micro-batch. Picture sides must divide by
2 ** levels (28 and 32 do for 2 levels).

options: {coupling: affine} makes every coupling affine (each branch gives a log-scale and a
shift) instead of additive.
"""
import torch
import torch.nn.functional as F
from torch import nn

from petra_mpi.models import AdditiveCoupling, AffineCoupling, BatchNorm2d


def conv_bn_relu(cin, cout, stride=1):
    return nn.Sequential(nn.Conv2d(cin, cout, 3, stride, 1, bias=False), BatchNorm2d(cout),
                         nn.ReLU())


class UBranch(nn.Module):
    """A U-Net of one level: skip, down, across, up, fused with the skip; `out` channels."""

    def __init__(self, channels, out):
        super().__init__()
        self.skip = conv_bn_relu(channels, channels)
        self.down = conv_bn_relu(channels, 2 * channels, stride=2)
        self.across = conv_bn_relu(2 * channels, 2 * channels)
        self.up = nn.ConvTranspose2d(2 * channels, channels, 2, stride=2, bias=False)
        self.fuse = nn.Sequential(nn.Conv2d(2 * channels, out, 3, 1, 1, bias=False),
                                  BatchNorm2d(out))

    def forward(self, x):
        skip = self.skip(x)
        deep = self.up(self.across(self.down(skip)))
        return self.fuse(torch.cat([skip, deep], dim=1))


class Squeeze(nn.Module):
    """Space-to-depth of both streams: (N, 2c, H, W) -> (N, 8c, H/2, W/2). Channel k's 2 × 2
    patches go to channels 4k ... 4k + 3, so the first stream's stay in the first half."""
    reversible = True

    def forward(self, x):
        return F.pixel_unshuffle(x, 2)

    def inverse(self, y):
        return F.pixel_shuffle(y, 2)


class Stem(nn.Module):
    """3 × 3 convolution to both streams' channels."""

    def __init__(self, channels):
        super().__init__()
        self.body = conv_bn_relu(3, channels)

    def forward(self, x):
        return self.body(x)


class Head(nn.Module):
    """Batch norm and ReLU over both streams, global average pooling, the classifier."""

    def __init__(self, channels, num_classes):
        super().__init__()
        self.norm = BatchNorm2d(channels)
        self.fc = nn.Linear(channels, num_classes)

    def forward(self, x):
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(F.relu(self.norm(x)), 1), 1))


def build(model):
    """The blocks for the model section `model` (petra_mpi.config.ModelConfig)."""
    levels = int(model.options.get("levels", 2))
    affine = model.options.get("coupling", "additive") == "affine"
    coupling, out = (AffineCoupling, 2) if affine else (AdditiveCoupling, 1)
    stream = model.width  # channels per stream
    blocks = [Stem(2 * stream)]
    for level in range(levels):
        if level:
            blocks.append(Squeeze())
            stream *= 4
        for _ in range(model.depth):
            blocks.append(coupling(UBranch(stream, out * stream), UBranch(stream, out * stream)))
    blocks.append(Head(2 * stream, model.num_classes))
    for block in blocks:
        for m in block.modules():
            if isinstance(m, (nn.Conv2d, nn.ConvTranspose2d)):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
    return blocks
