"""The packers and the reader where the file system has no locks (NFS without lockd, Cray DVS):
there flock fails with ENOLCK, and HDF5's default open ("unable to lock file") with it. A
stand-in for libc's flock, preloaded into a fresh interpreter, makes it fail that way here, for
HDF5 itself. Packing ImageNet in two shards, joining them (a virtual dataset whose shard files
HDF5 opens on its own), verifying and reading the join must all work there, with no
HDF5_USE_FILE_LOCKING in the environment; and with h5py builds that refuse `locking=` (h5py
before 3.5, or HDF5 before 1.12.1 / 1.10.7), given the batch scripts'
HDF5_USE_FILE_LOCKING=FALSE."""
import os
import shutil
import subprocess
import sys

import pytest

from tests.support.paths import ROOT
from tests.support.upstream_formats import TARGET, make_imagenet

NO_FLOCK = """#include <errno.h>
int flock(int fd, int operation) { (void)fd; (void)operation; errno = ENOLCK; return -1; }
"""

PACK_JOIN_READ = f"""
import sys
import h5py
if sys.argv[1] == "h5py-without-locking":  # as h5py before 3.5: no locking= argument
    class File(h5py.File):
        def __init__(self, *args, locking=None, **kwargs):
            if locking is not None:
                raise TypeError("__init__() got an unexpected keyword argument 'locking'")
            super().__init__(*args, **kwargs)
    h5py.File = File
from petra_mpi.prep import imagenet, verify
from petra_mpi.data.source import open_split
src, parts, joined = sys.argv[2:5]
common = ["--source", src, "--size", "{TARGET}", "--workers", "1"]
for i in range(2):
    imagenet.main(common + ["--out", f"{{parts}}/part{{i}}.h5", "--shard", f"{{i}}/2"])
imagenet.main(["merge", "--out", joined, f"{{parts}}/part0.h5", f"{{parts}}/part1.h5"])
assert verify.main([joined]) == 0
split = open_split(joined, "train")
images, labels = split.read(0, len(split))
print("read", len(images), "images")
"""


@pytest.fixture(scope="module")
def without_locks(tmp_path_factory):
    """The environment of a process whose flock always fails with ENOLCK."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if not cc:
        pytest.skip("no C compiler for the flock stand-in")
    d = tmp_path_factory.mktemp("no_flock")
    (d / "no_flock.c").write_text(NO_FLOCK)
    subprocess.run([cc, "-shared", "-fPIC", "-o", str(d / "no_flock.so"), str(d / "no_flock.c")],
                   check=True, timeout=60)
    env = {**os.environ, "LD_PRELOAD": str(d / "no_flock.so"), "OMP_NUM_THREADS": "1"}
    env.pop("HDF5_USE_FILE_LOCKING", None)
    probe = subprocess.run([sys.executable, "-c", "import sys, h5py; h5py.File(sys.argv[1], 'w')",
                            str(d / "probe.h5")], env=env, capture_output=True, text=True,
                           timeout=60)
    assert probe.returncode != 0 and "unable to lock file" in probe.stderr, probe.stderr
    return env


@pytest.mark.parametrize("h5py_build", ["h5py", "h5py-without-locking"])
def test_pack_join_and_read_without_file_locks(without_locks, tmp_path, h5py_build):
    make_imagenet(tmp_path / "src", val_folders=True)
    (tmp_path / "parts").mkdir()
    env = dict(without_locks)
    if h5py_build == "h5py-without-locking":
        env["HDF5_USE_FILE_LOCKING"] = "FALSE"  # what slurm/common.sh exports
    proc = subprocess.run([sys.executable, "-c", PACK_JOIN_READ, h5py_build, str(tmp_path / "src"),
                           str(tmp_path / "parts"), str(tmp_path / "joined.h5")], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "read 9 images" in proc.stdout, proc.stdout
