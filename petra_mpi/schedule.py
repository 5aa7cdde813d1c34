"""`python -m petra_mpi.schedule`: print the tick schedule of a method (petra_mpi/core/schedule.py)."""
import sys

from .core.schedule import main

if __name__ == "__main__":
    sys.exit(main())
