"""Tests of the offline packers (petra_mpi/prep/): real fixture files in the upstream formats, packed
through the command lines (in this process, but for the interruption tests), read back with h5py."""
import functools
import hashlib
import http.server
import io
import multiprocessing
import os
import pickle
import shutil
import signal
import subprocess
import sys
import threading
import time

import h5py
import numpy as np
import pytest
from PIL import Image

from tests.support.launch import children_of, run_packer, start_and_interrupt
from tests.support.paths import ROOT
from tests.support.verify_files import assert_one_problem
from petra_mpi.prep.common import PrepError, ordered_map
from petra_mpi.prep.imagenet import read_val_labels
from petra_mpi.prep.pictures import encode
from petra_mpi.prep.verify import verify
from tests.support.upstream_formats import (CLASSES, TARGET, make_cifar10, make_cifar100, make_imagenet,
                              smooth_image, to_planes)

REPO = str(ROOT)


def run(module, *args):
    """`python -m petra_mpi.prep.MODULE ARGS` run in this process (no interpreter start-up per call):
    its exit status and what it printed, as subprocess.run would give them."""
    status, out, err = run_packer(module, *args)
    return subprocess.CompletedProcess([sys.executable, "-m", f"petra_mpi.prep.{module}",
                                        *map(str, args)], status, out, err)


def assert_ok(proc):
    assert proc.returncode == 0, proc.stderr


def assert_clean_failure(proc, out, *words):
    """Exit 2, one line naming the problem, no traceback, and nothing left at `out`."""
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    assert "Traceback" not in proc.stderr, proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    module = proc.args[proc.args.index("-m") + 1]
    assert last.startswith(f"{module}: error: "), last
    for word in words:
        assert word in last, last
    assert not os.path.exists(out)
    assert not [n for n in os.listdir(os.path.dirname(out)) if ".tmp-" in n]


def stats_of(images):
    x = images.reshape(-1, 3).astype(np.float64) / 255
    return x.mean(0), x.std(0)


# ---------------------------------------------------------------- CIFAR fixtures

def test_cifar10_pixel_exact_and_verify(tmp_path):
    tarball, (train_x, train_y, val_x, val_y, names) = make_cifar10(tmp_path / "src")
    out = tmp_path / "c10.h5"
    proc = run("cifar", "--variant", "cifar10", "--source", tmp_path / "src", "--out", out)
    assert_ok(proc)
    assert "60 images" in proc.stdout and "10 images" in proc.stdout  # the summary
    with h5py.File(out, "r") as f:
        assert f["train/images"].dtype == np.uint8 and f["train/labels"].dtype == np.int64
        np.testing.assert_array_equal(f["train/images"][:], train_x)
        np.testing.assert_array_equal(f["train/labels"][:], train_y)
        np.testing.assert_array_equal(f["val/images"][:], val_x)
        np.testing.assert_array_equal(f["val/labels"][:], val_y)
        assert f["train/images"].chunks[1:] == (32, 32, 3)
        assert [c.decode() for c in f["classes"][:]] == names
        a = f.attrs
        assert int(a["schema_version"]) == 1 and int(a["num_classes"]) == 10
        assert a["source"] == "cifar10"
        mean, std = stats_of(train_x)
        np.testing.assert_allclose(a["mean"], mean, atol=1e-12)
        np.testing.assert_allclose(a["std"], std, atol=1e-12)
    # --source may also name the tarball itself.
    out2 = tmp_path / "c10b.h5"
    assert_ok(run("cifar", "--source", tarball, "--out", out2))
    assert_ok(run("verify", out2))


def test_cifar100_fine_and_coarse(tmp_path):
    _, (x, fine, coarse, n) = make_cifar100(tmp_path)
    for kind, labels, k in (("fine", fine, 100), ("coarse", coarse, 20)):
        out = tmp_path / f"{kind}.h5"
        assert_ok(run("cifar", "--variant", "cifar100", "--labels", kind,
                      "--source", tmp_path, "--out", out))
        with h5py.File(out, "r") as f:
            np.testing.assert_array_equal(f["train/images"][:], x[:n])
            np.testing.assert_array_equal(f["val/images"][:], x[n:])
            np.testing.assert_array_equal(f["train/labels"][:], labels[:n])
            np.testing.assert_array_equal(f["val/labels"][:], labels[n:])
            assert int(f.attrs["num_classes"]) == k and len(f["classes"]) == k
            assert f["classes"][1].decode() == f"{kind}1"
        assert_ok(run("verify", out))


