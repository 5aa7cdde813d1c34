"""Run `python -m petra_mpi.bench emulate` with rank 1 made to fail at once while rank 0 waits
for it in a collective (for the test that a failing benchmark rank ends every rank).

Usage: mpirun -n 2 python tests/programs/faulty_bench.py
"""
import sys

from mpi4py import MPI

from petra_mpi.perf.bench import __main__ as bench_main
from petra_mpi.perf.bench import emulate


def main(argv):
    if MPI.COMM_WORLD.Get_rank() == 1:
        raise RuntimeError("injected benchmark failure")
    MPI.COMM_WORLD.Barrier()  # never completes: rank 1 is gone


emulate.main = main
sys.exit(bench_main.main(["emulate"]))
