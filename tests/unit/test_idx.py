"""The IDX packer (petra_mpi/prep/idx.py) on small MNIST-format files written here, gzipped and plain;
the reader's mirror rule for the sets it writes; and a short training run on such a file."""
import gzip
import json
import os
import signal

import h5py
import numpy as np
import pytest
import torch

from tests.support.outputs import check_run_outputs
from tests.support.paths import ROOT
from petra_mpi.prep.verify import verify
from tests.support.idx_files import make_set, pack, write_idx
from petra_mpi.data import BatchLoader, open_split
from petra_mpi.data import augment as A


def exact_stats(gray):
    x = gray.astype(np.float64).ravel() / 255
    return x.mean(), x.std()


@pytest.mark.parametrize("gz", [True, False], ids=["gzipped", "plain"])
def test_pixel_exact(tmp_path, gz):
    data = make_set(tmp_path / "fashion-mnist", gz=gz)
    out = tmp_path / "out" / "fm.h5"
    status, stdout, err = pack("--source", tmp_path / "fashion-mnist", "--out", out)
    assert status == 0, err
    assert "data set: fashion-mnist (hflip on)" in stdout
    with h5py.File(out, "r") as f:
        for split, (gray, labels) in data.items():
            images = f[f"{split}/images"][:]
            assert images.dtype == np.uint8 and images.shape == gray.shape + (3,)
            for c in range(3):  # R = G = B = the file's byte
                np.testing.assert_array_equal(images[..., c], gray)
            assert f[f"{split}/labels"].dtype == np.int64
            np.testing.assert_array_equal(f[f"{split}/labels"][:], labels)
        a = f.attrs
        assert (a["num_classes"], a["source"], a["hflip"]) == (10, "fashion-mnist", 1)
        assert [n.decode() for n in f["classes"][:]][:2] == ["T-shirt/top", "Trouser"]
        mean, std = exact_stats(data["train"][0])
        np.testing.assert_allclose(a["mean"], [mean] * 3, rtol=1e-12)
        np.testing.assert_allclose(a["std"], [std] * 3, rtol=1e-12)
    summary, bad = verify(str(out))
    assert bad == [], bad
    assert os.listdir(tmp_path / "out") == ["fm.h5"]


def test_emnist_layout_and_prefix_choice(tmp_path):
    """EMNIST's names (a prefix, `test` for t10k), plain and gzipped files side by side, labels
    1..26 (letters): 27 classes, no mirroring, the data set told by the prefix."""
    src = tmp_path / "raw"
    letters = make_set(src, prefix="emnist-letters-", test="test", classes=26, first_label=1)
    make_set(src, prefix="emnist-digits-", test="test", gz=False, seed=1)
    out = tmp_path / "e.h5"
    status, _, err = pack("--source", src, "--out", out)
    assert status == 2 and "several IDX sets" in err and "--prefix" in err, err
    assert not out.exists()
    status, stdout, err = pack("--source", src, "--out", out, "--prefix", "emnist-letters-")
    assert status == 0, err
    assert "data set: emnist (hflip off)" in stdout
    with h5py.File(out, "r") as f:
        a = f.attrs
        assert (a["num_classes"], a["source"], a["hflip"]) == (27, "emnist-letters", 0)
        assert "classes" not in f
        np.testing.assert_array_equal(f["val/images"][..., 1], letters["val"][0])
        np.testing.assert_array_equal(f["val/labels"][:], letters["val"][1])
    assert verify(str(out))[1] == []


def truncate(path, keep):
    data = open(path, "rb").read()
    open(path, "wb").write(data[:keep])


