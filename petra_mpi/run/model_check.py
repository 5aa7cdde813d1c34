"""A run's network checked before it trains (core/blockcheck.py) from its config: for the command
`python -m petra_mpi.check_model CONFIG`, and at the start of every run of a network of one's
own (model.arch an import path), where a network that fails, or whose block count does not fit
the config's stages, ends the run with one line and exit status 2 before anything else starts."""
import dataclasses
import sys

import torch

from ..config import ConfigError, validate
from ..core.blockcheck import check_blocks
from ..models import NetSpec, OwnModelError
from .dryrun import input_side


def check_config_net(cfg):
    """(the config's NetSpec, the CheckReport of its blocks) on a batch of its input's shape:
    images of the side training feeds (dryrun.input_side), or token windows of model.context
    for a net whose first block reads token ids. The blocks compute in fp32 whatever
    run.precision: the check is of their arithmetic. OwnModelError when a network of one's own
    cannot be built."""
    net = dataclasses.replace(NetSpec.of_config(cfg, input_side(cfg)[0]), precision="fp32")

    def make_blocks(dtype):
        return [block.to(dtype).train() for block in net.blocks()]

    def make_input(n, dtype):
        if net.takes_tokens:
            return torch.randint(0, net.num_classes, (n, *net.input_shape))
        return torch.randn(n, *net.input_shape, dtype=dtype)

    return net, check_blocks(make_blocks, make_input)


def print_report(net, report, out=None):
    """The per-block table and the whole net's line, on `out` (default: stdout)."""
    out = out or sys.stdout
    def sci(value):
        return "-" if value is None else f"{value:.1e}"
    print(f"{net.arch}: {net.num_blocks} blocks, a batch of {net.input_shape} samples; "
          f"relative errors (rebuilt: a reversible block's input from its output; gradient: "
          f"PETRA's backward against autograd's):", file=out)
    print(f"{'block':>5}  {'class':<24} {'kind':<4} {'rebuilt f64':>11} {'rebuilt f32':>11} "
          f"{'gradient f64':>12}", file=out)
    for b in report.blocks:
        print(f"{b.index:>5}  {b.name[:24]:<24} {'rev' if b.reversible else 'buf':<4} "
              f"{sci(b.rebuilt64):>11} {sci(b.rebuilt32):>11} {sci(b.gradient):>12}", file=out)
    if report.gradient is not None:
        print(f"one step through the whole net: PETRA's parameter gradients against autograd's "
              f"{sci(report.gradient)} (float64)", file=out)
    for warning in report.warnings:
        print(f"warning: {warning}", file=out)


def check_at_start(cfg, rank: int, size: int) -> int:
    """At the start of a run of a network of one's own, on every rank (the check is the same
    on each: deterministic, on the CPU, no message): 0 once its blocks pass and their count fits
    the config (config.validate with it), with a line on rank 0; else 2 after one line."""
    try:
        net, report = check_config_net(cfg)
        if report.problem is None:
            validate(cfg, size, len(report.blocks))
    except (OwnModelError, ConfigError) as e:
        report, problem = None, str(e)
    else:
        problem = report.problem and f"model.arch {cfg.model.arch}: {report.problem}"
    if rank == 0:
        if problem:
            print(f"error: {problem} (python -m petra_mpi.check_model {cfg.source.split()[0]} "
                  f"shows every block)", file=sys.stderr, flush=True)
        else:
            worst = max((b.rebuilt64 or 0 for b in report.blocks), default=0)
            print(f"petra_mpi: model.arch {cfg.model.arch}: {len(report.blocks)} blocks "
                  f"({sum(b.reversible for b in report.blocks)} reversible) checked in "
                  f"{report.seconds:.2f} s: rebuilt inputs within {worst:.0e}, PETRA's gradient "
                  f"within {report.gradient:.0e} of autograd's (float64)", file=sys.stderr,
                  flush=True)
            for warning in report.warnings:
                print(f"petra_mpi: warning: {warning}", file=sys.stderr, flush=True)
    return 2 if problem else 0
