from .blocks import (PRECISIONS, BatchNorm2d, ReversibleBlock, frozen_bn_stats, recorded_bn_stats,
                     set_compiled, set_precision)
from .builders import (ARCH_NAMES, ARCHS, NetSpec, Network, build_blocks, build_network,
                       count_parameters, num_blocks)
from .coupling import AdditiveCoupling, AffineCoupling
from .own import OwnModelError

__all__ = ["AdditiveCoupling", "AffineCoupling", "ARCH_NAMES", "ARCHS", "BatchNorm2d",
           "build_blocks", "build_network", "count_parameters", "frozen_bn_stats",
           "recorded_bn_stats", "NetSpec", "Network", "num_blocks", "OwnModelError", "PRECISIONS",
           "ReversibleBlock", "set_compiled", "set_precision"]
