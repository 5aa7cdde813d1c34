"""The parquet packer (petra_mpi.prep.parquet) on files in the layout of Hugging Face image
datasets, written here with pyarrow: the round trip, splits from file names, columns and class
names from the feature metadata or without it, bad rows, pyarrow missing, and streaming."""
import io
import json
import os
import subprocess
import sys

import h5py
import numpy as np
import pytest
from PIL import Image

from tests.support.launch import run_packer
from tests.support.paths import ROOT
from tests.support.pictures import CLASSES, checksums, class_picture
from tests.support.upstream_formats import SIZES
from petra_mpi.prep.pictures import encode
from petra_mpi.prep.verify import verify

pq = pytest.importorskip("pyarrow.parquet", reason="pyarrow (the parquet extra, in dev)")
pa = pytest.importorskip("pyarrow")

HF_IMAGE = pa.struct([("bytes", pa.binary()), ("path", pa.string())])


def picture_bytes(rng, label, i, fmt="PNG"):
    out = io.BytesIO()
    class_picture(rng, label, len(CLASSES), *SIZES[(label + i) % len(SIZES)]).save(out, fmt)
    return out.getvalue()


def write_hf(path, pictures, labels, metadata=True, row_group_size=3):
    """A parquet file as Hugging Face writes an image dataset: an Image feature (struct of bytes
    and path) and a ClassLabel feature, described in the schema's b"huggingface" metadata."""
    table = pa.table({"image": pa.array([{"bytes": b, "path": f"{i}.png"}
                                         for i, b in enumerate(pictures)], HF_IMAGE),
                      "label": pa.array(labels, pa.int64())})
    if metadata:
        features = {"image": {"_type": "Image"},
                    "label": {"names": list(CLASSES), "_type": "ClassLabel"}}
        table = table.replace_schema_metadata(
            {b"huggingface": json.dumps({"info": {"features": features}}).encode()})
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, path, row_group_size=row_group_size)


