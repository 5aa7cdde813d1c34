"""Training-time data: dataset sources, the batch loader, augmentation, the synthetic set.

Names are imported on first use, so that `petra_mpi.data.stats` or `.synthetic` (used by the
offline packers) do not pull in torch and the loader."""
import importlib

_WHERE = {"open_split": "source", "ArraySource": "source", "H5Source": "source",
          "channel_stats": "source", "BatchLoader": "loader", "make_synthetic": "synthetic",
          "ChannelStats": "stats", "DataError": "checks"}
__all__ = sorted(_WHERE)


def __getattr__(name):
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f".{_WHERE[name]}", __name__), name)
