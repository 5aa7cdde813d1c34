"""Crafted input for the folder packer, the parquet packer and merge, each through the real
command under a timeout: no traceback, no hang, exit status 2 with one line naming the culprit
(or, with --skip-bad, the line that says it was left out and a packed file), no output where
refused, and every input file byte for byte as it was."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest
from PIL import Image

from tests.support.paths import ROOT
from tests.support.pictures import checksums, make_picture_folder

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

pytestmark = pytest.mark.extended


def picture_folder(root):
    """root/src: train/ and val/ of three classes, the folder every folder case starts from."""
    make_picture_folder(root / "src" / "train", per_class=3)
    make_picture_folder(root / "src" / "val", per_class=2, seed=1)
    return root / "src"


def folder_case(make):
    """A folder case: make(root, src) alters the folder and returns (what the line names, the
    options that point the packer at it, or None for the usual --out)."""
    def build(root):
        src = picture_folder(root)
        where, out_args = make(root, src)
        args = ["--source", src, "--size", 16, "--workers", 2]
        return "folder", args + (out_args or ["--out", root / "out.h5"]), where
    return build


def fifo(root, src):
    os.mkfifo(src / "train" / "dog" / "x.jpg")
    return src / "train" / "dog" / "x.jpg", None


def bomb(root, src):
    """A PNG of 11 KB that declares 90 million pixels."""
    Image.new("1", (10_000, 9_000)).save(src / "train" / "fox" / "bomb.png")
    return src / "train" / "fox" / "bomb.png", None


def loop(root, src):
    (src / "train" / "cat" / "again").symlink_to(src / "train")
    return src / "train" / "cat" / "again", None


def not_utf8(root, src):
    os.mkdir(os.path.join(bytes(src / "train"), b"caf\xe9"))
    Image.new("RGB", (20, 20)).save(os.path.join(bytes(src / "train"), b"caf\xe9", b"a.png"))
    return f"{src}/train/caf\\xe9", None


def newline(root, src):
    (src / "train" / "two\nlines").mkdir()
    Image.new("RGB", (20, 20)).save(src / "train" / "two\nlines" / "a.png")
    return f"{src}/train/two\\nlines", None


def onto_a_picture(root, src):
    return "lies inside the input folder", ["--out", src / "train" / "cat" / "cat_00.jpg"]


def inside_the_source(root, src):
    return "lies inside the input folder", ["--out", src / "packed.h5"]


def existing(root, src):
    (root / "old.h5").write_bytes(b"an older file")
    return "exists: --force replaces it", ["--out", root / "old.h5"]


def a_folder(root, src):
    (root / "folder.h5").mkdir()
    return "is a folder", ["--out", root / "folder.h5"]


def merge_case(out_of):
    """A merge of two shards of the folder; out_of(root, shards): its --out."""
    def build(root):
        src = picture_folder(root)
        shards = [root / f"part{i}.h5" for i in range(2)]
        for i, shard in enumerate(shards):
            run("folder", "--source", src, "--out", shard, "--size", 16, "--shard", f"{i}/2",
                check=True)
        out, why = out_of(root, shards)
        return "folder", ["merge", "--out", out, *shards], why
    return build


def merge_onto_a_shard(root, shards):
    return shards[0], "is an input of this command"


def merge_onto_an_existing_file(root, shards):
    (root / "old.h5").write_bytes(b"an older file")
    return root / "old.h5", "exists: --force replaces it"


HF_IMAGE = pa.struct([("bytes", pa.binary()), ("path", pa.string())])


def parquet_case(path_of_row_4=None, label_of_row_4=None, label_type=pa.int64(), out=None):
    """A parquet data set of 9 pictures whose row 4 is crafted: its picture read from a path,
    or its label; out(root, dataset): the --out, else the usual one."""
    def build(root):
        ds, rng = root / "ds", np.random.default_rng(0)
        ds.mkdir()
        rows = []
        for i in range(9):
            image = Image.fromarray(rng.integers(0, 256, (12, 12, 3), np.uint8))
            image.save(ds / f"{i}.png")
            rows.append({"bytes": (ds / f"{i}.png").read_bytes(), "path": None})
        labels = [i % 3 for i in range(9)]
        if path_of_row_4 is not None:
            rows[4] = {"bytes": None, "path": path_of_row_4(root)}
        if label_of_row_4 is not None:
            labels[4] = label_of_row_4
        table = pa.table({"image": pa.array(rows, HF_IMAGE),
                          "label": pa.array(labels, label_type)})
        table = table.replace_schema_metadata({b"huggingface": json.dumps(
            {"info": {"features": {"image": {"_type": "Image"}}}}).encode()})
        path = ds / "train-00000-of-00001.parquet"
        pq.write_table(table, path)
        args = ["--source", ds, "--raw", 8, "--val-fraction", 0.3, "--workers", 2]
        target = out(root, path) if out else root / "out.h5"
        return "parquet", args + ["--out", target], target if out else f"{path} row 4"
    return build


def secret(root):
    """A picture outside the data set, named by an absolute path."""
    Image.new("RGB", (12, 12), "red").save(root / "secret.png")
    return str(root / "secret.png")


# name: (build(root) -> (packer, arguments, what the error line holds), skippable)
CASES = {
    "a FIFO named x.jpg": (folder_case(fifo), True),
    "a decompression bomb": (folder_case(bomb), True),
    "a link loop": (folder_case(loop), True),
    "a class name not UTF-8": (folder_case(not_utf8), True),
    "a class name with a newline": (folder_case(newline), True),
    "--out onto a picture": (folder_case(onto_a_picture), False),
    "--out inside the source": (folder_case(inside_the_source), False),
    "--out exists": (folder_case(existing), False),
    "--out a folder": (folder_case(a_folder), False),
    "merge onto a shard": (merge_case(merge_onto_a_shard), False),
    "merge onto an existing file": (merge_case(merge_onto_an_existing_file), False),
    "an absolute path": (parquet_case(path_of_row_4=secret), True),
    "a path out by ..": (parquet_case(path_of_row_4=lambda root: os.path.relpath(
        secret(root), root / "ds")), True),
    "a label of 10**9": (parquet_case(label_of_row_4=10**9), True),
    "a label of 2**63 - 1": (parquet_case(label_of_row_4=2**63 - 1), True),
    "a uint64 label": (parquet_case(label_of_row_4=2**64 - 1, label_type=pa.uint64()), True),
    "--out onto a parquet file": (parquet_case(out=lambda root, path: path), False),
}


def run(module, *args, check=False):
    return subprocess.run([sys.executable, "-m", f"petra_mpi.prep.{module}", *map(str, args)],
                          cwd=ROOT, capture_output=True, text=True, timeout=120, check=check)


def out_of(args):
    return args[args.index("--out") + 1]


@pytest.mark.parametrize("case", CASES)
def test_crafted_input(tmp_path, case):
    build, skippable = CASES[case]
    module, args, where = build(tmp_path)
    out = out_of(args)
    existed = os.path.lexists(out)
    before = checksums(tmp_path)
    for extra in ([], ["--skip-bad"]):
        if "merge" in args and extra:
            continue  # merge has no bad input to skip
        proc = run(module, *args, *extra)
        assert "Traceback" not in proc.stderr, proc.stderr
        after = checksums(tmp_path)
        assert {path: after.get(path) for path in before} == before  # every input as it was
        if extra and skippable:
            assert proc.returncode == 0, proc.stderr
            skipped = [line for line in proc.stderr.splitlines() if line.startswith("skipped ")]
            assert len(skipped) == 1 and str(where) in skipped[0], proc.stderr
            continue
        assert after == before and proc.returncode == 2, proc.stderr
        last = proc.stderr.strip().splitlines()[-1]
        assert last.startswith(f"petra_mpi.prep.{module}: error: ") and str(where) in last, last
        assert os.path.lexists(out) == existed
        assert not [n for n in os.listdir(os.path.dirname(out)) if ".tmp-" in n]
