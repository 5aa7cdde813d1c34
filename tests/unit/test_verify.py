"""petra_mpi.prep.verify on what the packers make and on what it must find: a file of noise
pictures is valid in both variants, an array file's statistics are compared exactly, and a class
named twice among many is found in one pass. (Its checks of each schema violation:
test_data_prep.py, test_folder_prep.py, test_text_data.py; of crafted files:
test_crafted_data.py.)"""
import h5py
import numpy as np
import pytest
from PIL import Image

from tests.support.crafted_h5 import array_file, write_h5
from tests.support.launch import run_packer
from tests.support.verify_files import assert_one_problem
from petra_mpi.prep.verify import verify


@pytest.mark.parametrize("variant", [[], ["--raw", "16"]], ids=["jpeg", "array"])
def test_verify_passes_what_the_folder_packer_made_of_noise(tmp_path, variant):
    """Noise is where JPEG moves the statistics most: these pictures' std, 0.153 as packed,
    decodes as 0.111 to 0.117, far outside any tolerance a comparison could use. The JPEG
    variant's figures describe the pictures before encoding and are not recomputed; the array
    variant's are, exactly."""
    rng = np.random.default_rng(0)
    for name in ("a", "b"):
        (tmp_path / "src" / name).mkdir(parents=True)
        for j in range(8):
            picture = rng.integers(0, 256, (40, 48, 3), dtype=np.uint8)
            Image.fromarray(picture).save(tmp_path / "src" / name / f"{j}.png")
    out = tmp_path / "noise.h5"
    status, _, err = run_packer("folder", "--source", tmp_path / "src", "--out", out, "--size", 32,
                                "--workers", 1, *variant)
    assert status == 0, err
    summary, problems = verify(str(out))
    assert problems == [], problems
    assert any("before JPEG encoding" in line for line in summary) == (variant == [])


def test_an_array_files_statistics_are_compared_exactly(tmp_path):
    """verify reads every training image of an array file: the packers' figures come from exact
    sums, so a std off by 1e-5 is wrong."""
    good = tmp_path / "good.h5"
    write_h5(good, array_file)
    assert verify(str(good))[1] == []

    def nudge_std(f):
        f.attrs["std"] = f.attrs["std"] + 1e-5
    assert_one_problem(good, tmp_path, nudge_std, ["attr std", "the 16 training images give"])


@pytest.mark.timeout(60)  # a check over every pair of names would take minutes here
def test_a_class_named_twice_among_200_000_is_found(tmp_path):
    path = tmp_path / "classes.h5"
    names = [f"class {i}" for i in range(200_000)]
    names[123_456] = "class 7"
    with h5py.File(path, "w") as f:
        array_file(f)
        f.attrs["num_classes"] = len(names)
        f.create_dataset("classes", data=names, dtype=h5py.string_dtype("utf-8"))
    assert verify(str(path))[1] == ["/classes names a class twice or not at all: class 7"]
