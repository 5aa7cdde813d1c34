"""`python -m data_prep.verify`: the same command as `python -m petra_mpi.prep.verify`."""
from petra_mpi.prep.common import run_cli
from petra_mpi.prep.verify import main

if __name__ == "__main__":
    run_cli(main)
