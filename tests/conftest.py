"""The markers that sort tests by kind, and the fixtures every test may ask for.

Tests live in three folders, each test marked with its folder's name: `unit` (in one process),
`mpi` (real `mpirun` jobs) and `e2e` (whole commands as users run them: the train CLI and its
messages, a SLURM cluster, learning curves, benchmarks, plots, docs, GPU).
What they share as code is the package `tests.support`.

`python -m pytest -q` runs the default selection, a few minutes on two cores; tests marked
`extended` (and `slow`, which implies `extended`) run with `python -m pytest -q -m ""` (all) or
`-m extended` (only them)."""
from pathlib import Path

import pytest

KINDS = ("unit", "mpi", "e2e")


@pytest.hookimpl(tryfirst=True)  # before -m deselects: `slow` must already imply `extended`
def pytest_collection_modifyitems(items):
    for item in items:
        kind = Path(item.fspath).parent.name
        if kind in KINDS:
            item.add_marker(kind)
        if item.get_closest_marker("slow"):
            item.add_marker(pytest.mark.extended)


@pytest.fixture(scope="session")
def picture_model(tmp_path_factory):
    """(model.pt, the val folder, the packed file, the run directory) of a model trained briefly
    on a packed folder of pictures (tests/support/model_files.py), shared: read it, never change
    it (copy what a test damages)."""
    from tests.support.model_files import train_picture_model
    return train_picture_model(tmp_path_factory.mktemp("own"))


@pytest.fixture
def one_thread():
    """torch on one thread for the test (nets so small that a second thread only waits on the
    first, seconds on a busy machine), as it was after."""
    import torch
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
