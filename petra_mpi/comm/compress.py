"""Compressed messages and buffers (`comm:` in the config; docs/design.md, "Compressed messages").

Each direction of traffic between stages, forward activations, rebuilt inputs and gradients sent
back, and the inputs that buffered blocks keep for their backward, has a format:
- none: as computed (float32);
- bf16, fp16: the 16-bit float nearest to each value (half the bytes);
- int8: one signed byte per value, v ≈ code · scale, codes in [-127, 127] and
  scale = max|v| / 127 over the whole tensor;
- int8_channel: the same with one scale per channel (dim 1 of an NCHW activation, the last dim
  of a token tensor), so that a channel of small values keeps its resolution.
With `stochastic`, values round up or down at random with the probabilities that make the
rounding unbiased (E[decoded] = v) instead of to the nearest code; the random numbers come from a
generator of the sender's own, seeded from the run's seed, its stage and replica and the
direction, so the one-process and the MPI engine draw the same ones. Evaluation always rounds to
the nearest.

Everything runs on the tensor's device with no host synchronisation (no .item()): the scales
travel with the codes (comm/transport.py puts them in front of the codes, in the same message).

One inf or NaN makes an int8 scale non-finite, and then every value of the message decodes to
NaN; fp16 ends at 65504, and a larger value becomes inf. A message or buffer like that stops the
run (NonFiniteError) before any stage uses it. What tells is the guard: the int8 scales, or the
largest fp16 magnitude. A CPU tensor is checked as it is packed; on a GPU the MPI transport checks
a host copy of the guard once the send's data are ready (no synchronisation), the one-process
engine checks at once, and a buffer (pack with defer_check) is checked when its backward unpacks
it, from a host copy made at the push (long done by then).
"""
import hashlib
import typing
from dataclasses import dataclass
from typing import NamedTuple, Optional

import torch

from ..config import CommFormat

FORMATS = typing.get_args(CommFormat)  # what config.CommConfig accepts
DIRECTIONS = ("forward", "rebuilt", "gradient", "buffers")
_FLOAT16 = {"bf16": torch.bfloat16, "fp16": torch.float16}
INT8_MAX = 127  # symmetric codes: -127 is kept off -128 so that the scale maps both signs alike


class NonFiniteError(RuntimeError):
    """A tensor to send holds inf or NaN (reported as one line; the run stops)."""


class Packed(NamedTuple):
    """A compressed tensor: codes of the original's shape (and strides), the scales that
    multiply them (int8 only, broadcastable to the codes) and the original dtype; `check`, of a
    buffer: its guard to check when it is unpacked (unpack_checked), with the CUDA event after
    which a host copy of it is complete (None on a CPU)."""
    codes: torch.Tensor
    scale: Optional[torch.Tensor]
    dtype: torch.dtype
    check: Optional[tuple] = None


def channel_axis(t_or_dim) -> int:
    """The axis an int8_channel scale runs along: channels of NCHW, else the feature axis."""
    dim = t_or_dim if isinstance(t_or_dim, int) else t_or_dim.dim()
    return 1 if dim == 4 else dim - 1


