"""The model architectures by name and their block counts, without torch: the config checks
model.arch and model.stages with these before any rank loads torch (models/ builds the nets).
model.arch may also be an import path, "package.module:function", of a network of one's own
(models/own.py): its blocks, and so their count, are known once the function has built them."""
import re
import typing

# Every model.arch: the CNNs of the paper, the fully invertible RevNets (models/invertible.py),
# the vision transformers (models/vit.py) and the causal language models (models/lm.py).
Arch = typing.Literal["resnet18", "resnet34", "resnet50", "revnet18", "revnet34", "revnet50",
                      "irevnet18", "irevnet34", "irevnet50", "revvit", "vit", "revlm", "lm"]
ARCH_NAMES = typing.get_args(Arch)

ARCHS = {  # name: (reversible, bottleneck, blocks per layer)
    "resnet18": (False, False, (2, 2, 2, 2)),
    "resnet34": (False, False, (3, 4, 6, 3)),
    "resnet50": (False, True, (3, 4, 6, 3)),
    "revnet18": (True, False, (2, 2, 2, 2)),
    "revnet34": (True, False, (3, 4, 6, 3)),
    "revnet50": (True, True, (3, 4, 6, 3)),
}
INVERTIBLE_ARCHS = {  # name: (bottleneck branches, blocks per layer), the RevNets' layouts
    "irevnet18": (False, (2, 2, 2, 2)),
    "irevnet34": (False, (3, 4, 6, 3)),
    "irevnet50": (True, (3, 4, 6, 3)),
}
VIT_ARCHS = ("revvit", "vit")
LM_ARCHS = ("revlm", "lm")  # [embedding, depth decoder blocks, head], like the ViTs
DEFAULT_DEPTH = 8  # transformer blocks of revvit/vit when model.depth is 0
# "package.module:function": dotted Python names, a colon, the function's name
IMPORT_PATH = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*")


def is_import_path(arch) -> bool:
    """Whether model.arch names a network of one's own, "package.module:function"."""
    return isinstance(arch, str) and IMPORT_PATH.fullmatch(arch) is not None


def vit_num_blocks(depth: int) -> int:
    return (depth or DEFAULT_DEPTH) + 2


def num_blocks(arch: str, depth: int = 0) -> int:
    """Number of blocks (stem + residual or transformer blocks + head): the most stages the net can
    be split into. `depth`: transformer blocks of revvit/vit (0: the default). A network of
    one's own counts its blocks once built (models.NetSpec.num_blocks)."""
    if is_import_path(arch):
        raise ValueError(f"{arch}: a network of your own has as many blocks as its function "
                         f"returns, known once it is built")
    if arch in VIT_ARCHS or arch in LM_ARCHS:
        return vit_num_blocks(depth)
    if arch in INVERTIBLE_ARCHS:
        return sum(INVERTIBLE_ARCHS[arch][1]) + 2
    return sum(ARCHS[arch][2]) + 2


def default_heads(width: int) -> int:
    """model.heads = 0: one head per 64 features (at least one), as in ViT/DeiT."""
    return max(1, width // 64)
