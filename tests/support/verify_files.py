"""The data checker (petra_mpi.prep.verify) on a deliberately broken copy of a good packed file."""
import shutil

import h5py

from petra_mpi.prep.verify import verify


def assert_one_problem(good, tmp_path, breaker, words):
    """A copy of `good` broken by breaker(h5py file) verifies with exactly one problem, which
    names every word of `words`."""
    bad = tmp_path / "bad.h5"
    shutil.copy(good, bad)
    with h5py.File(bad, "r+") as f:
        breaker(f)
    problems = verify(str(bad))[1]
    assert len(problems) == 1, problems
    for word in words:
        assert word in problems[0], problems
