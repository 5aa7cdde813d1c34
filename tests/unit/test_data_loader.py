"""The training-time reader: HDF5 / synthetic sources, sampler, resume, augmentation, JPEG."""
import gc
import io
import pickle
import threading

import h5py
import numpy as np
import pytest
import torch
from PIL import Image

from tests.support import crafted_h5
from tests.support.paths import ROOT
from petra_mpi.data import BatchLoader, channel_stats, make_synthetic, open_split
from petra_mpi.data import augment as A

MEAN = (0.1, 0.5, 0.9)   # deliberately not the images' statistics: the reader must use these
STD = (0.2, 0.3, 0.4)


def write_h5(path, n_train=300, n_val=70, size=32, chunk=64, seed=0, version=1, splits=("train", "val"),
             chunks=None):
    rng = np.random.default_rng(seed)
    data = {}
    with h5py.File(path, "w") as f:
        f.attrs.update(schema_version=version, num_classes=7, mean=MEAN, std=STD, source="test")
        for split, n in (("train", n_train), ("val", n_val)):
            if split not in splits:
                continue
            images = rng.integers(0, 256, (n, size, size, 3), dtype=np.uint8)
            labels = rng.integers(0, 7, n).astype(np.int64)
            f.create_dataset(f"{split}/images", data=images,
                             chunks={None: (chunk, size, size, 3), "none": None}.get(chunks, chunks))
            f.create_dataset(f"{split}/labels", data=labels)
            data[split] = (images, labels)
    return data


def unnormalize(x, mean=MEAN, std=STD):
    """float NCHW -> uint8 NHWC, inverting (x/255 - mean)/std (exact after rounding)."""
    m = torch.tensor(mean).view(1, 3, 1, 1)
    s = torch.tensor(std).view(1, 3, 1, 1)
    return ((x * s + m) * 255).round().clamp(0, 255).to(torch.uint8).permute(0, 2, 3, 1).numpy()


@pytest.fixture
def h5file(tmp_path):
    path = tmp_path / "d.h5"
    return path, write_h5(path)


def no_prefetch_threads():
    gc.collect()
    for _ in range(50):
        if not any(t.name == "petra-data-prefetch" and t.is_alive() for t in threading.enumerate()):
            return True
        threading.Event().wait(0.05)
    return False


# ---- sources ---------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["mmap", "contiguous", "h5py", "in_memory"])
def test_h5_source_reads_exact(tmp_path, mode):
    path = tmp_path / "d.h5"
    # chunks holding whole images are read through a memory map; other layouts through h5py
    chunks = {"contiguous": "none", "h5py": (64, 16, 32, 3)}.get(mode)
    data = write_h5(path, chunks=chunks)
    src = open_split(str(path), "train", in_memory=mode == "in_memory")
    images, labels = data["train"]
    assert (src.kind, len(src), src.image_size, src.num_classes) == ("array", 300, 32, 7)
    assert src.mean == pytest.approx(MEAN) and src.std == pytest.approx(STD)
    assert src._h5 is None  # lazily opened: constructing does not keep a handle (fork safety)
    x, y = src.read(10, 150)
    np.testing.assert_array_equal(x, images[10:150])
    np.testing.assert_array_equal(y, labels[10:150])
    assert (src._raw is not None) == (mode in ("mmap", "contiguous"))
    idx = np.array([299, 3, 4, 5, 5, 200, 0, 64, 63, 65])  # unsorted, duplicates, chunk edges
    x, y = src.take(idx)
    np.testing.assert_array_equal(x, images[idx])
    np.testing.assert_array_equal(y, labels[idx])
    src2 = pickle.loads(pickle.dumps(src))  # picklable for spawned processes, reopens itself
    np.testing.assert_array_equal(src2.take(idx)[0], images[idx])


