"""`python -m petra_mpi.elastic CONFIG RANKS`: fit a run to another number of ranks (petra_mpi/run/elastic.py)."""
import sys

from .run.elastic import main

if __name__ == "__main__":
    sys.exit(main())
