"""`python -m petra_mpi.plot RUN_DIR_OR_TRACE ...`: learning curves and timelines (petra_mpi/perf/plot.py)."""
import sys

from .perf.plot import main

if __name__ == "__main__":
    sys.exit(main())
