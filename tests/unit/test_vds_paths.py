"""Where a virtual join (petra_mpi.prep.imagenet merge) finds its shard files: the names it records
hold when the join's folder is reached through a symbolic link, and the reader and verify look
where HDF5 looks, HDF5_VDS_PREFIX included."""
import os
import shutil
import subprocess
import sys

import pytest

from tests.support.paths import ROOT
from petra_mpi.prep import imagenet
from petra_mpi.prep import verify
from petra_mpi.data.source import open_split
from tests.support.upstream_formats import TARGET, make_imagenet


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    """Two shard files of a small ImageNet, and the bytes of a one-pass pack to compare with."""
    d = tmp_path_factory.mktemp("vds")
    make_imagenet(d / "src", val_folders=True)
    common = ["--source", str(d / "src"), "--size", str(TARGET), "--workers", "1"]
    assert imagenet.main(common + ["--out", str(d / "single.h5")]) in (0, None)
    (d / "parts").mkdir()
    paths = [d / "parts" / f"part{i}.h5" for i in range(2)]
    for i, path in enumerate(paths):
        assert imagenet.main(common + ["--out", str(path), "--shard", f"{i}/2"]) in (0, None)
    return d / "single.h5", paths


def jpeg_bytes(path):
    split = open_split(str(path), "train")
    images, labels = split.read(0, len(split))
    return [bytes(x) for x in images], labels.tolist()


def test_join_written_through_a_symbolic_link(shards, tmp_path):
    """The join goes to a folder reached through a link whose target sits at another depth
    (e.g. data/ -> /scratch/...): the shard names it records must lead to the shards from the
    link's target, where the system resolves a `..`."""
    single, parts = shards
    (tmp_path / "store" / "data").mkdir(parents=True)
    (tmp_path / "repo" / "sub").mkdir(parents=True)
    (tmp_path / "repo" / "sub" / "data").symlink_to(tmp_path / "store" / "data")
    for part in parts:
        (tmp_path / "store" / part.name).symlink_to(part)  # shards beside store/, really
    joined = tmp_path / "repo" / "sub" / "data" / "joined.h5"
    assert imagenet.main(["merge", "--out", str(joined)]
                         + [str(tmp_path / "store" / p.name) for p in parts]) in (0, None)
    assert verify.main([str(joined)]) == 0
    assert jpeg_bytes(joined) == jpeg_bytes(single)


def test_shards_found_through_hdf5_vds_prefix(shards, tmp_path):
    """Shards moved away from the join are found through HDF5_VDS_PREFIX (${ORIGIN}: the join's
    folder), by HDF5 and by verify and the reader alike."""
    single, parts = shards
    (tmp_path / "a").mkdir()
    shutil.copytree(parts[0].parent, tmp_path / "a" / "parts")
    joined = tmp_path / "a" / "joined.h5"
    assert imagenet.main(["merge", "--out", str(joined)]
                         + [str(tmp_path / "a" / "parts" / p.name) for p in parts]) in (0, None)
    (tmp_path / "b").mkdir()
    os.rename(tmp_path / "a" / "parts", tmp_path / "b" / "parts")
    check = ("import sys\nfrom petra_mpi.prep import verify\n"
             "from petra_mpi.data.source import open_split\n"
             "assert verify.main([sys.argv[1]]) == 0\n"
             "s = open_split(sys.argv[1], 'train')\nimages, labels = s.read(0, len(s))\n"
             "print(sum(map(len, images)), labels.tolist())\n")
    env = {**os.environ, "HDF5_VDS_PREFIX": "${ORIGIN}/../b"}
    proc = subprocess.run([sys.executable, "-c", check, str(joined)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    images, labels = jpeg_bytes(single)
    assert proc.stdout.split("\n")[-2] == f"{sum(map(len, images))} {labels}"
