"""A network of one's own: model.arch is the import path "package.module:function" of a function
that takes the model section of the config (a config.ModelConfig) and returns the network's
blocks in order (docs/own_model.md).

Each block maps one tensor to one tensor, as the built-in blocks do. A block is reversible when
it says so (`reversible = True`): it then has `inverse(y)`, and may have
`backward_from_output(y, grad_y, need_grad_x)` (without it a stage rebuilds the input by the
inverse and differentiates a recomputed forward; coupling.py's blocks have their own, which runs
each branch once). Any other module is an ordinary block, whose stage keeps its input and
recomputes its forward in the backward, as the stem and the head. The first block of a network
that reads token ids says so with `input_dtype = torch.long` (a language model, as
lm.TokenEmbed).

Everything here fails with OwnModelError, one line naming the import path and what is wrong.
"""
import dataclasses
import importlib
import json
import os
import traceback

import torch
from torch import nn

from ..config import ModelConfig


class OwnModelError(ValueError):
    """A network of one's own that cannot be imported, built or run: one line."""


# Frames in these folders are not the user's code (raised names the user's frame).
NOT_THEIRS = (os.path.dirname(torch.__file__) + os.sep,
              os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep)


def raised(e: BaseException) -> str:
    """An exception in one line: its type, its first line and where the user's code raised it
    (the innermost frame outside torch and this package)."""
    where = ""
    for frame in reversed(traceback.extract_tb(e.__traceback__)):
        if not os.path.abspath(frame.filename).startswith(NOT_THEIRS):
            where = f" (at {frame.filename}:{frame.lineno})"
            break
    first = (str(e).splitlines() or [""])[0]
    return f"{type(e).__name__}: {first}{where}"


def own_function(path: str):
    """The function that model.arch `path` names, imported."""
    module_name, _, name = path.partition(":")
    try:
        module = importlib.import_module(module_name)
    except Exception as e:  # noqa: BLE001 - the user's module may raise anything as it loads
        if isinstance(e, ModuleNotFoundError) and (e.name or "") in module_name:
            raise OwnModelError(f"model.arch {path}: no module {e.name} (on the Python path: "
                                f"the current directory, PYTHONPATH, installed packages)") from None
        raise OwnModelError(f"model.arch {path}: importing {module_name} raised {raised(e)}") \
            from None
    function = getattr(module, name, None)
    if not callable(function):
        raise OwnModelError(f"model.arch {path}: {module_name} has no function {name}")
    return function


def model_section(arch, width, num_classes, imagenet_stem, kw) -> ModelConfig:
    """The model section a network's function takes, from what describes the net
    (config.OWN_NET_KEYS); its layout keys stay at their defaults, as they must not change the
    blocks."""
    return ModelConfig(arch=arch, width=width, num_classes=num_classes,
                       stem="imagenet" if imagenet_stem else "cifar", **kw)


def build_own_blocks(arch: str, width: int, num_classes: int, imagenet_stem: bool = False,
                     **kw) -> list[nn.Module]:
    """The blocks model.arch's function returns for the model section, each checked to be a
    module, a reversible one with an inverse; an ordinary block that does not say is marked
    `reversible = False`."""
    function = own_function(arch)
    try:
        blocks = function(model_section(arch, width, num_classes, imagenet_stem, kw))
    except Exception as e:  # noqa: BLE001 - the user's code may raise anything
        raise OwnModelError(f"model.arch {arch}: building the blocks raised {raised(e)}") \
            from None
    if not isinstance(blocks, (list, tuple)) or not blocks:
        raise OwnModelError(f"model.arch {arch}: returned {type(blocks).__name__}, not a "
                            f"non-empty list of blocks (torch.nn.Module)")
    for i, block in enumerate(blocks):
        if not isinstance(block, nn.Module):
            raise OwnModelError(f"model.arch {arch}: block {i} is a {type(block).__name__}, "
                                f"not a torch.nn.Module")
        if not hasattr(block, "reversible"):
            block.reversible = False
        if block.reversible and not callable(getattr(block, "inverse", None)):
            raise OwnModelError(f"model.arch {arch}: block {i} ({type(block).__name__}) is "
                                f"declared reversible but has no inverse(y)")
    return list(blocks)


@dataclasses.dataclass(frozen=True)
class OwnNet:
    """What the rest of the package must know of a network of one's own without building it
    again: its block count and whether its first block reads token ids."""
    num_blocks: int
    takes_tokens: bool


_KNOWN = {}  # (arch, width, classes, stem, kw as JSON) -> OwnNet, once built in this process


def _key(arch, width, num_classes, imagenet_stem, kw):
    return arch, width, num_classes, imagenet_stem, json.dumps(kw, sort_keys=True)


def remember(blocks, *key_args) -> list[nn.Module]:
    """Note what `blocks` (just built from key_args) are, and return them."""
    _KNOWN[_key(*key_args)] = OwnNet(len(blocks),
                                     getattr(blocks[0], "input_dtype", None) == torch.long)
    return blocks


def own_net(arch, width, num_classes, imagenet_stem, kw) -> OwnNet:
    """The OwnNet of these arguments: as built before in this process, or built now (its
    weights drawn without touching the global random generator's state)."""
    key = _key(arch, width, num_classes, imagenet_stem, kw)
    if key not in _KNOWN:
        with torch.random.fork_rng(devices=()):
            remember(build_own_blocks(arch, width, num_classes, imagenet_stem, **kw), arch,
                     width, num_classes, imagenet_stem, kw)
    return _KNOWN[key]