def test_eval_loader_pixel_exact_in_order(h5file):
    path, data = h5file
    images, labels = data["val"]
    loader = BatchLoader(open_split(path, "val"), 32, train=False, seed=0)
    assert len(loader) == 3  # 70 = 32 + 32 + 6: the last batch is kept
    xs, ys = zip(*loader)
    assert [len(y) for y in ys] == [32, 32, 6]
    x = torch.cat(xs)
    assert x.dtype == torch.float32 and x.shape == (70, 3, 32, 32) and x.is_contiguous()
    np.testing.assert_array_equal(unnormalize(x), images)  # no crop/flip, file statistics
    np.testing.assert_array_equal(torch.cat(ys).numpy(), labels)
    # normalisation is exactly (x/255 - mean)/std with the FILE's mean/std
    ref = (torch.from_numpy(images).permute(0, 3, 1, 2).float() / 255
           - torch.tensor(MEAN).view(1, 3, 1, 1)) / torch.tensor(STD).view(1, 3, 1, 1)
    torch.testing.assert_close(x, ref, rtol=1e-5, atol=1e-5)


def test_train_loader_unaugmented_matches_indices(h5file):
    path, data = h5file
    images, labels = data["train"]
    loader = BatchLoader(open_split(path, "train"), 64, train=True, seed=3, augment=False)
    for b, (x, y) in enumerate(loader):
        idx = loader.batch_indices(b, epoch=0)
        np.testing.assert_array_equal(unnormalize(x), images[idx])
        np.testing.assert_array_equal(y.numpy(), labels[idx])
        assert torch.equal(loader.batch_labels(b, epoch=0), y)  # labels without reading images
    assert b == 3


def test_compressed_split_is_loaded_whole(tmp_path):
    path = tmp_path / "z.h5"
    images = np.random.default_rng(0).integers(0, 256, (50, 8, 8, 3), dtype=np.uint8)
    with h5py.File(path, "w") as f:
        f.attrs.update(schema_version=1, num_classes=2, mean=MEAN, std=STD, source="t")
        f.create_dataset("train/images", data=images, chunks=(16, 8, 8, 3), compression="gzip")
        f.create_dataset("train/labels", data=np.zeros(50, np.int64))
    src = open_split(path, "train")
    assert src.in_memory  # a chunk would be decompressed per image otherwise
    np.testing.assert_array_equal(src.take(np.array([49, 0, 17]))[0], images[[49, 0, 17]])


# ---- sampler ---------------------------------------------------------------------------------
def test_sampler_determinism_and_drop_last(h5file):
    path, _ = h5file
    src = open_split(path, "train")
    a = BatchLoader(src, 64, train=True, seed=5)
    b = BatchLoader(src, 64, train=True, seed=5)
    c = BatchLoader(src, 64, train=True, seed=6)
    assert len(a) == 300 // 64 == 4
    order = lambda ld, e: np.concatenate([ld.batch_indices(i, e) for i in range(len(ld))])
    np.testing.assert_array_equal(order(a, 0), order(b, 0))
    assert not np.array_equal(order(a, 0), order(a, 1))
    assert not np.array_equal(order(a, 0), order(c, 0))
    for e in (0, 1):
        o = order(a, e)
        assert len(o) == 256 and len(np.unique(o)) == 256 and o.max() < 300
    assert len(BatchLoader(src, 300, train=True, seed=0)) == 1
    assert len(BatchLoader(src, 301, train=True, seed=0)) == 0


def test_eval_covers_every_index_once(h5file):
    path, _ = h5file
    ld = BatchLoader(open_split(path, "train"), 64, train=False, seed=0)
    assert len(ld) == 5
    o = np.concatenate([ld.batch_indices(i) for i in range(len(ld))])
    np.testing.assert_array_equal(o, np.arange(300))


