"""`python -m petra_mpi.bench NAME [options]`: overhead, pipeline, peers, scaling, replicas and
emulate (under mpirun), data, memory, project; race and link (they start mpirun themselves;
link as root).

Each benchmark prints a readable table and, as its very last line, one JSON object of figures."""
import importlib
import sys

from .. import allocator
from ...comm.world import launcher_rank_and_size, run_guarded

BENCHES = ("overhead", "pipeline", "peers", "scaling", "replicas", "emulate", "data",
           "memory", "project", "race", "link")


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in BENCHES:
        print(f"usage: python -m petra_mpi.bench {{{','.join(BENCHES)}}} [--allocator "
              f"{{{','.join(allocator.CHOICES)}}}] [options]", file=sys.stderr)
        return 2
    argv, name = take_allocator(argv)
    try:  # before MPI starts: the process is started again with the allocator's environment
        allocator.use(name, ["-m", "petra_mpi.bench", *argv])
    except allocator.AllocatorError as e:
        print(f"petra_mpi.bench: {e}", file=sys.stderr)
        return 2
    if name is None:  # none chosen: training's default
        allocator.keep_freed_memory()
    bench = importlib.import_module(f"petra_mpi.perf.bench.{argv[0]}")
    if launcher_rank_and_size() is None:
        bench.main(argv[1:])
        return 0
    # under a launcher: a rank that fails aborts the others (they would wait on it for ever)
    def run_bench():
        try:
            bench.main(argv[1:])
        except SystemExit as e:  # a usage error, alike on every rank: exit with it, no abort
            return e.code
        return 0
    return run_guarded(run_bench)


def take_allocator(argv):
    """(argv without `--allocator NAME`, NAME or None): every benchmark takes it, and every
    contender of a benchmark runs under it (one process per rank)."""
    for i, a in enumerate(argv):
        if a == "--allocator" and i + 1 < len(argv):
            return argv[:i] + argv[i + 2:], argv[i + 1]
        if a.startswith("--allocator="):
            return argv[:i] + argv[i + 1:], a.split("=", 1)[1]
    return argv, None


if __name__ == "__main__":
    sys.exit(main())