def gz_truncate(path):
    truncate(path, os.path.getsize(path) // 2)


def plain_truncate(path):
    truncate(path, os.path.getsize(path) - 1)


def wrong_magic(path):
    gz = path.endswith(".gz")
    with (gzip.open if gz else open)(path, "rb") as fh:
        data = bytearray(fh.read())
    data[3] = 1  # an images file claiming one dimension (a labels file's magic)
    with (gzip.open if gz else open)(path, "wb") as fh:
        fh.write(bytes(data))


def short_labels(path):
    write_idx(path, np.zeros(39, np.uint8), gz=path.endswith(".gz"))


def label_out_of_range(path):
    write_idx(path, np.full(40, 10, np.uint8), gz=path.endswith(".gz"))


BAD = {  # name: (file to break, how, words the one error line must hold)
    "truncated gzip": ("train-images-idx3-ubyte.gz", gz_truncate, ["train-images", "cannot read"]),
    "truncated plain": ("t10k-images-idx3-ubyte", plain_truncate, ["t10k-images", "truncated"]),
    "wrong magic": ("train-images-idx3-ubyte.gz", wrong_magic, ["magic number 0x00000801",
                                                                 "expected 0x00000803"]),
    "count mismatch": ("t10k-labels-idx1-ubyte", short_labels, ["40 images", "39 labels"]),
    "missing file": ("train-labels-idx1-ubyte.gz", os.remove, ["missing train-labels-idx1-ubyte"]),
    "label out of range": ("t10k-labels-idx1-ubyte", label_out_of_range, ["label 10", "[0, 10)"]),
}


@pytest.mark.parametrize("name", BAD)
def test_bad_input_one_line_no_output(tmp_path, name):
    src = tmp_path / "fashion-mnist"
    make_set(src / "gz", gz=True)
    make_set(src / "plain", gz=False)
    file, breaker, words = BAD[name]
    folder = src / ("gz" if file.endswith(".gz") else "plain")
    breaker(str(folder / file))
    outdir = tmp_path / "out"
    outdir.mkdir()
    status, _, err = pack("--source", folder, "--out", outdir / "fm.h5",
                          "--dataset", "fashion-mnist")
    assert status == 2, err
    assert "Traceback" not in err
    last = err.strip().splitlines()[-1]
    assert last.startswith("petra_mpi.prep.idx: error: ") and file.removesuffix(".gz")[:11] in last, last
    for word in words:
        assert word in last, last
    assert os.listdir(outdir) == []


def test_unknown_dataset_name_asks_for_it(tmp_path):
    make_set(tmp_path / "files")
    status, _, err = pack("--source", tmp_path / "files", "--out", tmp_path / "x.h5")
    assert status == 2 and "--dataset" in err.strip().splitlines()[-1], err
    assert not (tmp_path / "x.h5").exists()


@pytest.mark.parametrize("dataset, mirrors", [("fashion-mnist", True), ("mnist", False)])
def test_training_reader_mirrors_only_where_the_file_allows(tmp_path, dataset, mirrors):
    """The loader's batch = crop_flip of the file's images with the batch's own draws, flips
    kept for clothes and zeroed for digits (the crops are drawn the same either way)."""
    make_set(tmp_path / "src", n_train=64, n_val=8)
    out = tmp_path / "d.h5"
    assert pack("--source", tmp_path / "src", "--out", out, "--dataset", dataset)[0] == 0
    src = open_split(str(out), "train")
    assert src.hflip is mirrors
    loader = BatchLoader(src, 32, train=True, seed=3, prefetch=0)
    x, _ = next(iter(loader))
    images, _ = src.take(loader.batch_indices(0, 0))
    dy, dx, flip = A.crop_params(loader.batch_rng(0, 0), 32)
    assert flip.any()
    scale, shift = A.norm_constants(src.mean, src.std, "cpu")
    expected = A.normalize(A.crop_flip(torch.from_numpy(images), torch.from_numpy(dy),
                                       torch.from_numpy(dx), torch.from_numpy(flip & mirrors)),
                           scale, shift)
    torch.testing.assert_close(x, expected, rtol=0, atol=0)


def test_training_smoke_on_a_packed_file(tmp_path):
    """configs/fashion_mnist.yaml, shrunk, trains one process over a packed 28x28 file: the
    RevNet's 10 stages take 28x28 inputs (28 -> 14 -> 7 -> 4) and the outputs follow the
    contract."""
    from petra_mpi.train import main
    make_set(tmp_path / "fashion-mnist", n_train=128, n_val=32)
    data = tmp_path / "fm.h5"
    assert pack("--source", tmp_path / "fashion-mnist", "--out", data)[0] == 0
    out_dir = tmp_path / "run"
    threads = torch.get_num_threads()
    try:
        status = main([str(ROOT / "configs/fashion_mnist.yaml"), "--set", f"data.path={data}",
                       "--set", f"run.out_dir={out_dir}", "--set", "model.width=4",
                       "--set", "train.epochs=1", "--set", "data.batch_size=16",
                       "--set", "train.limit_batches=4", "--set", "run.threads=1",
                       "--set", "run.progress=false", "--set", "run.device=cpu"])
    finally:
        torch.set_num_threads(threads)
    assert status == 0
    summary = check_run_outputs(out_dir, epochs=1, stages=10)
    evals = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()
             if json.loads(line)["event"] == "eval"]
    assert evals[-1]["val_acc"] == summary["val_acc"]


def test_interrupted_packer_leaves_nothing(tmp_path):
    """Ctrl-C once the packer says it has started writing: exit 130, no output, no temporary."""
    from tests.support.launch import start_and_interrupt
    make_set(tmp_path / "fashion-mnist", n_train=60000, n_val=10, gz=False)
    outdir = tmp_path / "out"
    outdir.mkdir()
    rc, err, _ = start_and_interrupt(["petra_mpi.prep.idx", "--source", tmp_path / "fashion-mnist",
                                      "--out", outdir / "fm.h5"], signal.SIGINT)
    assert rc == 130 and "petra_mpi.prep.idx: interrupted" in err and "Traceback" not in err, err
    assert os.listdir(outdir) == []