# ---- resume ----------------------------------------------------------------------------------
@pytest.mark.parametrize("prefetch", [0, 2])
def test_resume_gives_identical_batches(h5file, prefetch):
    path, _ = h5file
    src = open_split(path, "train")
    make = lambda: BatchLoader(src, 32, train=True, seed=11, prefetch=prefetch)
    ref = make()
    ref.set_epoch(2)
    full = list(ref)
    assert len(full) == 9 and ref.state_dict() == {"epoch": 3, "position": 0}

    part = make()
    part.set_epoch(2)
    it = iter(part)
    for _ in range(3):
        next(it)
    state = part.state_dict()
    assert state == {"epoch": 2, "position": 3}
    del it

    resumed = make()
    resumed.load_state_dict(state)
    resumed.set_epoch(2)  # the training loop's set_epoch at the top of the resumed epoch keeps the place
    rest = list(resumed)
    assert len(rest) == 6
    for (x, y), (x0, y0) in zip(rest, full[3:]):
        assert torch.equal(x, x0) and torch.equal(y, y0)  # same data AND same augmentation
    resumed.set_epoch(3)
    assert resumed.state_dict() == {"epoch": 3, "position": 0}
    assert no_prefetch_threads()


def test_augmentation_differs_between_epochs_and_batches(h5file):
    path, _ = h5file
    ld = BatchLoader(open_split(path, "train"), 64, train=True, seed=0, prefetch=0)
    e0 = ld.batch_rng(0, 0).integers(0, 1 << 30, 4)
    assert not np.array_equal(e0, ld.batch_rng(0, 1).integers(0, 1 << 30, 4))
    assert not np.array_equal(e0, ld.batch_rng(1, 0).integers(0, 1 << 30, 4))


# ---- augmentation ----------------------------------------------------------------------------
def test_crop_flip_is_a_window_of_the_padded_image():
    rng = np.random.default_rng(0)
    x = rng.integers(1, 256, (16, 32, 32, 3), dtype=np.uint8)  # no zeros: padding is visible
    dy, dx, flip = A.crop_params(rng, 16)
    dy[:4], dx[:4] = [0, 8, 0, 8], [0, 0, 8, 8]  # the extreme offsets
    flip[:2] = [True, False]
    out = A.crop_flip(torch.from_numpy(x), torch.from_numpy(dy), torch.from_numpy(dx),
                      torch.from_numpy(flip)).numpy()
    padded = np.pad(x, ((0, 0), (4, 4), (4, 4), (0, 0)))
    for k in range(16):
        ref = padded[k, dy[k]:dy[k] + 32, dx[k]:dx[k] + 32]
        np.testing.assert_array_equal(out[k], ref[:, ::-1] if flip[k] else ref)
    assert (out[0, :4, :4] == 0).all() and (out[3, -4:, -4:] == 0).all()
    assert flip.any() and not flip.all()


def test_loader_augmentation_uses_batch_draws(h5file):
    path, data = h5file
    images = data["train"][0]
    ld = BatchLoader(open_split(path, "train"), 64, train=True, seed=1)
    padded = np.pad(images, ((0, 0), (4, 4), (4, 4), (0, 0)))
    seen_flip = seen_shift = False
    for b, (x, _) in enumerate(ld):
        idx = ld.batch_indices(b, epoch=0)
        dy, dx, flip = A.crop_params(ld.batch_rng(b, epoch=0), len(idx))
        got = unnormalize(x)
        for k, i in enumerate(idx):
            ref = padded[i, dy[k]:dy[k] + 32, dx[k]:dx[k] + 32]
            np.testing.assert_array_equal(got[k], ref[:, ::-1] if flip[k] else ref)
        seen_flip |= flip.any()
        seen_shift |= bool((dy != 4).any())
    assert seen_flip and seen_shift


def test_flip_images():
    x = torch.arange(2 * 2 * 3 * 3, dtype=torch.uint8).view(2, 2, 3, 3)
    out = A.flip_images(x, torch.tensor([True, False]))
    assert torch.equal(out[0], x[0].flip(1)) and torch.equal(out[1], x[1])


