"""`python -m petra_mpi.elastic CONFIG.yaml RANKS [--set key=value ...]`

The layout a run can use on RANKS ranks, for batch jobs whose allocation may change between
requeues (slurm/common.sh, a job submitted with a node range such as --nodes=2-3). Prints one
line: the number of ranks to launch, then the trainer overrides that fit them (none when the
config fits as it is). The run resumes from its layout-free checkpoint on whatever layout this
gives (docs/running.md, "Checkpoints, export and evaluation").

- The config fits RANKS as it is: all of them, no override.
- Otherwise the replicas are kept (train.replicas, else as many as fit the asked stages) and the
  stages cut to what is left: J' = min(J, RANKS // R), a contiguous split of the blocks
  (model.partition is dropped when J' differs from it).
"""
import argparse
import sys

from ..config import ConfigError, load_config, validate
from ..models import NetSpec, OwnModelError


def fit(cfg, ranks: int) -> tuple[int, list[str]]:
    """(ranks to launch, overrides) for a job of `ranks` ranks."""
    blocks = NetSpec.of_config(cfg).num_blocks
    try:
        validate(cfg, ranks, blocks)
        return ranks, []
    except ConfigError:
        pass
    asked = len(cfg.model.partition) if cfg.model.partition else (cfg.model.stages or blocks)
    replicas = cfg.train.replicas or max(1, ranks // asked)
    stages = min(asked, ranks // replicas)
    if stages < 1:
        raise ConfigError(f"{ranks} rank(s) cannot hold {replicas} replica(s)")
    overrides = [f"model.stages={stages}"]
    if cfg.model.partition and stages != len(cfg.model.partition):
        overrides.append("model.partition=null")
    return stages * replicas, overrides


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m petra_mpi.elastic",
                                description="The layout that fits RANKS ranks.")
    p.add_argument("config")
    p.add_argument("ranks", type=int)
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    args = p.parse_args(argv)
    try:
        cfg = load_config(args.config, args.set)
        used, overrides = fit(cfg, args.ranks)
        validate(load_config(args.config, [*args.set, *overrides]), used,
                 NetSpec.of_config(cfg).num_blocks)
    except (ConfigError, OwnModelError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(" ".join([str(used), *(a for o in overrides for a in ("--set", o))]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