class Codec:
    """One format, for one sender (it owns the generator of its stochastic rounding)."""

    def __init__(self, fmt: str = "none", stochastic: bool = False, seed: int = 0,
                 what: str = "a message"):
        if fmt not in FORMATS:
            raise ValueError(f"unknown compression format {fmt!r}; known: {', '.join(FORMATS)}")
        self.fmt, self.seed = fmt, seed
        self.what = what  # what it compresses, for the error of a non-finite tensor
        self.stochastic = stochastic and fmt != "none"
        self.generator = None  # made on first use, on the tensors' device

    @property
    def active(self) -> bool:
        return self.fmt != "none"

    @property
    def code_dtype(self) -> torch.dtype:
        return torch.int8 if self.fmt.startswith("int8") else _FLOAT16[self.fmt]

    def scale_shape(self, shape) -> tuple:
        """Shape of the scales of a tensor of `shape` (() for formats without any)."""
        if not self.fmt.startswith("int8"):
            return ()
        ones = [1] * len(shape)
        if self.fmt == "int8_channel":
            axis = channel_axis(len(shape))
            ones[axis] = shape[axis]
        return tuple(ones)

    def scale_bytes(self, shape, dtype) -> int:
        """Bytes of the scales of a tensor of `shape` and `dtype` (0 for formats without any)."""
        count = 1
        for n in self.scale_shape(shape):
            count *= n
        return count * dtype.itemsize if self.scale_shape(shape) else 0

    def pack(self, t: torch.Tensor, evaluation: bool = False, defer_check: bool = False):
        """t compressed (t itself for `none`); on a CPU its guard is checked (NonFiniteError),
        on a GPU the caller checks it (guard). defer_check (a buffer, any device): checked when
        unpack_checked unpacks it instead."""
        if not self.active:
            return t
        stochastic = self.stochastic and not evaluation
        if self.fmt in _FLOAT16:
            return self._checked(Packed(self._to_float16(t, stochastic), None, t.dtype),
                                 defer_check)
        if self.fmt == "int8":
            amax = t.abs().amax().reshape(self.scale_shape(t.shape))
        else:
            axis = channel_axis(t)
            amax = t.abs().amax(dim=[d for d in range(t.dim()) if d != axis], keepdim=True)
        # an all-zero tensor (or channel) gets a tiny positive scale: its codes are 0, not NaN
        scale = (amax / INT8_MAX).clamp_min(torch.finfo(t.dtype).tiny)
        scaled = t / scale
        if stochastic:
            scaled = torch.floor(scaled + self._uniform(t))
        else:
            scaled = torch.round(scaled)
        # clamp: |t / scale| may pass 127 by a rounding of the division
        return self._checked(Packed(scaled.clamp_(-INT8_MAX, INT8_MAX).to(torch.int8), scale,
                                    t.dtype), defer_check)

    def _checked(self, packed, defer_check):
        """`packed`, its guard checked now on a CPU, or left with it (defer_check); on a GPU
        otherwise the caller checks it later, on a copy."""
        if not defer_check and packed.codes.device.type != "cpu":
            return packed
        guard = self.guard(packed)
        if guard is None:
            return packed
        if defer_check:
            return packed._replace(check=_readable_later(guard))
        self.check_guard(guard)
        return packed

    @staticmethod
    def unpack(p):
        """The tensor a Packed stands for (anything else is returned as is)."""
        if not isinstance(p, Packed):
            return p
        t = p.codes.to(p.dtype)
        return t if p.scale is None else t * p.scale

    def unpack_checked(self, p):
        """unpack(p), once the guard that pack(defer_check=True) left with it is checked."""
        if isinstance(p, Packed) and p.check is not None:
            guard, copied = p.check
            if copied is not None:
                copied.synchronize()  # queued at the push, a backward's worth of work ago
            self.check_guard(guard)
        return self.unpack(p)

    def guard(self, packed) -> Optional[torch.Tensor]:
        """What is finite exactly when `packed` decodes to finite values: its int8 scales, or
        its largest fp16 magnitude (inf when a value passed 65504); None for bf16 (float32's
        range) and an empty tensor."""
        if packed.scale is not None:
            return packed.scale
        if self.fmt == "fp16" and packed.codes.numel():
            return packed.codes.abs().amax()
        return None

    def check_guard(self, guard: torch.Tensor):
        """Raise NonFiniteError unless the guard is finite (a host synchronisation when it is on
        a GPU)."""
        if bool(torch.isfinite(guard).all()):
            return
        if self.fmt == "fp16":
            raise NonFiniteError(
                f"non-finite values (inf or NaN) in {self.what} in fp16, whose largest value is "
                f"65504 (larger ones become inf); stopping before it is used; use bf16 (the "
                f"range of float32) or lower optim.lr")
        raise NonFiniteError(
            f"non-finite values (inf or NaN) in {self.what}: in {self.fmt} every value would "
            f"decode to NaN; stopping before it is used; lower optim.lr or check the data")

    def roundtrip(self, t: torch.Tensor, evaluation: bool = False) -> torch.Tensor:
        """What the receiver of t gets: the local engine's stand-in for a compressed message."""
        if not self.active:
            return t
        packed = self.pack(t, evaluation)
        guard = self.guard(packed) if packed.codes.device.type != "cpu" else None
        if guard is not None:
            self.check_guard(guard)  # one process: nothing to overlap with the wait
        return self.unpack(packed)

    def _uniform(self, t):
        if self.generator is None:
            self.generator = torch.Generator(device=t.device).manual_seed(self.seed)
        return torch.rand(t.shape, generator=self.generator, device=t.device, dtype=t.dtype)

    def _to_float16(self, t, stochastic):
        codes = t.to(_FLOAT16[self.fmt])  # round to nearest
        if not stochastic:
            return codes
        # Unbiased rounding: the other neighbour of t (the next 16-bit value on t's side of the
        # nearest) with probability |t - nearest| / |other - nearest|, the nearest otherwise.
        # Floats are sign and magnitude, so the neighbour of larger (smaller) magnitude is the
        # bit pattern plus (minus) one, on any device.
        nearest = codes.to(t.dtype)
        error = t - nearest
        step = torch.where(t.abs() > nearest.abs(), 1, -1).to(torch.int16)
        other = (codes.view(torch.int16) + step).view(codes.dtype)
        gap = (other.to(t.dtype) - nearest).abs()
        take_other = self._uniform(t) * gap < error.abs()  # never where error == 0
        return torch.where(take_other, other, codes)