# ---- synthetic -------------------------------------------------------------------------------
def test_synthetic_source_deterministic_val_uses_train_stats():
    tr = open_split("synthetic", "train", synthetic_sizes=(200, 50), seed=4)
    va = open_split("synthetic", "val", synthetic_sizes=(200, 50), seed=4)
    tr2 = open_split("synthetic", "train", synthetic_sizes=(200, 50), seed=4)
    assert (len(tr), len(va), tr.num_classes, tr.kind, tr.image_size) == (200, 50, 10, "array", 32)
    np.testing.assert_array_equal(tr.read(0, 200)[0], tr2.read(0, 200)[0])
    np.testing.assert_array_equal(va.read(0, 50)[0], make_synthetic(50, 5)[0])
    mean, std = channel_stats(make_synthetic(200, 4)[0])
    assert tr.mean == va.mean == pytest.approx(mean) and tr.std == va.std == pytest.approx(std)
    assert channel_stats(make_synthetic(50, 5)[0])[0] != pytest.approx(va.mean, abs=1e-9)
    x, _ = next(iter(BatchLoader(tr, 200, train=False, seed=0)))
    assert abs(float(x.mean())) < 0.05 and abs(float(x.std()) - 1) < 0.05  # train stats normalise


# ---- JPEG variant ----------------------------------------------------------------------------
def write_jpeg_h5(path, sizes=((64, 80), (96, 64), (64, 64), (70, 64), (64, 100))):
    rng = np.random.default_rng(0)
    blobs = []
    for w, h in sizes:
        yy, xx = np.mgrid[0:h, 0:w]
        img = np.stack([xx * 3 % 256, yy * 5 % 256, (xx + yy) % 256], -1).astype(np.uint8)
        img = np.clip(img.astype(int) + rng.integers(-10, 10, img.shape), 0, 255).astype(np.uint8)
        buf = io.BytesIO()
        Image.fromarray(img).save(buf, format="JPEG", quality=90)
        blobs.append(buf.getvalue())
    offsets = np.concatenate([[0], np.cumsum([len(b) for b in blobs])]).astype(np.int64)
    with h5py.File(path, "w") as f:
        f.attrs.update(schema_version=1, num_classes=3, mean=MEAN, std=STD, source="t", image_size=64)
        for split in ("train", "val"):
            f.create_dataset(f"{split}/jpeg", data=np.frombuffer(b"".join(blobs), np.uint8),
                             chunks=(4096,))
            f.create_dataset(f"{split}/offsets", data=offsets)
            f.create_dataset(f"{split}/labels", data=np.arange(len(blobs)) % 3)
    return blobs


def test_jpeg_source_and_loader(tmp_path):
    path = tmp_path / "j.h5"
    blobs = write_jpeg_h5(path)
    src = open_split(path, "val")
    assert (src.kind, src.image_size, len(src)) == ("jpeg", 64, 5)
    got, labels = src.take(np.array([4, 0, 1]))
    assert got == [blobs[4], blobs[0], blobs[1]] and labels.tolist() == [1, 0, 1]

    # eval: centre crop 56 of the 64-pixel shorter side, pixel-exact against PIL
    ld = BatchLoader(src, 4, train=False, seed=0, crop=56, decode_threads=2)
    (x0, _), (x1, _) = list(ld)
    assert x0.shape == (4, 3, 56, 56) and x1.shape == (1, 3, 56, 56)
    ref = []
    for b in blobs:
        im = np.asarray(Image.open(io.BytesIO(b)).convert("RGB"))
        h, w = im.shape[:2]
        top, left = (h - 56) // 2, (w - 56) // 2
        ref.append(im[top:top + 56, left:left + 56])
    np.testing.assert_array_equal(unnormalize(torch.cat([x0, x1])), np.stack(ref))
    ld.close()

    # train: random-resized-crop + flip to `crop`, deterministic, resumable
    make = lambda: BatchLoader(open_split(path, "train"), 2, train=True, seed=2, crop=48)
    full = list(make())
    assert len(full) == 2 and all(x.shape == (2, 3, 48, 48) for x, _ in full)
    again = make()
    again.load_state_dict({"epoch": 0, "position": 1})
    (x, y), = list(again)
    assert torch.equal(x, full[1][0]) and torch.equal(y, full[1][1])
    assert not torch.equal(full[0][0], unnormalize_eval_like(path, 48, make().batch_indices(0)))


