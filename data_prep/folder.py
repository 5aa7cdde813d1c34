"""`python -m data_prep.folder`: the same command as `python -m petra_mpi.prep.folder`."""
from petra_mpi.prep.common import run_cli
from petra_mpi.prep.folder import main

if __name__ == "__main__":
    run_cli(main)
