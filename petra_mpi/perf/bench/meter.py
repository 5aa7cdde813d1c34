"""Activation memory of a contender (bench peers): the live bytes of the tensors autograd saves
for backward plus the tensors a trainer stores explicitly, each byte once (docs/peers.md says how
it is counted)."""
import contextlib
import weakref
from itertools import chain

import torch
import torch.utils.checkpoint as cp


def _span(t):
    """(storage pointer, first byte, end byte) of the memory a tensor view reaches."""
    if t.numel() == 0:
        return None
    size = t.element_size()
    first = t.storage_offset() * size
    reach = 1 + sum((n - 1) * abs(st) for n, st in zip(t.shape, t.stride()))
    return t.untyped_storage().data_ptr(), first, first + reach * size


def _union_bytes(intervals) -> int:
    total, end = 0, -1
    for a, b in sorted(intervals):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


class _Saved:
    """What autograd keeps instead of a saved tensor while the meter is on; its death (the graph
    freed) releases the count."""
    __slots__ = ("t", "meter", "span", "__weakref__")

    def __init__(self, meter, span, t):
        self.t, self.meter, self.span = t, meter, span

    def __del__(self):
        self.meter.release(self.span)


class ActivationMeter:
    """Peak over time of the bytes held for backward: the memory reached by every tensor saved
    by autograd (through saved_tensors_hooks) or held explicitly (`explicit()`: PETRA's FIFOs,
    pipelining's stage inputs/outputs of in-flight micro-batches), while alive, each byte once
    (the union of the views' byte ranges per storage: aliases and views count once, a slice
    of a bigger tensor counts its slice). Storages of the module's parameters and buffers are
    not activations and are skipped. `extra()`: bytes counted otherwise (a Stage's kept graphs,
    whose saved tensors its own hooks record)."""

    def __init__(self, module, explicit=lambda: (), extra=lambda: 0):
        self.skip = {t.untyped_storage().data_ptr()
                     for t in chain(module.parameters(), module.buffers())}
        self.live = {}  # span -> references
        self.explicit, self.extra, self.peak = explicit, extra, 0

    def add(self, t):
        span = _span(t)
        if span is None or span[0] in self.skip:
            return None
        self.live[span] = self.live.get(span, 0) + 1
        return span

    def release(self, span):
        if span in self.live:
            self.live[span] -= 1
            if self.live[span] == 0:
                del self.live[span]

    def current(self) -> int:
        spans = set(self.live)
        for t in self.explicit():
            span = _span(t)
            if span is not None and span[0] not in self.skip:
                spans.add(span)
        per_storage = {}
        for ptr, a, b in spans:
            per_storage.setdefault(ptr, []).append((a, b))
        return sum(_union_bytes(v) for v in per_storage.values()) + self.extra()

    def sample(self):
        self.peak = max(self.peak, self.current())

    def pack(self, t):
        span = self.add(t)
        if span is None:
            return t
        self.sample()
        return _Saved(self, span, t)

    @staticmethod
    def unpack(p):
        return p.t if isinstance(p, _Saved) else p

    def hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)


@contextlib.contextmanager
def counting_recomputation(meter):
    """torch.utils.checkpoint keeps a block's recomputed tensors outside the saved-tensor hooks
    of the caller (its own hooks are innermost); count them too, so that the checkpointed
    contender pays for its recomputation as PETRA pays for its own."""
    original = cp._recomputation_hook

    class Counting(original):
        def __init__(self, *args):
            super().__init__(*args)
            inner = self.pack_hook

            def pack(x):
                # a fresh tensor object (same memory) is what checkpoint keeps, so that its
                # death marks the end of the recomputed tensor's use
                y = x.detach()
                inner(y)
                span = meter.add(y)
                if span is not None:
                    meter.sample()
                    weakref.finalize(y, meter.release, span)
                return y
            self.pack_hook = pack

    cp._recomputation_hook = Counting
    try:
        yield
    finally:
        cp._recomputation_hook = original
