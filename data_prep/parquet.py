"""`python -m data_prep.parquet`: the same command as `python -m petra_mpi.prep.parquet`."""
from petra_mpi.prep.common import run_cli
from petra_mpi.prep.parquet import main

if __name__ == "__main__":
    run_cli(main)
