"""`python -m data_prep.cifar`: the same command as `python -m petra_mpi.prep.cifar`."""
from petra_mpi.prep.common import run_cli
from petra_mpi.prep.cifar import main

if __name__ == "__main__":
    run_cli(main)
