"""The command line: `[mpirun -n J] python -m petra_mpi.train CONFIG.yaml [--set key.sub=value ...]`.

Without MPI (or with one rank) every stage runs in this process; under mpirun rank r runs stage r,
or with R data-parallel replicas (train.replicas, or a world size that is a multiple of
model.stages) rank replica · J + stage. run/trainer.py does the training.

This module imports no torch: every rank checks the config and the world size first, so a wrong
`mpirun -n` is reported at once instead of after every rank has loaded torch (seconds each on a
crowded node). torch loads with the trainer, once the run is known to be valid.
"""
import argparse
import faulthandler
import sys

from .archs import is_import_path
from .config import ConfigError, load_config, validate
from .engines.stopping import StopRequest
from .run.watchdog import begin_startup, startup_step


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m petra_mpi.train", description=__doc__.split("\n")[0])
    p.add_argument("config", help="YAML config file")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config key, e.g. --set train.epochs=3 (repeatable)")
    p.add_argument("--dry-run", action="store_true",
                   help="build the stages, check shapes, print the per-stage table and exit")
    p.add_argument("--profile", action="store_true",
                   help="with --dry-run: time every block on the run's device and batch, split "
                        "by the measured costs, and print each block's and stage's cost")
    return p.parse_args(argv)


def checked_config(args, rank, size):
    """The config, validated for `size` ranks; None after saying why on rank 0."""
    if args.profile and not args.dry_run:
        if rank == 0:
            print("error: --profile goes with --dry-run", file=sys.stderr)
        return None
    try:
        cfg = load_config(args.config, args.set)
        validate(cfg, size)
    except ConfigError as e:
        if rank == 0:
            print(f"error: {e}", file=sys.stderr)
        return None
    return cfg


def run(cfg, world, dry_run=False, stop=None, profile=False) -> int:
    """Train on this process's stages (trainer.run); `world` holds the ranks (None in one
    process); `stop` is set by SIGUSR1/SIGTERM; `profile` (with dry_run) measures the blocks'
    costs. Returns the exit status."""
    from .run.trainer import run as train_run
    status = train_run(cfg, world, dry_run, stop, profile)
    if dry_run and (world is None or world.rank == 0):
        from .perf import allocator  # the blocks were timed under it (run.keep_freed_memory)
        print(f"C allocator: {allocator.current()}")
    return status


def main(argv=None) -> int:
    args = parse_args(argv)
    stop = StopRequest().install()  # first: a signal during start-up still means "stop cleanly"
    from .comm.world import LaunchError, World, launcher_rank_and_size
    launched = launcher_rank_and_size()
    if launched:
        cfg = checked_config(args, *launched)  # before torch loads (bind_early)
        if cfg is None:
            return 2
        if not args.dry_run:  # from here a hang (the transport, the GPU, the data) ends the rank
            begin_startup(cfg.run.startup_s, launched[0])
    early = cfg if launched else _early_config(args)
    _bind_gpu_first(early)
    try:
        world = World.from_environment(early.comm.transport if early else "mpi")
    except LaunchError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        return _train(args, world, stop)
    finally:  # a normal end, a stop or an error found at the start (an abort exits at once)
        if world:
            world.close()


def _train(args, world, stop) -> int:
    """main's run, once the world (None: one process) has started: the exit status."""
    from .comm.world import LaunchError
    rank, size = (world.rank, world.size) if world else (0, 1)
    cfg = checked_config(args, rank, size)  # the transport's size: a launcher not known above
    if cfg is None:
        return 2
    if cfg.run.keep_freed_memory:  # before the first tensor: block timing included
        from .perf.allocator import keep_freed_memory
        keep_freed_memory()
    startup_step("loading torch")
    if is_import_path(cfg.model.arch):  # every rank checks the network and its block count
        startup_step("checking the network")
        from .run.model_check import check_at_start
        if check_at_start(cfg, rank, size):
            return 2
    from .run.checkpoint import CheckpointError
    from .comm.compress import NonFiniteError
    from .run.errors import TrainingError
    from .data import DataError  # a data file found wrong mid-run (a picture that does not decode)
    # one line, exit status 1 (LaunchError: a transport missing what the run's device needs)
    reported = (TrainingError, CheckpointError, NonFiniteError, DataError, LaunchError)
    if world is None:
        try:
            return run(cfg, None, args.dry_run, stop, args.profile)
        except reported as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
    from .comm.world import run_guarded
    return run_guarded(lambda: run(cfg, world, args.dry_run, stop, args.profile), reported,
                       world.rank)


def _early_config(args):
    """The config as far as the start needs it before the world is known (the transport, the GPU
    to bind), or None: its errors are reported once the world is, by rank 0 alone."""
    try:
        return load_config(args.config, args.set)
    except ConfigError:
        return None


def _bind_gpu_first(cfg):
    """Set this rank's CUDA device from the launcher's local rank before the transport starts
    (CUDA-aware MPI picks its GPU at MPI_Init); cfg None: a config with errors, reported later."""
    if cfg is None:
        return
    from .comm.devices import bind_early
    bind_early(cfg.run.device)


if __name__ == "__main__":
    faulthandler.enable()  # a rank that crashes in native code still says where
    sys.exit(main())
