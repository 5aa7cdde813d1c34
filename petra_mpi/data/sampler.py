"""EpochSampler: which dataset indices make batch i of an epoch, and its augmentation draws.

A train epoch is a permutation seeded by (seed, epoch), cut into full batches (the last partial
one is dropped); an eval pass is the split in order, the last batch possibly short. With
data-parallel replicas, shard=(r, R): replica r's batch i is batch i·R + r of the epoch
(augmentation draws included), so the replicas read disjoint shares of the same permutation and
an epoch is still one pass; each share has the same length (the last < R batches are dropped).
A batch's indices are sorted, so that the reader gets a few increasing slices (a batch is a set:
the order inside it does not matter to the gradient). Augmentation draws come from a numpy
Generator seeded by (seed, epoch, batch), never from a running RNG, so a resumed run sees
identical batches.
"""
import numpy as np


class EpochSampler:
    def __init__(self, size, batch_size, *, train, seed, shard=(0, 1)):
        if int(batch_size) < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if int(seed) < 0:
            raise ValueError(f"seed must be >= 0, got {seed}")
        self.size, self.batch_size = int(size), int(batch_size)
        self.train, self.seed = bool(train), int(seed)
        self.shard, self.shards = int(shard[0]), int(shard[1])
        if not 0 <= self.shard < self.shards or (self.shards > 1 and not self.train):
            raise ValueError(f"shard={shard}: needs 0 <= replica < replicas, on a training loader")
        self._perm = (None, None)  # (epoch, permutation) of the last train epoch asked for

    def __len__(self):
        n = self.size
        return n // self.batch_size // self.shards if self.train else -(-n // self.batch_size)

    def _order(self, epoch):
        cached = self._perm  # one read: a prefetch thread may replace it concurrently
        if cached[0] != epoch:
            rng = np.random.default_rng([self.seed, 0, epoch])
            cached = (epoch, rng.permutation(self.size))
            self._perm = cached
        return cached[1]

    def indices(self, batch, epoch):
        """Sorted dataset indices of batch `batch` of `epoch`."""
        if not 0 <= batch < len(self):
            raise IndexError(f"batch {batch} out of range [0, {len(self)})")
        batch = self._global(batch)
        lo, hi = batch * self.batch_size, (batch + 1) * self.batch_size
        if self.train:
            return np.sort(self._order(epoch)[lo:hi])
        return np.arange(lo, min(hi, self.size), dtype=np.int64)

    def rng(self, batch, epoch):
        """The Generator of a batch's augmentation: a pure function of (seed, epoch, batch)."""
        return np.random.default_rng([self.seed, 1, epoch, self._global(batch)])

    def _global(self, batch):
        """This replica's batch `batch` as a batch of the whole epoch."""
        return batch * self.shards + self.shard
