"""`python -m petra_mpi.check_model CONFIG.yaml [--set key.sub=value ...]`

Checks the network of a config before PETRA trains it (docs/own_model.md): builds its blocks,
runs a batch of its input's shape through them in training mode, and block by block checks that
the forward leaves batch norm's running statistics to the backward, gives one output for one
input, that a reversible block rebuilds its input from its output (relative error in float64 and
float32), and that PETRA's backward gives autograd's gradients (float64); then one step through
the whole net against autograd. Prints a table of the errors per block. Exit status 0 when
every block passes; 2 with one line naming the block that fails, or saying why the network
cannot be built (an import path that does not exist, a function that returns something else).
Every run of a network of one's own runs the same check at its start.
"""
import argparse
import sys

from .config import ConfigError, load_config, validate


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m petra_mpi.check_model",
                                description=__doc__.split("\n\n")[1].split(":")[0])
    p.add_argument("config", help="YAML config file")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config key, e.g. --set model.width=16 (repeatable)")
    args = p.parse_args(argv)
    try:
        cfg = load_config(args.config, args.set)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    from .models import OwnModelError
    from .run.model_check import check_config_net, print_report
    try:
        net, report = check_config_net(cfg)
        print_report(net, report)
        if report.problem is None:
            validate(cfg, blocks=len(report.blocks))
    except (OwnModelError, ConfigError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if report.problem:
        print(f"error: model.arch {cfg.model.arch}: {report.problem}", file=sys.stderr)
        return 2
    print(f"ok: {cfg.model.arch}, {len(report.blocks)} blocks "
          f"({sum(b.reversible for b in report.blocks)} reversible), checked in "
          f"{report.seconds:.2f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