def test_jpeg_crop_follows_the_stored_side_unless_set(tmp_path):
    """A file packed at --size 32 trains and evaluates on crops of 28 pixels, 7/8 of its side,
    not ImageNet's 224 (every picture upsampled 7x: a few images a second); the dry run takes the
    same side, the export records it for predict, and a crop above the side gets a warning."""
    from petra_mpi.config import load_config
    from petra_mpi.export import preprocessing_of
    from petra_mpi.run.dryrun import input_side
    from petra_mpi.run.loaders import crop_warning
    path = tmp_path / "j32.h5"
    crafted_h5.write_h5(path, lambda f: crafted_h5.jpeg_file(f, side=32))
    for split, crop, side in (("train", None, 28), ("val", None, 28), ("val", 40, 40)):
        loader = BatchLoader(open_split(path, split), 4, train=split == "train", seed=0,
                             crop=crop, prefetch=0, decode_threads=1)
        assert next(iter(loader))[0].shape == (4, 3, side, side)
    cfg = load_config(str(ROOT / "configs/quickstart.yaml"), [f"data.path={path}"])
    assert input_side(cfg) == (28, str(path)) and crop_warning(cfg, 32) is None
    assert preprocessing_of({**cfg.to_dict()["data"], "path": str(path)})["crop"] == 28
    cfg.data.crop = 224
    assert crop_warning(cfg, 32) == (
        f"petra_mpi: warning: data.crop 224 is larger than the pictures' stored side 32 in "
        f"{path}: every picture is upsampled 7.0x (slower, no more detail); leave data.crop at 0 "
        f"for 28, 7/8 of the side")


def unnormalize_eval_like(path, crop, idx):
    """The unaugmented (centre-crop) version of the same images, to show train crops differ."""
    ld = BatchLoader(open_split(path, "train"), 5, train=False, seed=0, crop=crop)
    x, _ = next(iter(ld))
    return x[idx]


def test_rrc_box_in_bounds_and_fallback():
    rng = np.random.default_rng(0)
    for w, h in [(64, 80), (300, 64), (5, 5), (1000, 3)]:
        _, u = A.rrc_uniforms(rng, 20)
        for k in range(20):
            left, top, bw, bh = A.rrc_box(w, h, u[k])
            assert 0 <= left and 0 <= top and 0 < bw and 0 < bh
            assert left + bw <= w and top + bh <= h
    # no try fits (all ratios far outside) -> centre crop with the ratio clamped
    assert A.rrc_box(1000, 3, np.ones((4, 10))) == (498, 0, 4, 3)


# ---- errors and lifetime ---------------------------------------------------------------------
def test_errors_name_the_path_and_problem(tmp_path):
    missing = tmp_path / "nope.h5"
    with pytest.raises(FileNotFoundError, match="nope.h5"):
        open_split(str(missing), "train")
    only_train = tmp_path / "t.h5"
    write_h5(only_train, splits=("train",))
    with pytest.raises(ValueError, match=r"t\.h5: /val is missing"):
        open_split(only_train, "val")
    old = tmp_path / "old.h5"
    write_h5(old, version=2)
    with pytest.raises(ValueError, match="schema_version"):
        open_split(old, "train")
    with pytest.raises(ValueError, match="split"):
        open_split(only_train, "test")
    bogus = tmp_path / "bogus.h5"
    bogus.write_bytes(b"not hdf5")
    with pytest.raises(ValueError, match="bogus.h5"):
        open_split(bogus, "train")
    with pytest.raises(ValueError, match="crop"):
        BatchLoader(open_split(only_train, "train"), 8, train=True, seed=0, crop=28)


