"""`python -m data_prep.synthetic`: the same command as `python -m petra_mpi.prep.synthetic`."""
from petra_mpi.prep.common import run_cli
from petra_mpi.prep.synthetic import main

if __name__ == "__main__":
    run_cli(main)
