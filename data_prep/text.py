"""`python -m data_prep.text`: the same command as `python -m petra_mpi.prep.text`."""
from petra_mpi.prep.common import run_cli
from petra_mpi.prep.text import main

if __name__ == "__main__":
    run_cli(main)