def make_hf_dataset(root, seed=0):
    """data/train-0000{0,1}-of-00002, validation and test files; {split: (bytes, labels)}."""
    rng = np.random.default_rng(seed)
    made = {}
    for name, n, parts in (("train", 12, 2), ("validation", 6, 1), ("test", 4, 1)):
        labels = [i % 3 for i in range(n)]
        pictures = [picture_bytes(rng, label, i) for i, label in enumerate(labels)]
        made[name] = (pictures, labels)
        for part in range(parts):
            rows = slice(part * n // parts, (part + 1) * n // parts)
            write_hf(root / "data" / f"{name}-{part:05d}-of-{parts:05d}.parquet",
                     pictures[rows], labels[rows])
    return made


def read_packed(path):
    with h5py.File(path, "r") as f:
        names = [c.decode() for c in f["classes"][:]] if "classes" in f else None
        return {s: (f[s]["images"][:], f[s]["labels"][:].tolist()) for s in ("train", "val")}, \
            names, int(f.attrs["num_classes"])


def test_hugging_face_layout_round_trip(tmp_path):
    made = make_hf_dataset(tmp_path / "ds")
    out = tmp_path / "raw.h5"
    status, _, err = run_packer("parquet", "--source", tmp_path / "ds", "--out", out, "--raw", 16,
                                "--workers", 2)
    assert status == 0, err
    assert "left out: the test split (1 files; --split test packs it as val)" in err
    data, names, count = read_packed(out)
    assert names == list(CLASSES) and count == 3  # from the ClassLabel feature
    for split, name in (("train", "train"), ("val", "validation")):
        pictures, labels = made[name]
        assert data[split][1] == labels
        want = np.stack([encode(b, 16, raw=True)[0] for b in pictures])
        assert np.array_equal(data[split][0], want)
    assert verify(str(out))[1] == []
    # the JPEG variant: the bytes encode() writes, the test split as val by --split
    status, _, err = run_packer("parquet", "--source", *sorted((tmp_path / "ds" / "data").iterdir()),
                                "--out", tmp_path / "jpeg.h5", "--size", 16, "--split", "test",
                                "--workers", 1)
    assert status == 0, err
    with h5py.File(tmp_path / "jpeg.h5", "r") as f:
        o, jpeg = f["val/offsets"][:], f["val/jpeg"][:]
        assert [jpeg[o[i]:o[i + 1]].tobytes() for i in range(4)] == \
            [encode(b, 16)[0] for b in made["test"][0]]
        assert int(f.attrs["image_size"]) == 16 and f.attrs["source"] == "parquet"


def test_without_metadata_string_labels_a_path_and_a_drawn_val_split(tmp_path):
    """No feature metadata, a plain binary `img` column, string labels (the classes are their
    sorted values), one row whose picture is a file beside the parquet file, and no split in
    the file's name: all train, with the val split drawn from each class."""
    rng = np.random.default_rng(1)
    labels = ["tabby", "beagle", "corgi"] * 8
    pictures = [picture_bytes(rng, i % 3, i) for i in range(24)]
    (tmp_path / "pets.parquet").parent.mkdir(exist_ok=True)
    (tmp_path / "side.png").write_bytes(pictures[5])
    rows = pa.array([{"bytes": None if i == 5 else b, "path": "side.png" if i == 5 else None}
                     for i, b in enumerate(pictures)], HF_IMAGE)
    pq.write_table(pa.table({"img": rows, "labels": labels}), tmp_path / "pets.parquet")
    out = tmp_path / "pets.h5"
    status, _, err = run_packer("parquet", "--source", tmp_path / "pets.parquet", "--out", out,
                                "--raw", 12, "--val-fraction", 0.25, "--workers", 1)
    assert status == 0, err
    assert "no split in its name, read as train" in err
    data, names, _ = read_packed(out)
    assert names == ["beagle", "corgi", "tabby"]
    assert np.bincount(data["val"][1]).tolist() == [2, 2, 2]
    everything = np.concatenate([data["train"][0], data["val"][0]])
    assert any(np.array_equal(image, encode(pictures[5], 12, raw=True)[0]) for image in everything)


@pytest.mark.parametrize("case", ["no label", "label outside", "not a picture"])
def test_bad_rows_stop_with_one_line_or_are_skipped(tmp_path, case):
    rng = np.random.default_rng(2)
    pictures = [picture_bytes(rng, i % 3, i) for i in range(9)]
    labels = [i % 3 for i in range(9)]
    if case == "not a picture":
        pictures[4] = b"no picture here"
    else:
        labels[4] = None if case == "no label" else 7
    path = tmp_path / "ds" / "train-00000-of-00001.parquet"
    write_hf(path, pictures, labels)
    write_hf(tmp_path / "ds" / "validation-00000-of-00001.parquet", pictures[:3], [0, 1, 2])
    out = tmp_path / "out.h5"
    args = ("--source", tmp_path / "ds", "--out", out, "--raw", 8, "--workers", 1)
    status, _, err = run_packer("parquet", *args)
    last = err.strip().splitlines()[-1]
    assert status == 2 and "Traceback" not in err, err
    assert last.startswith(f"petra_mpi.prep.parquet: error: {path} row 4") and "--skip-bad" in last
    assert not out.exists()
    status, _, err = run_packer("parquet", *args, "--skip-bad")
    assert status == 0, err
    assert f"skipped {path} row 4" in err
    data, _, _ = read_packed(out)
    assert data["train"][1] == [label for i, label in enumerate(labels) if i != 4]


def test_unknown_split_and_columns_are_one_line_errors(tmp_path):
    make_hf_dataset(tmp_path / "ds")
    out = tmp_path / "out.h5"
    status, _, err = run_packer("parquet", "--source", tmp_path / "ds", "--out", out,
                                "--split", "dev")
    assert status == 2 and "--split dev: the files hold the splits test, train, validation" in err
    status, _, err = run_packer("parquet", "--source", tmp_path / "ds", "--out", out,
                                "--image-column", "photo")
    assert status == 2 and "no column 'photo' (the columns: image, label)" in err


def test_a_clear_line_when_pyarrow_is_missing(tmp_path):
    """Without pyarrow (hidden from the import system, as on an install without the extra)."""
    code = ("import sys; sys.modules['pyarrow'] = None\n"
            "from petra_mpi.prep.common import run_cli\n"
            "from petra_mpi.prep.parquet import main\n"
            f"run_cli(main, ['--source', {str(tmp_path / 'ds')!r}, '--out', {str(tmp_path / 'o.h5')!r}])\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip() == ("petra_mpi.prep.parquet: error: reading parquet files needs "
                                   "pyarrow: pip install -e \".[parquet]\" (or pip install pyarrow)")


def peak_arrow_bytes(source, out):
    """The largest memory pyarrow held while the packer ran in a process of its own."""
    code = ("import pyarrow\n"
            "from petra_mpi.prep.parquet import main\n"
            f"main(['--source', {str(source)!r}, '--out', {str(out)!r}, '--raw', '8', "
            "'--workers', '1'])\n"
            "print('peak', pyarrow.default_memory_pool().max_memory())\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    return int(proc.stdout.split("peak")[-1])


def noise_png(rng):
    """A 128x128 PNG of noise: 48 KiB that do not compress."""
    out = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (128, 128, 3), np.uint8)).save(out, "PNG")
    return out.getvalue()


