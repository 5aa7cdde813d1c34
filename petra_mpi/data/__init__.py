"""Training-time data: dataset sources, the batch loader, augmentation, the synthetic set."""
from .loader import BatchLoader
from .source import ArraySource, H5Source, channel_stats, open_split
from .synthetic import make_synthetic

__all__ = ["open_split", "BatchLoader", "ArraySource", "H5Source", "channel_stats", "make_synthetic"]
