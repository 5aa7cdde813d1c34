"""`python -m petra_mpi.bench NAME [options]`: overhead, pipeline, peers, scaling, replicas and
emulate (under mpirun), data, memory.

Each benchmark prints a readable table and, as its very last line, one JSON object of figures."""
import importlib
import sys

BENCHES = ("overhead", "pipeline", "peers", "scaling", "replicas", "emulate", "data",
           "memory")


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in BENCHES:
        print(f"usage: python -m petra_mpi.bench {{{','.join(BENCHES)}}} [options]", file=sys.stderr)
        return 2
    importlib.import_module(f"petra_mpi.bench.{argv[0]}").main(argv[1:])
    return 0


if __name__ == "__main__":
    sys.exit(main())