def test_memory_does_not_grow_with_the_data_set(tmp_path):
    """The pictures are read one row group (here 10 rows, 0.49 MB) at a time, so pyarrow's peak
    does not grow with the file: files of 2 and 24 groups peak alike (measured: 2.77 MB both,
    and in some runs one group more, 3.26 MB, the buffers of a group freed a little later). A
    reader holding the whole file or column would peak higher by the 22 groups more, 10.9 MB.
    The bound on the difference, half of that, lies ten groups away from either: the pass
    depends neither on how busy the machine is nor on the constant part of the peak (against
    the file's size, 2.97 MB for a quarter, the usual peak has a margin of 7 %)."""
    rng = np.random.default_rng(3)
    peaks, sizes = {}, {}
    for groups in (2, 24):
        n = 10 * groups
        path = tmp_path / f"g{groups}" / "train-00000-of-00001.parquet"
        write_hf(path, [noise_png(rng) for _ in range(n)], [i % 3 for i in range(n)],
                 row_group_size=10)
        peaks[groups] = peak_arrow_bytes(path.parent, tmp_path / f"g{groups}.h5")
        sizes[groups] = path.stat().st_size
    assert peaks[24] - peaks[2] < (sizes[24] - sizes[2]) / 2, (peaks, sizes)


# ---------------------------------------------------------------- files from elsewhere

def write_rows(path, rows, labels, label_type=pa.int64(), names=None):
    """A train file of Image structs (rows: {"bytes", "path"}) and labels of `label_type`;
    `names`: the ClassLabel feature's class names, if any."""
    table = pa.table({"image": pa.array(rows, HF_IMAGE), "label": pa.array(labels, label_type)})
    if names is not None:
        features = {"image": {"_type": "Image"}, "label": {"names": names, "_type": "ClassLabel"}}
        table = table.replace_schema_metadata(
            {b"huggingface": json.dumps({"info": {"features": features}}).encode()})
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, path)


def test_a_row_path_is_read_only_inside_its_parquet_files_folder(tmp_path):
    """A data set names its own files: an absolute path, `..` or a link out of its folder, and a
    FIFO are bad rows; a relative path to a picture inside is read."""
    rng = np.random.default_rng(4)
    pictures = [picture_bytes(rng, i % 3, i) for i in range(9)]
    outside = tmp_path / "outside.png"
    outside.write_bytes(pictures[0])
    ds = tmp_path / "ds"
    ds.mkdir()
    (ds / "inside.png").write_bytes(pictures[1])
    (ds / "link.png").symlink_to(outside)
    os.mkfifo(ds / "fifo.png")
    paths = {2: str(outside), 3: "../outside.png", 4: "link.png", 5: "fifo.png", 6: "inside.png"}
    rows = [{"bytes": None, "path": paths[i]} if i in paths else {"bytes": b, "path": None}
            for i, b in enumerate(pictures)]
    path = ds / "train-00000-of-00001.parquet"
    write_rows(path, rows, [i % 3 for i in range(9)])
    out = tmp_path / "out.h5"
    args = ("--source", ds, "--out", out, "--raw", 8, "--val-fraction", 0.3, "--workers", 1)
    before = checksums(tmp_path)
    status, _, err = run_packer("parquet", *args)
    assert status == 2 and err.splitlines() == [
        f"petra_mpi.prep.parquet: error: {path} row 2: its path {outside} leads out of the folder "
        f"of its parquet file (only relative paths inside it are read); --skip-bad packs the rest"]
    assert not out.exists() and checksums(tmp_path) == before
    status, _, err = run_packer("parquet", *args, "--skip-bad")
    assert status == 0, err
    skipped = [line for line in err.splitlines() if line.startswith("skipped ")]
    assert [line.split(":")[0] for line in skipped] == [f"skipped {path} row {i}" for i in (2, 3, 4, 5)]
    assert "leads out of the folder" in skipped[2] and "not a regular file" in skipped[3]
    data, _, _ = read_packed(out)
    stored = np.concatenate([data["train"][0], data["val"][0]])
    assert len(stored) == 5
    assert any(np.array_equal(image, encode(pictures[1], 8, raw=True)[0]) for image in stored)


