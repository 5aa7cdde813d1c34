"""`python -m petra_mpi.bench NAME [options]`: the benchmarks (petra_mpi/perf/bench)."""
import sys

from .perf.bench.__main__ import main

if __name__ == "__main__":
    sys.exit(main())
