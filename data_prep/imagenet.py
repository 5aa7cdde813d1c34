"""`python -m data_prep.imagenet`: the same command as `python -m petra_mpi.prep.imagenet`."""
from petra_mpi.prep.common import run_cli
from petra_mpi.prep.imagenet import main

if __name__ == "__main__":
    run_cli(main)
