"""`python -m data_prep.imagenet32`: the same command as `python -m petra_mpi.prep.imagenet32`."""
from petra_mpi.prep.common import run_cli
from petra_mpi.prep.imagenet32 import main

if __name__ == "__main__":
    run_cli(main)
