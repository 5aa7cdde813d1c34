"""The repository's paths and the quick start shortened for tests."""
from pathlib import Path

TESTS = Path(__file__).resolve().parent.parent
ROOT = TESTS.parent
# The scripts that mpirun launches; tests import the data they train on by module name (the
# folder is on pytest's `pythonpath`, as it is on a script's own path when mpirun runs one).
PROGRAMS = TESTS / "programs"

# The quickstart shortened; model.stages=0: one stage per rank (or per block in one process).
QUICK = ["--set", "train.limit_batches=12", "--set", "train.epochs=1", "--set",
         "data.synthetic_train=1024", "--set", "data.synthetic_val=128", "--set", "model.width=4",
         "--set", "run.progress=false", "--set", "model.stages=0"]
