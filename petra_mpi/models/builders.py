"""RevNet and ResNet 18/34/50 (and the fully invertible RevNets of invertible.py) as flat lists of
blocks: [stem, residual blocks..., head].

The paper's stage split keeps every residual block whole: one stage for the stem, one per block and
one for the head (10 stages for the 18-layer nets, 18 for the 34/50-layer nets).
"""
from dataclasses import dataclass

import torch
from torch import nn

from ..config import model_kwargs
from ..archs import (ARCH_NAMES, ARCHS, INVERTIBLE_ARCHS, VIT_ARCHS, default_heads,  # noqa: F401
                     is_import_path, num_blocks)
from .blocks import (DownsampleBlock, Head, PadShortcut, ResidualBlock, ReversibleBlock, Stem,
                     basic_branch, bottleneck_branch, conv_bn, set_compiled, set_precision)
from .invertible import build_invertible_blocks
from .lm import LM_ARCHS, build_lm_blocks
from .own import build_own_blocks, own_net, remember
from .vit import build_vit_blocks


def build_blocks(arch: str, width: int = 64, num_classes: int = 10, imagenet_stem: bool = False,
                 *, image_size: int = 32, **vit_kw) -> list[nn.Module]:
    """The block list; `image_size` and `vit_kw` (depth, heads, patch) concern revvit/vit only;
    for revlm/lm num_classes is the vocabulary and `vit_kw` holds depth, heads, context and
    tie_weights (models/lm.py); for a network of one's own (an import path, models/own.py) the
    model section's keys config.OWN_NET_KEYS (its function does not see the image size)."""
    if is_import_path(arch):
        return remember(build_own_blocks(arch, width, num_classes, imagenet_stem, **vit_kw),
                        arch, width, num_classes, imagenet_stem, vit_kw)
    if arch in LM_ARCHS:
        kw = dict(vit_kw)
        kw["heads"] = kw.get("heads") or default_heads(width)
        return build_lm_blocks(arch, width, num_classes, **kw)
    if arch in VIT_ARCHS:
        return build_vit_blocks(arch, width, num_classes, image_size=image_size, **vit_kw)
    if arch in INVERTIBLE_ARCHS:
        blocks = build_invertible_blocks(arch, width, num_classes, imagenet_stem)
        for block in blocks:
            _init(block)
        return blocks
    if arch not in ARCHS:
        raise ValueError(f"unknown model.arch {arch!r}; choose one of {list(ARCH_NAMES)}")
    reversible, bottleneck, layers = ARCHS[arch]
    branch_fn = bottleneck_branch if bottleneck else basic_branch
    expansion = 4 if bottleneck else 1
    streams = 2 if reversible else 1
    blocks = [Stem(streams * width, imagenet_stem)]
    cin = width
    for i, count in enumerate(layers):
        cout = width * 2 ** i * expansion
        for j in range(count):
            stride = 2 if (j == 0 and i > 0) else 1
            transition = stride != 1 or cin != cout
            if not reversible:
                shortcut = conv_bn(cin, cout, 1, stride, relu=False) if transition else nn.Identity()
                blocks.append(ResidualBlock(branch_fn(cin, cout, stride), shortcut))
            elif transition:
                transfer = (conv_bn(cin, cout, 1, stride, relu=False) if bottleneck
                            else PadShortcut(cin, cout, stride))
                blocks.append(DownsampleBlock(branch_fn(cin, cout, stride),
                                              conv_bn(cin, cout, 1, stride, relu=False), transfer))
            else:
                blocks.append(ReversibleBlock(branch_fn(cout, cout, 1)))
            cin = cout
    blocks.append(Head(streams * cin, num_classes))
    for block in blocks:
        _init(block)
    return blocks


