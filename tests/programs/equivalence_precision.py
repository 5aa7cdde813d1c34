"""tests/mpi/equivalence.py with the stages built in another compute precision.

Usage: mpirun -n J python tests/mpi/equivalence_precision.py PRECISION OUT_DIR METHOD K N [flags]
"""
import functools
import sys

import equivalence

from petra_mpi.engine.build import build_stages

if __name__ == "__main__":
    precision = sys.argv.pop(1)
    equivalence.build_stages = functools.partial(build_stages, precision=precision)
    equivalence.main()
