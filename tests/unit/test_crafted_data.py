"""Files from elsewhere (tests/support/crafted_h5.py) through the HDF5 readers in this process: the
trainer's reader refuses each with one line naming the file and what is wrong, and verify lists
it, reading no data a crafted size would make huge and leaving the file as it was. The commands
themselves, each in a process of its own: tests/e2e/test_crafted_files.py (extended)."""
import subprocess
import sys

import h5py
import numpy as np
import pytest

from tests.support.crafted_h5 import CASES, WHOLE_FILES, make, write_h5
from tests.support.paths import ROOT
from petra_mpi.data import DataError, open_split
from petra_mpi.prep.common import PrepError
from petra_mpi.prep.verify import verify

# HDF5 recurses through it until the process dies: a process of its own (the last test)
LOOP = "virtual dataset of itself"


@pytest.mark.parametrize("case", [c for c in CASES if c != LOOP])
def test_the_reader_and_verify_refuse_a_crafted_file(case, tmp_path):
    path = make(case, tmp_path)
    before = path.read_bytes()
    words = CASES[case][1]
    with pytest.raises(DataError) as refused:
        for split in ("train", "val"):
            open_split(path, split)
    message = str(refused.value)
    assert message.startswith(f"{path}: ") and "\n" not in message, message
    assert all(word in message for word in words), message
    if case in WHOLE_FILES:
        with pytest.raises(PrepError, match="cannot open"):
            verify(str(path))
    else:
        problems = verify(str(path))[1]
        assert any(all(word in line for word in words) for line in problems), problems
    assert path.read_bytes() == before


def test_a_virtual_dataset_of_itself_is_refused_before_any_read(tmp_path):
    """What `merge --out p0.h5 p0.h5 p1.h5` would write: its /train/jpeg maps itself, and HDF5
    recurses through a read of it until the process dies (a segmentation fault)."""
    path = make(LOOP, tmp_path)
    code = ("import sys\nfrom petra_mpi.data import DataError, open_split\n"
            "from petra_mpi.prep.verify import verify\n"
            "try:\n    open_split(sys.argv[1], 'val')\nexcept DataError as e:\n    print(e)\n"
            "print(verify(sys.argv[1])[1])\n")
    proc = subprocess.run([sys.executable, "-c", code, str(path)], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    refused, problems = proc.stdout.splitlines()
    assert refused.startswith(f"{path}: /train/jpeg is a virtual dataset whose sources lead back "
                              f"to {path}:/train/jpeg"), refused
    assert "/val/jpeg is a virtual dataset" in problems, problems


def token_file(f, ids=np.arange(64, dtype=np.uint8) % 10, num_classes=10):
    f.attrs.update(schema_version=1, kind="tokens", vocab="bytes", num_classes=num_classes,
                   bytes_per_token=1.0, source="test")
    for split in ("train", "val"):
        f.create_dataset(f"{split}/tokens", data=ids, chunks=True)


def sparse_tokens(f):
    token_file(f)
    del f["train/tokens"]
    f.create_dataset("train/tokens", shape=(10 ** 13,), dtype=np.uint8, chunks=(1 << 20,))


@pytest.mark.parametrize("write, words", [
    (sparse_tokens, ["/train/tokens declares (10000000000000,)", "stores 0 of"]),
    (lambda f: token_file(f, num_classes="three"), ["num_classes", "'three'"]),
    (lambda f: token_file(f, num_classes=5), ["/train/tokens holds ids outside [0, 5)"]),
    (lambda f: token_file(f, ids=np.zeros((64, 2), np.uint8)), ["/train/tokens", "(64, 2)"]),
], ids=["sparse", "num_classes 'three'", "ids out of range", "ids of two columns"])
def test_the_token_reader_refuses_a_crafted_file(tmp_path, write, words):
    path = tmp_path / "tokens.h5"
    write_h5(path, write)
    with pytest.raises(DataError) as refused:
        open_split(path, "train")
    message = str(refused.value)
    assert message.startswith(f"{path}: ") and all(word in message for word in words), message


def test_a_picture_that_does_not_decode_is_named_with_its_file(tmp_path):
    """Found only when read (the readers check the offsets, not every picture): one line naming
    the file, the split and the picture, not PIL's error about a buffer."""
    from petra_mpi.data import BatchLoader
    from tests.support.crafted_h5 import jpeg_file
    path = tmp_path / "j.h5"
    write_h5(path, jpeg_file)
    with h5py.File(path, "r+") as f:
        o = f["val/offsets"][:]
        f["val/jpeg"][o[5]:o[6]] = 0
    loader = BatchLoader(open_split(path, "val"), 4, train=False, seed=0, prefetch=0,
                         decode_threads=1)
    with pytest.raises(DataError) as refused:
        list(loader)
    assert str(refused.value) == f"{path}: /val/jpeg image 5 does not decode (not a picture)"