@dataclass(frozen=True)
class NetSpec:
    """What builds a run's net, the same on every rank: build_blocks' arguments, the precision its
    blocks compute in (run.precision) and the seed its weights come from (run.seed)."""
    arch: str
    width: int
    num_classes: int
    imagenet_stem: bool = False
    image_size: int = 32  # the side of the images it takes (revvit/vit: its patches' grid)
    model_kw: dict | None = None  # depth, heads, patch of revvit/vit; context ... of revlm/lm
    precision: str = "fp32"
    seed: int = 0
    compile: bool = False  # the blocks' sub-modules through torch.compile (model.compile)

    @classmethod
    def of_config(cls, cfg, image_size: int = 32) -> "NetSpec":
        """The net of a run's config, taking images of side `image_size` (the loader's)."""
        return cls(cfg.model.arch, cfg.model.width, cfg.model.num_classes,
                   cfg.model.stem == "imagenet", image_size, model_kwargs(cfg),
                   cfg.run.precision, cfg.run.seed, cfg.model.compile)

    def blocks(self) -> list[nn.Module]:
        """A fresh copy of the net's blocks, its weights from the seed alone (the global random
        generator is seeded with it first)."""
        torch.manual_seed(self.seed)
        blocks = build_blocks(self.arch, self.width, self.num_classes, self.imagenet_stem,
                              image_size=self.image_size, **(self.model_kw or {}))
        set_precision(blocks, self.precision)
        set_compiled(blocks, self.compile)
        return blocks

    @classmethod
    def of_network(cls, network: dict) -> "NetSpec":
        """The net of build_network's arguments (an exported model's `network`)."""
        kw = {k: v for k, v in network.items()
              if k not in ("arch", "width", "num_classes", "imagenet_stem", "image_size")}
        return cls(network["arch"], network["width"], network["num_classes"],
                   network.get("imagenet_stem", False), network.get("image_size", 32), kw)

    @property
    def own(self):
        """What a network of one's own is (models/own.py: its block count, whether it reads
        tokens), built once per process; None for the built-in archs."""
        if not is_import_path(self.arch):
            return None
        return own_net(self.arch, self.width, self.num_classes, self.imagenet_stem,
                       self.model_kw or {})

    @property
    def num_blocks(self) -> int:
        if self.own:
            return self.own.num_blocks
        return num_blocks(self.arch, (self.model_kw or {}).get("depth", 0))

    @property
    def takes_tokens(self) -> bool:
        """Whether its input is windows of token ids (a language model), not images."""
        return self.own.takes_tokens if self.own else self.arch in LM_ARCHS

    @property
    def input_shape(self) -> tuple:
        """One sample's shape: a window of token ids (revlm/lm), else an image."""
        if self.takes_tokens:
            return (self.model_kw["context"],)
        return (3, self.image_size, self.image_size)

    def zeros(self, n: int, dtype=torch.float32) -> torch.Tensor:
        """A network input of n samples of zeros (token ids are int64 whatever `dtype`)."""
        if self.takes_tokens:
            return torch.zeros(n, *self.input_shape, dtype=torch.long)
        return torch.zeros(n, *self.input_shape, dtype=dtype)


class Network(nn.Module):
    """The whole net as one ordinary module: its blocks applied in order. Its state_dict names,
    blocks.{g}.{rest} with g the block's index in the network, are those of a checkpoint (which
    stores every stage's blocks under them), so a trained pipeline loads into it as it is."""

    def __init__(self, blocks):
        super().__init__()
        self.blocks = nn.ModuleList(blocks)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


def build_network(arch: str, width: int = 64, num_classes: int = 10, imagenet_stem: bool = False,
                  *, image_size: int = 32, **vit_kw) -> Network:
    """The plain model of `arch`, in one process (build_blocks' arguments)."""
    return Network(build_blocks(arch, width, num_classes, imagenet_stem, image_size=image_size,
                                **vit_kw))


def _init(module: nn.Module):
    for m in module.modules():
        if isinstance(m, nn.Conv2d):
            nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")


def count_parameters(blocks) -> int:
    return sum(p.numel() for b in blocks for p in b.parameters())
