"""What a network's blocks must do for PETRA to train them, checked on one small batch before a
run (python -m petra_mpi.check_model, and the start of every run of a network of one's own;
docs/own_model.md).

Block by block, in training mode, as a stage runs them:
- its forward without a graph (PETRA's) leaves its buffers alone: batch norm's running
  statistics are updated once per micro-batch, by the backward's recomputation
  (models.BatchNorm2d; torch's own updates them in the forward too);
- two forwards of one input give one output (no dropout nor other random draw: the backward
  recomputes the block, or inverts it, and must meet what the forward computed);
- a reversible block rebuilds its input from its output (its inverse, and the input its backward
  rebuilds) to float64 rounding; if not, either its forward maps two inputs to one output (not
  invertible) or its inverse is wrong; the float32 error is reported beside it;
- PETRA's backward of the block (the rebuild or the recomputation, then one vector-Jacobian
  product) gives autograd's parameter and input gradients to float64 rounding, and leaves its
  buffers as autograd's training step does.
Then PETRA's parameter gradients of one step through the whole net (every reversible block
rebuilding its input from the one after it) against autograd's on the same blocks, in float64.
The first failure is one line naming the block.
"""
import time
from dataclasses import dataclass, field

import torch

from ..models import Network, frozen_bn_stats
from ..models.own import raised
from .stages import Stage

# float64 relative errors above which a block fails: a right implementation is near 1e-15
REBUILD_TOLERANCE = 1e-8     # a rebuilt input against the forward's input
GRADIENT_TOLERANCE = 1e-8    # PETRA's gradients against autograd's
SAME_OUTPUT = 1e-12          # two forwards of one input
FLOAT32_WARNING = 1e-4       # a float32 rebuild error this large is worth a line
BATCH = 2                    # samples of the batch the check runs (float64 is slow on CPUs)


@dataclass
class BlockReport:
    index: int
    name: str                     # the block's class
    reversible: bool
    rebuilt64: float | None = None  # relative error of the rebuilt input, float64 (reversible)
    rebuilt32: float | None = None  # the same in float32
    gradient: float | None = None   # PETRA's gradients against autograd's, float64


@dataclass
class CheckReport:
    blocks: list[BlockReport] = field(default_factory=list)
    gradient: float | None = None  # the whole net's parameter gradients of one step, float64
    problem: str | None = None     # the first failure, one line naming the block
    seconds: float = 0.0

    @property
    def warnings(self) -> list[str]:
        return [f"block {b.index} ({b.name}) rebuilds its input to {b.rebuilt32:.1e} in "
                f"float32: inputs rebuilt through it drift from the forward's"
                for b in self.blocks if (b.rebuilt32 or 0) > FLOAT32_WARNING]


class BlockFault(Exception):
    """A block that fails a check: the line says what is wrong (the caller names the block)."""


def relative(a, b) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-300))


def check_blocks(make_blocks, make_input) -> CheckReport:
    """The checks of the module docstring. make_blocks(dtype): a fresh list of the net's blocks
    in that dtype, the same weights every time; make_input(n, dtype): a batch of n samples."""
    report, start = CheckReport(), time.perf_counter()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a batch this small: more threads only wait on each other
    with torch.random.fork_rng(devices=()):
        torch.manual_seed(0)
        try:
            _check(report, make_blocks, make_input)
        except BlockFault as e:
            report.problem = str(e)
        finally:
            torch.set_num_threads(threads)
    report.seconds = time.perf_counter() - start
    return report


def _check(report, make_blocks, make_input):
    seen, petra, plain = (make_blocks(torch.float64) for _ in range(3))
    x = make_input(BATCH, torch.float64)
    inputs = []
    for i, block in enumerate(seen):
        row = BlockReport(i, type(block).__name__, bool(block.reversible))
        report.blocks.append(row)
        with _naming(row):
            inputs.append(x)
            y = _checked_forward(block, x)
            if row.reversible:
                row.rebuilt64 = _rebuild_error(block, x, y)
            row.gradient, rebuilt = _block_gradient(petra[i], plain[i], x, y, first=i == 0)
            if rebuilt is not None:
                row.rebuilt64 = max(row.rebuilt64, rebuilt)
                if rebuilt > REBUILD_TOLERANCE:
                    raise BlockFault(f"its backward_from_output rebuilds an input {rebuilt:.1e} "
                                     f"from the forward's (relative, float64)")
            x = y
    _float32_rebuilds(report, make_blocks(torch.float32), make_input(BATCH, torch.float32))
    report.gradient = _net_gradient(petra, plain, inputs[0])
    if report.gradient > GRADIENT_TOLERANCE:
        report.problem = (f"PETRA's gradient of one step through the whole net differs from "
                          f"autograd's by {report.gradient:.1e} (relative, float64), though "
                          f"each block's agrees: the rebuilt inputs drift through the net")


class _naming:
    """Within it, a BlockFault or an exception of the block's code becomes a BlockFault whose
    line names the block."""

    def __init__(self, row):
        self.row = row

    def __enter__(self):
        return self

    def __exit__(self, kind, e, tb):
        if e is None or not isinstance(e, Exception):
            return False
        what = str(e) if isinstance(e, BlockFault) else f"raised {raised(e)}"
        raise BlockFault(f"block {self.row.index} ({self.row.name}): {what}") from None


def _no_graph(block, x):
    """The block's forward as PETRA's stages run it: no graph, batch norm's statistics left to
    the backward."""
    with torch.no_grad(), frozen_bn_stats():
        return block(x)