def test_abandoned_and_closed_iterators_stop_their_thread(h5file):
    path, _ = h5file
    ld = BatchLoader(open_split(path, "train"), 16, train=True, seed=0, prefetch=2)
    it = iter(ld)
    next(it)
    assert any(t.name == "petra-data-prefetch" for t in threading.enumerate())
    del it  # abandoned mid-epoch
    assert no_prefetch_threads()
    it = iter(ld)
    next(it)
    ld.close()
    assert list(it) == []  # a closed loader's iterator ends
    assert no_prefetch_threads()
    assert ld.state_dict() == {"epoch": 0, "position": 2}


def test_reader_errors_reach_the_consumer(h5file):
    path, _ = h5file
    src = open_split(path, "train")

    def broken(indices):
        raise OSError("disk on fire")
    src.take = broken
    with pytest.raises(OSError, match="disk on fire"):
        next(iter(BatchLoader(src, 16, train=True, seed=0)))
    assert no_prefetch_threads()


@pytest.mark.skipif(not A.has_gpu_decode("cuda") or not torch.cuda.is_available(),
                    reason="needs CUDA and torchvision")
def test_jpeg_gpu_decode_matches_pil_shapes(tmp_path):
    path = tmp_path / "j.h5"
    write_jpeg_h5(path)
    cpu = BatchLoader(open_split(path, "val"), 5, train=False, seed=0, crop=56)
    gpu = BatchLoader(open_split(path, "val"), 5, train=False, seed=0, crop=56, device="cuda")
    assert gpu._gpu_decode
    (xc, _), = list(cpu)
    (xg, yg), = list(gpu)
    assert xg.is_cuda and yg.is_cuda and xg.shape == xc.shape
    # decoders differ in IDCT rounding only: a few grey levels
    assert (xg.cpu() - xc).abs().max() * 0.4 * 255 < 12


def test_interpreter_exits_with_a_live_iterator(tmp_path):
    """An iterator left mid-epoch (never closed) must not hang the interpreter at exit."""
    import subprocess
    import sys
    path = tmp_path / "d.h5"
    write_h5(path, n_train=200, n_val=100)
    jpath = tmp_path / "j.h5"
    write_jpeg_h5(jpath)
    code = (
        "from petra_mpi.data import open_split, BatchLoader\n"
        f"a = BatchLoader(open_split({str(path)!r}, 'train'), 8, train=True, seed=0, prefetch=1)\n"
        f"b = BatchLoader(open_split({str(jpath)!r}, 'train'), 1, train=True, seed=0, crop=32,\n"
        "                decode_threads=2, prefetch=1)\n"
        "ia, ib = iter(a), iter(b)\n"
        "next(ia); next(ib)\n"
        "print('ok')\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr


def test_reads_a_file_another_process_holds_open_for_writing(tmp_path):
    """The reader and verify open without HDF5's file lock: a file that another process holds
    open for writing (HDF5 locks it then) still reads, as it does where the file system offers
    no lock at all."""
    import subprocess
    import sys

    from petra_mpi.prep.verify import verify
    path = tmp_path / "d.h5"
    data = write_h5(path)
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, h5py\nf = h5py.File(sys.argv[1], 'r+')\n"
                               "print('open', flush=True)\nsys.stdin.read()", str(path)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "open\n"
        images, labels = open_split(path, "train").take(np.arange(5))
        np.testing.assert_array_equal(images, data["train"][0][:5])
        np.testing.assert_array_equal(labels, data["train"][1][:5])
        summary, bad = verify(str(path))
        assert not [b for b in bad if "lock" in b] and summary
    finally:
        holder.stdin.close()
        holder.wait(timeout=60)
