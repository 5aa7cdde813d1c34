"""`python -m petra_mpi.watchdog --diagnose LOG`: who a hang report blames
(petra_mpi/run/watchdog.py)."""
import sys

from .run.watchdog import main

if __name__ == "__main__":
    sys.exit(main())