def _checked_forward(block, x):
    """The block's output on x, once its forward has left its buffers alone and given the same
    output twice."""
    before = {name: b.clone() for name, b in block.named_buffers()}
    y = _no_graph(block, x)
    if not torch.is_tensor(y):
        raise BlockFault(f"its forward returns a {type(y).__name__}, not one tensor")
    for name, b in block.named_buffers():
        if name in before and not torch.equal(before[name], b):
            raise BlockFault(f"its forward changes its buffer {name!r}: a batch norm that "
                             f"updates its running statistics in the forward would update them "
                             f"again in PETRA's backward; use petra_mpi.models.BatchNorm2d, "
                             f"which leaves them to the backward")
    again = relative(_no_graph(block, x), y)
    if again > SAME_OUTPUT:
        raise BlockFault(f"its forward gives another output for the same input ({again:.1e} "
                         f"apart, relative): dropout or another random draw in training mode? "
                         f"PETRA's backward recomputes or inverts the block and must meet what "
                         f"its forward computed")
    return y


def _rebuild_error(block, x, y) -> float:
    """inverse(y) against x; a BlockFault saying whether the forward or the inverse is wrong."""
    if y.numel() < x.numel():
        raise BlockFault(f"declared reversible, but its forward is not invertible: its output "
                         f"holds {y.numel()} values, its input {x.numel()}")
    rebuilt = _no_graph(block.inverse, y)
    if rebuilt.shape != x.shape:
        raise BlockFault(f"its inverse returns shape {tuple(rebuilt.shape)} for an input of "
                         f"shape {tuple(x.shape)}")
    error = relative(rebuilt, x)
    if error <= REBUILD_TOLERANCE:
        return error
    # two inputs apart with one output: no inverse can tell them apart
    if relative(_no_graph(block, rebuilt), y) <= REBUILD_TOLERANCE:
        raise BlockFault(f"declared reversible, but its forward is not invertible: it maps "
                         f"two inputs {error:.1e} apart (relative) to the same output")
    raise BlockFault(f"its inverse is wrong: inverse(forward(x)) is {error:.1e} from x "
                     f"(relative, float64)")


def _block_gradient(petra, plain, x, y, first):
    """(PETRA's gradients of the block against autograd's, relative, float64: its parameters'
    and its input's; the error of the input a reversible block's backward rebuilt, else None).
    `petra` runs as a middle stage does (the first block as stage 0: no input gradient),
    `plain` under autograd; both start from the same weights and buffers and end with them as
    a training step leaves them."""
    stage = Stage([petra], 0, 2) if first else Stage([petra], 1, 3)
    out = stage.forward(x)
    grad_y = torch.randn_like(out)
    rebuilt, grad_x = stage.backward(out, grad_y)
    x_leaf = x.detach().clone().requires_grad_(x.is_floating_point() and not first)
    plain(x_leaf).backward(grad_y)
    mine = [p.grad for p in petra.parameters() if p.grad is not None]
    theirs = [p.grad for p in plain.parameters() if p.grad is not None]
    if len(mine) != len(theirs):
        raise BlockFault("PETRA's backward leaves other parameters without a gradient than "
                         "autograd's")
    if grad_x is not None:
        mine, theirs = mine + [grad_x], theirs + [x_leaf.grad]
    error = relative(_flat(mine), _flat(theirs)) if theirs else 0.0
    if error > GRADIENT_TOLERANCE:
        how = ("its backward_from_output" if hasattr(petra, "backward_from_output") and
               petra.reversible else "its recomputed forward")
        raise BlockFault(f"PETRA's gradient differs from autograd's by {error:.1e} (relative, "
                         f"float64): {how} is not the gradient of its forward")
    for (name, b), theirs_b in zip(petra.named_buffers(), plain.buffers()):
        # a statistic of a rebuilt input differs from the forward's by its rounding
        if not (torch.equal(b, theirs_b) or b.is_floating_point() and
                relative(b, theirs_b) <= REBUILD_TOLERANCE):
            raise BlockFault(f"after one training step its buffer {name!r} differs from "
                             f"autograd's: its running statistics are updated more or less than "
                             f"once per micro-batch")
    return error, (relative(rebuilt, x) if petra.reversible else None)


def _float32_rebuilds(report, blocks, x):
    for row, block in zip(report.blocks, blocks):
        with _naming(row):
            y = _no_graph(block, x)
            if row.reversible:
                row.rebuilt32 = relative(_no_graph(block.inverse, y), x)
            x = y


def _net_gradient(petra, plain, x) -> float:
    """PETRA's parameter gradients of one step through all the blocks (one stage: each reversible
    block rebuilt from the input the next one rebuilt) against autograd's, relative, float64."""
    for p in [*Network(petra).parameters(), *Network(plain).parameters()]:
        p.grad = None
    stage = Stage(petra, 0, 2)
    out = stage.forward(x)
    grad_y = torch.randn_like(out)
    stage.backward(out, grad_y)
    Network(plain)(x).backward(grad_y)
    mine = [p.grad for block in petra for p in block.parameters() if p.grad is not None]
    theirs = [p.grad for block in plain for p in block.parameters() if p.grad is not None]
    return relative(_flat(mine), _flat(theirs)) if theirs else 0.0


def _flat(tensors):
    return torch.cat([t.reshape(-1) for t in tensors])