def test_labels_are_checked_in_their_own_type_before_any_picture_is_read(tmp_path):
    """A label beyond the most classes a file may have, 2**63 - 1 and a uint64 one are bad rows,
    found before the undecodable picture of row 0 is read; the rest packs into 3 classes."""
    rng = np.random.default_rng(5)
    rows = [{"bytes": picture_bytes(rng, i % 3, i), "path": None} for i in range(9)]
    rows[0]["bytes"] = b"no picture"
    for label, label_type in ((200_000, pa.int64()), (2**63 - 1, pa.int64()),
                              (2**64 - 1, pa.uint64())):
        path = tmp_path / str(label) / "train-00000-of-00001.parquet"
        write_rows(path, rows, [label if i == 4 else i % 3 for i in range(9)], label_type)
        out = tmp_path / f"{label}.h5"
        args = ("--source", path, "--out", out, "--raw", 8, "--val-fraction", 0.3, "--workers", 1)
        status, _, err = run_packer("parquet", *args)
        assert status == 2 and err.splitlines() == [
            f"petra_mpi.prep.parquet: error: {path} row 4: no label, or one outside the classes "
            f"(0 to 99,999, the most classes a packed file may have; 1 such rows in this file); "
            f"--skip-bad packs the rest"], err
        status, _, err = run_packer("parquet", *args, "--skip-bad")
        assert status == 0 and f"skipped {path} row 0: cannot decode image" in err, err
        assert read_packed(out)[2] == 3


@pytest.mark.parametrize("names, why", [
    (["cat", "two\nlines", "fox"], "the class name two\\nlines is not printable UTF-8 text"),
    ([str(i) for i in range(100_001)], "names 100,001 classes, more than the 100,000"),
    (["cat", "dog", "cat"], "name a class twice: cat"),
    ({"cat": 0}, "are not a list of names")])
def test_class_names_a_packed_file_cannot_hold_are_refused(tmp_path, names, why):
    rng = np.random.default_rng(6)
    rows = [{"bytes": picture_bytes(rng, i % 3, i), "path": None} for i in range(6)]
    write_rows(tmp_path / "ds" / "train.parquet", rows, [i % 3 for i in range(6)], names=names)
    status, _, err = run_packer("parquet", "--source", tmp_path / "ds", "--out",
                                tmp_path / "out.h5", "--raw", 8, "--workers", 1)
    assert status == 2 and len(err.splitlines()) == 1 and why in err, err
    assert not (tmp_path / "out.h5").exists()


def test_an_output_inside_a_source_folder_or_onto_a_source_file_is_refused(tmp_path):
    make_hf_dataset(tmp_path / "ds")
    train = tmp_path / "ds" / "data" / "train-00000-of-00002.parquet"
    before = checksums(tmp_path)
    for sources, out in (((tmp_path / "ds",), tmp_path / "ds" / "out.h5"),
                         ((train,), train)):
        status, _, err = run_packer("parquet", "--source", *sources, "--out", out, "--force")
        assert status == 2 and len(err.splitlines()) == 1, err
        assert "write the output elsewhere" in err and checksums(tmp_path) == before