def _readable_later(guard):
    """(guard, None) on a CPU; on a GPU (a copy of it in pinned host memory, queued now, and the
    event after which it is complete): read later without waiting for the device now."""
    if guard.device.type == "cpu":
        return guard, None
    host = torch.empty(guard.shape, dtype=guard.dtype, pin_memory=True)
    host.copy_(guard, non_blocking=True)
    copied = torch.cuda.Event()
    copied.record()
    return host, copied


def nbytes(item) -> int:
    """Bytes held by a tensor, a Packed, or a list of them (what a FIFO entry costs)."""
    if isinstance(item, Packed):
        return nbytes(item.codes) + (nbytes(item.scale) if item.scale is not None else 0)
    if isinstance(item, (list, tuple)):
        return sum(nbytes(t) for t in item)
    return item.numel() * item.element_size()


# what each direction carries, for messages: "the gradient stage 3 sends"
_CARRIES = {"forward": "the activations", "rebuilt": "the rebuilt input",
            "gradient": "the gradient", "buffers": "the input"}


def _stream_seed(seed, replica, stage, direction) -> int:
    key = f"{seed}/{replica}/{stage}/{direction}".encode()
    return int.from_bytes(hashlib.sha256(key).digest()[:8], "little") >> 1


@dataclass(frozen=True)
class Compression:
    """The formats in force (config section `comm`) and the run's seed."""
    forward: str = "none"
    rebuilt: str = "none"
    gradient: str = "none"
    buffers: str = "none"
    stochastic: bool = False
    seed: int = 0

    @classmethod
    def from_config(cls, comm, seed: int = 0) -> "Compression":
        return cls(comm.forward, comm.rebuilt, comm.gradient, comm.buffers, comm.stochastic, seed)

    def codec(self, direction: str, stage: int, replica: int = 0) -> Codec:
        """The codec of what `stage` of `replica` sends (or stores) in `direction`."""
        verb = "keeps for its backward" if direction == "buffers" else "sends"
        where = f"stage {stage}" + (f" of replica {replica}" if replica else "")
        return Codec(getattr(self, direction), self.stochastic,
                     _stream_seed(self.seed, replica, stage, direction),
                     what=f"{_CARRIES[direction]} {where} {verb}")

    @property
    def active(self) -> bool:
        return any(getattr(self, d) != "none" for d in DIRECTIONS)

    def describe(self) -> str:
        """One line for the run log."""
        if not self.active:
            return "compression none"
        formats = ", ".join(f"{d} {getattr(self, d)}" for d in DIRECTIONS)
        return f"compression {formats}" + (", stochastic rounding" if self.stochastic else "")


NO_COMPRESSION = Compression()
