"""`python -m data_prep.idx`: the same command as `python -m petra_mpi.prep.idx`."""
from petra_mpi.prep.common import run_cli
from petra_mpi.prep.idx import main

if __name__ == "__main__":
    run_cli(main)