def test_cifar_bad_inputs(tmp_path):
    out = str(tmp_path / "o.h5")
    # missing tarball
    assert_clean_failure(run("cifar", "--source", tmp_path / "nothing", "--out", out), out,
                         "cifar-10-python.tar.gz", "not found")
    # the CIFAR-100 archive given as CIFAR-10
    c100, _ = make_cifar100(tmp_path / "c100")
    os.rename(c100, tmp_path / "c100" / "cifar-10-python.tar.gz")
    assert_clean_failure(run("cifar", "--source", tmp_path / "c100", "--out", out), out,
                         "cifar-10-batches-py/", "--variant")
    # not an archive at all
    junk = tmp_path / "junk" / "cifar-10-python.tar.gz"
    junk.parent.mkdir()
    junk.write_bytes(b"not a tarball" * 100)
    assert_clean_failure(run("cifar", "--source", junk, "--out", out), out, "tar archive")
    # a label out of range
    make_cifar10(tmp_path / "bad", bad_label=True)
    assert_clean_failure(run("cifar", "--source", tmp_path / "bad", "--out", out), out,
                         "data_batch_4", "label 10")


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


@pytest.fixture
def http_dir(tmp_path):
    """A local HTTP server on 127.0.0.1 serving a folder: yields (folder, base url)."""
    folder = tmp_path / "served"
    folder.mkdir()
    server = http.server.ThreadingHTTPServer(
        ("127.0.0.1", 0), functools.partial(_QuietHandler, directory=str(folder)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield folder, f"http://127.0.0.1:{server.server_address[1]}/"
    server.shutdown()
    server.server_close()


def test_cifar_download_md5(tmp_path, http_dir):
    served, base = http_dir
    tarball, (train_x, *_) = make_cifar10(served)
    url = base + "cifar-10-python.tar.gz"
    md5 = hashlib.md5(open(tarball, "rb").read()).hexdigest()
    # Wrong checksum (the published one is not that of our fixture): exit 2, nothing kept.
    dl, out = tmp_path / "dl", str(tmp_path / "o.h5")
    proc = run("cifar", "--source", dl, "--out", out, "--download", "--url", url)
    assert_clean_failure(proc, out, "MD5")
    assert not dl.exists() or os.listdir(dl) == []
    # Right checksum: the tarball lands in --source and the pack succeeds.
    proc = run("cifar", "--source", dl, "--out", out, "--download", "--url", url, "--md5", md5)
    assert_ok(proc)
    assert open(dl / "cifar-10-python.tar.gz", "rb").read() == open(tarball, "rb").read()
    with h5py.File(out, "r") as f:
        np.testing.assert_array_equal(f["train/images"][:], train_x)
    # A server error is an input error too.
    out3 = str(tmp_path / "o3.h5")
    proc = run("cifar", "--source", tmp_path / "dl3", "--out", out3, "--download",
               "--url", base + "missing.tar.gz")
    assert_clean_failure(proc, out3, "download", "404")


# ---------------------------------------------------------------- Imagenet32

@pytest.mark.parametrize("size", [32, 64])
def test_imagenet32_npz_and_pickle(tmp_path, size):
    rng = np.random.default_rng(size)
    src = tmp_path / "src"
    src.mkdir()
    batches = []
    for k in range(1, 4):
        x = rng.integers(0, 256, (6, size, size, 3), dtype=np.uint8)
        y = rng.integers(1, 1001, 6)
        y[0] = 1000 if k == 1 else 1  # both ends of the 1-based range
        batches.append((x, y))
        if k == 2:  # the older pickled release, without a suffix
            with open(src / "train_data_batch_2", "wb") as fh:
                pickle.dump({"data": to_planes(x), "labels": y.tolist(), "mean": np.zeros(3)}, fh)
        else:
            np.savez(src / f"train_data_batch_{k}.npz", data=to_planes(x), labels=y.tolist(),
                     mean=np.zeros(3 * size * size))
    vx = rng.integers(0, 256, (5, size, size, 3), dtype=np.uint8)
    vy = rng.integers(1, 1001, 5)
    np.savez(src / "val_data.npz", data=to_planes(vx), labels=vy.tolist())
    out = tmp_path / "i.h5"
    assert_ok(run("imagenet32", "--source", src, "--out", out))
    train_x = np.concatenate([b[0] for b in batches])
    with h5py.File(out, "r") as f:
        np.testing.assert_array_equal(f["train/images"][:], train_x)
        np.testing.assert_array_equal(f["train/labels"][:], np.concatenate([b[1] for b in batches]) - 1)
        np.testing.assert_array_equal(f["val/images"][:], vx)
        np.testing.assert_array_equal(f["val/labels"][:], vy - 1)
        assert int(f.attrs["num_classes"]) == 1000 and f.attrs["source"] == f"imagenet{size}"
        np.testing.assert_allclose(f.attrs["mean"], stats_of(train_x)[0], atol=1e-12)
        np.testing.assert_allclose(f.attrs["std"], stats_of(train_x)[1], atol=1e-12)
    assert_ok(run("verify", out))


def test_imagenet32_bad_inputs(tmp_path):
    src, out = tmp_path / "src", str(tmp_path / "o.h5")
    src.mkdir()
    x = np.zeros((4, 3072), np.uint8)
    np.savez(src / "train_data_batch_1.npz", data=x, labels=[1, 2, 3, 4])
    np.savez(src / "train_data_batch_3.npz", data=x, labels=[1, 2, 3, 4])
    assert_clean_failure(run("imagenet32", "--source", src, "--out", out), out, "train_data_batch_2")
    np.savez(src / "train_data_batch_2.npz", data=x, labels=[1, 0, 3, 4])  # 0 is not 1-based
    assert_clean_failure(run("imagenet32", "--source", src, "--out", out), out, "val_data")
    np.savez(src / "val_data.npz", data=x, labels=[1, 2, 3, 4])
    assert_clean_failure(run("imagenet32", "--source", src, "--out", out), out,
                         "train_data_batch_2.npz", "label 0")


# ---------------------------------------------------------------- ImageNet (JPEG variant)

def check_jpeg_split(f, split, expected):
    g = f[split]
    offsets, jpeg = g["offsets"][:], g["jpeg"]
    assert g["offsets"].dtype == np.int64 and jpeg.dtype == np.uint8
    assert len(offsets) == len(expected) + 1 and offsets[0] == 0 and offsets[-1] == jpeg.shape[0]
    np.testing.assert_array_equal(g["labels"][:], [label for _, label in expected])
    pixels = []
    for i, (path, _) in enumerate(expected):
        got = Image.open(io.BytesIO(jpeg[offsets[i]:offsets[i + 1]].tobytes()))
        assert got.format == "JPEG" and got.mode == "RGB"
        assert min(got.size) == TARGET
        w, h = Image.open(path).size
        assert abs(got.size[0] / got.size[1] - w / h) < 0.1  # aspect ratio kept
        ref = np.asarray(Image.open(path).convert("RGB").resize(got.size, Image.BILINEAR), np.float64)
        got = np.asarray(got, np.float64)
        assert np.abs(got - ref).mean() < 3, path
        pixels.append(got.reshape(-1, 3))
    return np.concatenate(pixels)


def test_imagenet_pack_flat_val(tmp_path):
    train, val, labels_file = make_imagenet(tmp_path / "src")
    out = tmp_path / "in.h5"
    proc = run("imagenet", "--source", tmp_path / "src", "--out", out, "--size", TARGET,
               "--workers", 2, "--val-labels", labels_file)
    assert_ok(proc)
    with h5py.File(out, "r") as f:
        assert "images" not in f["train"]
        train_pixels = check_jpeg_split(f, "train", train)
        check_jpeg_split(f, "val", val)
        assert [c.decode() for c in f["classes"][:]] == CLASSES
        assert int(f.attrs["image_size"]) == TARGET and int(f.attrs["num_classes"]) == 3
        # mean/std: of the resized training images (decoded here: within JPEG rounding)
        np.testing.assert_allclose(f.attrs["mean"], train_pixels.mean(0) / 255, atol=3e-3)
        np.testing.assert_allclose(f.attrs["std"], train_pixels.std(0) / 255, atol=3e-3)
        assert not [k for k in f.attrs if k.startswith("shard")]
    assert_ok(run("verify", out))


def test_imagenet_val_folders(tmp_path):
    train, val, _ = make_imagenet(tmp_path / "src", val_folders=True)
    out = tmp_path / "in.h5"
    assert_ok(run("imagenet", "--source", tmp_path / "src", "--out", out, "--size", TARGET,
                  "--workers", 1))
    with h5py.File(out, "r") as f:
        check_jpeg_split(f, "train", train)
        check_jpeg_split(f, "val", val)


def test_val_label_formats(tmp_path):
    files = [str(tmp_path / f"ILSVRC2012_val_{i:08d}.JPEG") for i in (1, 2, 3)]
    classes = ["n01", "n02", "n03"]
    want = [2, 0, 1]
    formats = {
        "pairs.txt": "".join(f"{os.path.basename(p)} {classes[k]}\n" for p, k in zip(files, want)),
        "kaggle.csv": "ImageId,PredictionString\n" + "".join(
            f"{os.path.basename(p)[:-5]},{classes[k]} 1 2 3 4\n" for p, k in zip(files, want)),
        "wnids.txt": "".join(f"{classes[k]}\n" for k in want),
        "devkit.txt": "1\n3\n2\n",  # ids through synsets: id 1 -> n03, 2 -> n02, 3 -> n01
    }
    synsets = tmp_path / "synsets.txt"
    synsets.write_text("n03 three\nn02 two\nn01 one\n")
    for name, text in formats.items():
        (tmp_path / name).write_text(text)
        got = read_val_labels(str(tmp_path / name), files, classes, str(synsets))
        assert got == want, name
    with pytest.raises(PrepError, match="--synsets"):
        read_val_labels(str(tmp_path / "devkit.txt"), files, classes, None)
    (tmp_path / "short.txt").write_text("n01\nn02\n")
    with pytest.raises(PrepError, match="2 labels for 3 files"):
        read_val_labels(str(tmp_path / "short.txt"), files, classes, None)
    (tmp_path / "unknown.txt").write_text("n01\nn09\nn02\n")
    with pytest.raises(PrepError, match="n09"):
        read_val_labels(str(tmp_path / "unknown.txt"), files, classes, None)


def test_imagenet_corrupt_image_fails_cleanly(tmp_path):
    make_imagenet(tmp_path / "src", val_folders=True, corrupt=True)
    out = str(tmp_path / "in.h5")
    proc = run("imagenet", "--source", tmp_path / "src", "--out", out, "--size", TARGET,
               "--workers", 2)
    assert_clean_failure(proc, out, "n02102040_zz.JPEG")
    # a val folder that is not a train class
    make_imagenet(tmp_path / "src2", val_folders=True)
    os.rename(tmp_path / "src2" / "val" / CLASSES[0], tmp_path / "src2" / "val" / "n99999999")
    proc = run("imagenet", "--source", tmp_path / "src2", "--out", out, "--size", TARGET)
    assert_clean_failure(proc, out, "n99999999")
    # a flat val folder without labels
    make_imagenet(tmp_path / "src3")
    proc = run("imagenet", "--source", tmp_path / "src3", "--out", out, "--size", TARGET)
    assert_clean_failure(proc, out, "--val-labels")


def read_all(path):
    with h5py.File(path, "r") as f:
        data = {}
        f.visititems(lambda name, obj: data.__setitem__(name, obj[()])
                     if isinstance(obj, h5py.Dataset) else None)
        return data, {k: f.attrs[k] for k in f.attrs}


@pytest.mark.parametrize("copy", [False, True])
def test_shards_merge_to_single_pass(tmp_path, copy):
    """Joined shards read byte for byte as a single-pass pack, through h5py, the trainer's
    reader and verify: by default a virtual join (the shards' bytes are not copied), with
    --copy a file that stands alone."""
    from petra_mpi.data.source import open_split
    make_imagenet(tmp_path / "src", val_folders=True)
    common = ["--source", tmp_path / "src", "--size", TARGET, "--workers", 1]
    single = tmp_path / "single.h5"
    assert_ok(run("imagenet", *common, "--out", single))
    (tmp_path / "parts").mkdir()
    shards = [tmp_path / "parts" / f"part{i}.h5" for i in range(3)]
    for i, shard in enumerate(shards):
        assert_ok(run("imagenet", *common, "--out", shard, "--shard", f"{i}/3"))
    assert_ok(run("verify", shards[1]))  # a shard is a valid file on its own
    merged = tmp_path / "joined" / "merged.h5"
    assert_ok(run("imagenet", "merge", "--out", merged, shards[2], shards[0], shards[1],
                  *(["--copy"] if copy else [])))
    with h5py.File(merged, "r") as f:
        assert f["train/jpeg"].is_virtual != copy
    (d1, a1), (d2, a2) = read_all(single), read_all(merged)
    assert d1.keys() == d2.keys() and a1.keys() == a2.keys()
    for k in d1:
        np.testing.assert_array_equal(d1[k], d2[k], err_msg=k)
    for k in a1:
        np.testing.assert_array_equal(a1[k], a2[k], err_msg=k)
    for split in ("train", "val"):
        want, got = open_split(single, split), open_split(merged, split)
        everything = np.arange(len(want))[::-1]  # out of order, across shard boundaries
        (w_blobs, w_labels), (g_blobs, g_labels) = want.take(everything), got.take(everything)
        assert g_blobs == w_blobs
        np.testing.assert_array_equal(g_labels, w_labels)
    assert_ok(run("verify", merged))
    # A virtual join needs its shards: without one it is refused, not read as zeros.
    os.rename(shards[1], tmp_path / "elsewhere.h5")
    if copy:
        assert_ok(run("verify", merged))
    else:
        proc = run("verify", merged)
        assert proc.returncode == 1 and "part1.h5" in proc.stderr, proc.stderr
        with pytest.raises(ValueError, match="part1.h5"):
            open_split(merged, "train")
    os.rename(tmp_path / "elsewhere.h5", shards[1])
    # An incomplete or inconsistent set of shards is refused.
    out = str(tmp_path / "bad.h5")
    assert_clean_failure(run("imagenet", "merge", "--out", out, shards[0], shards[2]), out,
                         "shard 1/3 is missing")
    assert_clean_failure(run("imagenet", "merge", "--out", out, shards[0], shards[0], shards[1]),
                         out, "both shard 0/3")
    assert_clean_failure(run("imagenet", "merge", "--out", out, single), out, "not a shard")


# ---------------------------------------------------------------- interruption

@pytest.mark.parametrize("sigint_ignored", [False, True])
def test_interrupted_synthetic_leaves_nothing(tmp_path, sigint_ignored):
    """Ctrl-C to a single-process packer while it computes (the pool case is below), also when
    it was started with SIGINT ignored (Python would leave it ignored)."""
    out = str(tmp_path / "s.h5")
    rc, err, _ = start_and_interrupt(["petra_mpi.prep.synthetic", "--out", out, "--train", 100000],
                                     signal.SIGINT, sigint_ignored=sigint_ignored)
    assert rc == 130 and "petra_mpi.prep.synthetic: interrupted" in err and "Traceback" not in err
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("sig, group, sigint_ignored", [(signal.SIGINT, True, False),
                                                        (signal.SIGINT, True, True),
                                                        (signal.SIGTERM, False, False)])
def test_interrupted_imagenet_pool_leaves_nothing(tmp_path, sig, group, sigint_ignored):
    """Ctrl-C (to the process group) or SIGTERM (to the packer) mid-run with 2 worker
    processes: no output, no temp file, no orphaned worker, no traceback from the workers."""
    src = tmp_path / "src"
    big = io.BytesIO()
    smooth_image(np.random.default_rng(0), 1024, 768).save(big, "JPEG", quality=90)
    for wnid in CLASSES[:2]:
        os.makedirs(src / "train" / wnid)
        os.makedirs(src / "val" / wnid)
        for j in range(100):
            (src / "train" / wnid / f"{j}.JPEG").write_bytes(big.getvalue())
        (src / "val" / wnid / "v.JPEG").write_bytes(big.getvalue())
    outdir = tmp_path / "out"
    outdir.mkdir()
    out = str(outdir / "in.h5")
    rc, err, kids = start_and_interrupt(
        ["petra_mpi.prep.imagenet", "--source", src, "--out", out, "--size", 700, "--workers", 2],
        sig, group=group, sigint_ignored=sigint_ignored)
    assert rc == 130 and "Traceback" not in err, err
    assert os.listdir(outdir) == []
    assert len(kids) == 2  # the pool was running ...
    for kid in kids:  # ... and is gone (the packer waited for it: no zombie, no orphan)
        assert not os.path.exists(f"/proc/{kid}"), kid


def test_interrupt_swallowed_on_the_way_still_stops_the_writing_and_the_commit(tmp_path,
                                                                             monkeypatch):
    """A signal whose KeyboardInterrupt was dropped (raised inside a finalizer, say) stops the
    write loop at its next batch, and keeps the output from appearing."""
    from petra_mpi.prep import common
    monkeypatch.setattr(common, "_interrupt_signals", [signal.SIGINT])
    out = tmp_path / "x.h5"
    with pytest.raises(KeyboardInterrupt):
        with common.atomic_h5(out) as f:
            f["a"] = np.arange(3)
    written = []
    with pytest.raises(KeyboardInterrupt):
        with common.atomic_h5(out) as f:
            common.ArrayWriter(f, "train", 2, 2).append(np.zeros((1, 2, 2, 3), np.uint8), [0])
            written.append("array")
    with pytest.raises(KeyboardInterrupt):
        with common.atomic_h5(out) as f:
            common.JpegWriter(f, "train").append(b"jpeg", 0)
            written.append("jpeg")
    assert written == [] and os.listdir(tmp_path) == []


# A command whose main imports a module that gets Ctrl-C during its import and drops every
# exception there, as a C extension's module initialisation does (numpy.random's, run by the
# first np.random call, is one). It then writes its output for up to 10 s, one row at a time.
_IMPORT_INTERRUPTED = """
import sys, time
import numpy as np
sys.path.insert(0, sys.argv[1])
from petra_mpi.prep.common import ArrayWriter, atomic_h5, run_cli
def main(argv):
    import dropping
    print("imported", flush=True)
    with atomic_h5(sys.argv[2]) as f:
        writer = ArrayWriter(f, "train", 2, 2)
        end = time.monotonic() + 10
        while time.monotonic() < end:
            writer.append(np.zeros((1, 2, 2, 3), np.uint8), [0])
    print("worked to the end", flush=True)
run_cli(main)
"""
_DROPPING = """
import os, signal
try:
    os.kill(os.getpid(), signal.SIGINT)
    sum(range(1000))
except BaseException:
    pass
"""


def test_ctrl_c_that_an_import_drops_stops_the_command_at_its_first_write(tmp_path):
    """The import ends, then the first row written stops the command: exit status 130, no
    output, no traceback."""
    (tmp_path / "dropping.py").write_text(_DROPPING)
    out = tmp_path / "out" / "o.h5"
    proc = subprocess.run([sys.executable, "-c", _IMPORT_INTERRUPTED, str(tmp_path), str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 130, (proc.returncode, proc.stderr)
    assert proc.stdout.startswith("imported\nstarted: writing ") and "worked" not in proc.stdout
    assert "interrupted" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    assert os.listdir(out.parent) == []


def test_the_callers_signal_handlers_and_timer_outlive_the_command():
    """run_cli puts back the handlers of SIGINT and SIGTERM it found, and leaves a caller's
    timer (SIGALRM, ITIMER_REAL) alone, also when the command was interrupted."""
    from petra_mpi.prep.common import run_cli

    def mine(signum, frame):
        pass

    def interrupted(argv):
        os.kill(os.getpid(), signal.SIGTERM)
    previous = {s: signal.signal(s, mine) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGALRM)}
    signal.setitimer(signal.ITIMER_REAL, 3600)
    try:
        with pytest.raises(SystemExit) as stop:
            run_cli(interrupted, [])
        assert stop.value.code == 130
        assert all(signal.getsignal(s) is mine for s in previous)
        assert signal.getitimer(signal.ITIMER_REAL)[0] > 3000
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        for s, handler in previous.items():
            signal.signal(s, handler)


def test_an_error_after_a_swallowed_interrupt_is_the_interrupt(capsys):
    """A library that swallowed the KeyboardInterrupt and then failed for it: exit status 130
    with the interrupted line, not its error's traceback."""
    from petra_mpi.prep.common import run_cli

    def half_broken(argv):
        try:
            os.kill(os.getpid(), signal.SIGINT)
        except KeyboardInterrupt:
            pass
        raise ValueError("left in a broken state")
    with pytest.raises(SystemExit) as stop:
        run_cli(half_broken, [])
    assert stop.value.code == 130
    assert "interrupted" in capsys.readouterr().err


FINISHED = multiprocessing.Value("i", 0)  # items the pool workers have finished (fork-shared)


def count_finished(x):
    with FINISHED.get_lock():
        FINISHED.value += 1
    return x


def test_pool_results_in_flight_are_bounded():
    """A writer that stalls: the workers finish what they were given and stop there, so the
    results finished and not yet consumed stay bounded (2 chunks per worker + the one being
    consumed), not the whole input."""
    FINISHED.value = 0
    pulled = []  # items handed over to the pool

    def items():
        for i in range(400):
            pulled.append(i)
            yield i

    workers, chunk = 2, 8  # 8: the packer's chunk
    bound = (2 * workers + 1) * chunk
    with ordered_map(workers) as pmap:
        for consumed, value in enumerate(pmap(count_finished, items())):
            assert value == consumed
            if consumed == 10:  # stall until the workers have finished all they were given
                deadline = time.monotonic() + 60
                while FINISHED.value < len(pulled):
                    assert time.monotonic() < deadline, (FINISHED.value, len(pulled))
                    time.sleep(0.01)
                assert FINISHED.value - consumed <= bound, FINISHED.value
    assert consumed == 399 and FINISHED.value == 400


# ---------------------------------------------------------------- the output

# Each packer's inputs, present in name only: its output is checked before any input is read.
NAMED_INPUTS = {
    "cifar": ["cifar-10-python.tar.gz"],
    "idx": ["train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte",
            "t10k-labels-idx1-ubyte"],
    "imagenet": [], "imagenet32": ["train_data_batch_1", "val_data"], "synthetic": None,
    "text": ["a.txt"], "folder": [], "parquet": []}


@pytest.mark.parametrize("module", NAMED_INPUTS)
def test_every_packer_keeps_an_existing_output(tmp_path, module):
    """Without --force (which the folder packer's and merge's tests use) an existing output is
    left as it is, whatever the packer."""
    (tmp_path / "src").mkdir()
    for name in NAMED_INPUTS[module] or ():
        (tmp_path / "src" / name).write_bytes(b"")
    source = [] if NAMED_INPUTS[module] is None else ["--source", tmp_path / "src"]
    out = tmp_path / "old.h5"
    out.write_bytes(b"keep me")
    status, _, err = run_packer(module, *source, "--out", out)
    assert status == 2 and err == f"petra_mpi.prep.{module}: error: {out} exists: --force replaces it\n"
    assert out.read_bytes() == b"keep me"


# ---------------------------------------------------------------- synthetic, verify, --help

def test_resize_antialiases(tmp_path):
    """Shrinking a 1-pixel checkerboard must give flat grey (a filter that only samples, like
    nearest neighbour, keeps black and white pixels or aliases into stripes)."""
    board = (np.indices((128, 192)).sum(0) % 2 * 255).astype(np.uint8)
    for ext in ("png", "JPEG"):
        path = tmp_path / f"board.{ext}"
        Image.fromarray(board).save(path, quality=95)
        data, stats, err = encode(str(path), 32)
        assert err is None
        got = np.asarray(Image.open(io.BytesIO(data)), np.float64)
        assert got.shape == (32, 48, 3)
        assert abs(got.mean() - 127.5) < 8 and got.std() < 8, (ext, got.mean(), got.std())
        assert stats.count == 32 * 48


def test_the_old_command_names_still_pack_and_verify(tmp_path):
    """`python -m data_prep.X` (the packers' names before they moved into the package) runs the
    same command as `python -m petra_mpi.prep.X`: the same file, the same checks."""
    old, new = tmp_path / "old.h5", tmp_path / "new.h5"
    for module, out in (("data_prep.synthetic", old), ("petra_mpi.prep.synthetic", new)):
        proc = subprocess.run([sys.executable, "-m", module, "--out", out, "--train", "32",
                               "--val", "16"], cwd=ROOT, capture_output=True, text=True,
                              timeout=120)
        assert proc.returncode == 0, proc.stderr
    with h5py.File(old, "r") as a, h5py.File(new, "r") as b:
        np.testing.assert_array_equal(a["train/images"][:], b["train/images"][:])
    with h5py.File(old, "r+") as f:
        f["train/labels"][0] = 99  # outside num_classes: the old name must fail as the new one
    proc = subprocess.run([sys.executable, "-m", "data_prep.verify", old], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and "values outside [0, 10)" in proc.stderr, proc.stderr


def test_synthetic_matches_make_synthetic(tmp_path):
    out = tmp_path / "s.h5"
    assert_ok(run("synthetic", "--out", out, "--train", 64, "--val", 32, "--seed", 3))
    from petra_mpi.data.synthetic import make_synthetic  # here: the other tests need no torch
    tx, ty = make_synthetic(64, 3)
    vx, vy = make_synthetic(32, 4)  # val uses seed + 1
    with h5py.File(out, "r") as f:
        np.testing.assert_array_equal(f["train/images"][:], tx)
        np.testing.assert_array_equal(f["train/labels"][:], ty)
        np.testing.assert_array_equal(f["val/images"][:], vx)
        np.testing.assert_array_equal(f["val/labels"][:], vy)
        np.testing.assert_allclose(f.attrs["mean"], stats_of(tx)[0], atol=1e-12)
        assert f.attrs["source"] == "synthetic" and int(f.attrs["num_classes"]) == 10
    proc = run("verify", out)
    assert_ok(proc)
    assert "OK" in proc.stdout


def test_synthetic_packs_a_smaller_side_and_refuses_one_too_small(tmp_path):
    """--size 16: the same generator at that side (the bf16 learning test trains on it)."""
    out = tmp_path / "s16.h5"
    assert_ok(run("synthetic", "--out", out, "--train", 16, "--val", 8, "--size", 16))
    from petra_mpi.data.synthetic import make_synthetic
    with h5py.File(out, "r") as f:
        assert f["train/images"].shape == (16, 16, 16, 3)
        np.testing.assert_array_equal(f["train/images"][:], make_synthetic(16, 0, 16)[0])
    proc = run("synthetic", "--out", tmp_path / "s4.h5", "--train", 16, "--val", 8, "--size", 4)
    assert proc.returncode != 0 and "--size must be at least 8, not 4" in proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / "s4.h5").exists()


def _break_labels(f):
    f["train/labels"][5] = int(f.attrs["num_classes"])


def _break_dtype(f):
    labels = f["val/labels"][:]
    del f["val/labels"]
    f["val/labels"] = labels.astype(np.int32)


def _break_mean(f):
    f.attrs["mean"] = np.array([0.9, 0.1, 0.5])


def _break_version(f):
    f.attrs["schema_version"] = 2


def _break_chunks(f):
    images = f["train/images"][:]
    del f["train/images"]
    f["train/images"] = images  # contiguous: not chunked along N


def _break_count(f):
    del f["val/images"]
    f.create_dataset("val/images", data=np.zeros((3, 32, 32, 3), np.uint8), chunks=(1, 32, 32, 3))


@pytest.mark.parametrize("breaker, words", [
    (_break_labels, ["/train/labels", "outside [0, 10)"]),
    (_break_dtype, ["/val/labels", "int32", "int64"]),
    (_break_mean, ["attr mean"]),
    (_break_version, ["schema_version"]),
    (_break_chunks, ["/train/images", "chunks"]),
    (_break_count, ["/val/images", "3 images"]),
])
def test_verify_catches_violations(tmp_path, breaker, words):
    good = tmp_path / "good.h5"
    rng = np.random.default_rng(0)
    images, labels = rng.integers(0, 256, (40, 32, 32, 3), dtype=np.uint8), rng.integers(0, 10, 40)
    with h5py.File(good, "w") as f:
        for split in ("train", "val"):
            f.create_dataset(f"{split}/images", data=images, chunks=(8, 32, 32, 3))
            f[f"{split}/labels"] = labels
        mean, std = stats_of(images)
        f.attrs.update(schema_version=1, num_classes=10, mean=mean, std=std, source="test")
    assert verify(str(good))[1] == []
    assert_one_problem(good, tmp_path, breaker, words)


def test_verify_cli_and_jpeg_violations(tmp_path):
    make_imagenet(tmp_path / "src", val_folders=True)
    good = tmp_path / "in.h5"
    assert_ok(run("imagenet", "--source", tmp_path / "src", "--out", good, "--size", TARGET,
                  "--workers", 1))
    bad = tmp_path / "bad.h5"
    shutil.copy(good, bad)
    with h5py.File(bad, "r+") as f:
        o = f["train/offsets"][:]
        o[2], o[3] = o[3], o[2]  # no longer monotonic
        f["train/offsets"][:] = o
        f.attrs["image_size"] = TARGET + 1
        f["val/labels"][0] = -1
    proc = run("verify", bad)
    assert proc.returncode == 1
    assert "/train/offsets" in proc.stderr and "/val/labels" in proc.stderr
    assert f"image_size={TARGET + 1}" in proc.stderr
    proc = run("verify", tmp_path / "missing.h5")
    assert proc.returncode == 2 and "cannot open" in proc.stderr


@pytest.mark.parametrize("module", ["cifar", "imagenet32", "imagenet", "synthetic", "verify",
                                    "folder", "parquet"])
def test_help(module):
    proc = run(module, "--help")
    assert proc.returncode == 0 and "usage:" in proc.stdout


def kill_a_worker_once(x):
    """ordered_map's function for the test below: the worker given item 20 dies there."""
    if x == 20:
        os.kill(os.getpid(), signal.SIGKILL)
    return x


def fails_at_seven(x):
    if x == 7:
        raise ValueError("seven")
    return x


def test_pool_worker_that_dies_or_raises_stops_the_map():
    """A worker killed mid-map (the out-of-memory killer, say) is an error of the packer in one
    line, not a map waiting forever for its results; an exception in the function reaches the
    caller as it was raised; either way the workers are reaped."""
    others = set(children_of(os.getpid()))
    kids = []
    with pytest.raises(PrepError, match="a worker process ended before its work was done"):
        with ordered_map(2) as pmap:
            kids += set(children_of(os.getpid())) - others
            list(pmap(kill_a_worker_once, range(40)))
    with pytest.raises(ValueError, match="seven"):
        with ordered_map(2) as pmap:
            kids += set(children_of(os.getpid())) - others
            list(pmap(fails_at_seven, range(40)))
    assert len(kids) == 4
    for kid in kids:
        assert not os.path.exists(f"/proc/{kid}"), kid
