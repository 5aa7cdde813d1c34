"""Per-channel pixel statistics, shared by the packers (which store them in the file) and the
in-memory synthetic set (which must normalise exactly as its packed file would)."""
import math

import numpy as np


class ChannelStats:
    """Exact per-channel pixel statistics as integer sums, so that they merge exactly across
    batches, worker processes and shards, and the result does not depend on the order."""

    def __init__(self):
        self.count = 0          # pixels per channel
        self.sum = [0, 0, 0]    # sum of values (0-255)
        self.sumsq = [0, 0, 0]  # sum of squared values

    def update(self, images):
        """Add uint8 pixels of shape (..., 3)."""
        flat = np.asarray(images, dtype=np.uint8).reshape(-1, 3)
        step = 1 << 20  # bounds the uint16 temporary below
        for lo in range(0, len(flat), step):
            part = flat[lo:lo + step]
            s = part.sum(axis=0, dtype=np.uint64)
            q = np.square(part, dtype=np.uint16).sum(axis=0, dtype=np.uint64)  # 255^2 fits
            self.sum = [a + int(b) for a, b in zip(self.sum, s)]
            self.sumsq = [a + int(b) for a, b in zip(self.sumsq, q)]
        self.count += len(flat)
        return self

    def add(self, other):
        self.count += other.count
        self.sum = [a + b for a, b in zip(self.sum, other.sum)]
        self.sumsq = [a + b for a, b in zip(self.sumsq, other.sumsq)]
        return self

    def mean_std(self):
        """(mean, std), each 3 floats on the 0-1 scale (population std)."""
        if self.count == 0:
            raise ValueError("no training pixels to compute mean/std from (empty training set?)")
        n = self.count
        mean = [s / n / 255.0 for s in self.sum]
        # n*Q - S^2 is exact in Python integers: no cancellation error.
        std = [math.sqrt((n * q - s * s) / (n * n)) / 255.0 for s, q in zip(self.sum, self.sumsq)]
        return mean, std

    def to_attrs(self, attrs):
        attrs["pixel_count"] = np.int64(self.count)
        attrs["pixel_sum"] = np.array(self.sum, dtype=np.int64)
        attrs["pixel_sumsq"] = np.array(self.sumsq, dtype=np.int64)

    @classmethod
    def from_attrs(cls, attrs):
        st = cls()
        st.count = int(attrs["pixel_count"])
        st.sum = [int(v) for v in attrs["pixel_sum"]]
        st.sumsq = [int(v) for v in attrs["pixel_sumsq"]]
        return st
