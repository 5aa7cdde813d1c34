"""The folder packer (petra_mpi.prep.folder): pictures of every kind Pillow reads, the two
layouts, the stratified val draw, each bad input, shards, and a corrupt JPEG among 1,000."""
import io
import os
import subprocess
import sys

import h5py
import numpy as np
import pytest
from PIL import Image

from tests.support.launch import ended_process, run_packer
from tests.support.paths import ROOT
from tests.support.pictures import CLASSES, checksums, make_picture_folder
from tests.support.verify_files import assert_one_problem
from petra_mpi.prep.folder import class_pictures
from petra_mpi.prep.pictures import encode
from petra_mpi.prep.verify import verify


def packed(path):
    """{split: (images or JPEG bytes list, labels)} and the class names of a packed file."""
    out = {}
    with h5py.File(path, "r") as f:
        for split in ("train", "val"):
            g = f[split]
            if "images" in g:
                images = g["images"][:]
            else:
                o, data = g["offsets"][:], g["jpeg"][:]
                images = [data[o[i]:o[i + 1]].tobytes() for i in range(len(o) - 1)]
            out[split] = (images, g["labels"][:])
        names = [c.decode() for c in f["classes"][:]]
    return out, names


def assert_stops_on(result, out, where, *words):
    """Exit status 2, one last line naming `where` (and `words`), no traceback, nothing at
    `out`, no temporary file beside it."""
    status, _, err = result
    assert status == 2, err
    assert "Traceback" not in err, err
    last = err.strip().splitlines()[-1]
    assert last.startswith("petra_mpi.prep.folder: error: ") and str(where) in last, last
    for word in words:
        assert word in last, last
    assert not os.path.exists(out)
    assert not [n for n in os.listdir(os.path.dirname(out)) if ".tmp-" in n]


# ---------------------------------------------------------------- every kind of picture

def exif_rotated_jpeg(path):
    """An 8x8 JPEG stored on its side, its right half red and its left half blue, whose EXIF
    orientation (8) says to turn it 90 degrees anticlockwise: upright, red is on top."""
    stored = np.zeros((8, 8, 3), np.uint8)
    stored[:, :4] = (0, 0, 255)
    stored[:, 4:] = (255, 0, 0)
    exif = Image.Exif()
    exif[0x0112] = 8
    Image.fromarray(stored).save(path, exif=exif, quality=100, subsampling=0)


def test_every_kind_of_picture_packs_upright_and_rgb(tmp_path):
    src = tmp_path / "src"
    a, b = src / "a", src / "b"
    a.mkdir(parents=True)
    b.mkdir()
    block = np.arange(8 * 8 * 3, dtype=np.uint8).reshape(8, 8, 3)
    Image.fromarray(block).save(a / "rgb.png")
    Image.fromarray(block).save(a / "lossless.webp", lossless=True)
    Image.fromarray(block[..., 0]).save(a / "gray.png")
    Image.fromarray((block[..., 0].astype(np.uint16) * 257)).save(a / "deep.png")  # 16-bit
    rgba = np.dstack([block, np.full((8, 8), 255, np.uint8)])
    rgba[0, 0, 3] = 0  # one transparent pixel: laid on white
    Image.fromarray(rgba).save(a / "alpha.png")
    palette = Image.frombytes("P", (8, 8), (block[..., 0] % 4).tobytes())
    palette.putpalette([255, 0, 0, 0, 255, 0, 0, 0, 255, 9, 9, 9])
    palette.save(b / "palette.gif")
    exif_rotated_jpeg(b / "turned.jpg")
    out = tmp_path / "raw.h5"
    status, _, err = run_packer("folder", "--source", src, "--out", out, "--raw", 8,
                                "--val-fraction", 0.4, "--workers", 1)
    assert status == 0, err
    data, names = packed(out)
    assert names == ["a", "b"]
    got = {}
    for split in ("train", "val"):
        for image, label in zip(*data[split]):
            got.setdefault(int(label), []).append(image)
    pixels = {k: np.stack(v) for k, v in got.items()}
    # class a: rgb, webp, gray (R = G = B), 16-bit (its top byte), alpha (one white pixel)
    expected_a = [block, block, np.repeat(block[..., :1], 3, 2), np.repeat(block[..., :1], 3, 2)]
    with_white = block.copy()
    with_white[0, 0] = 255
    expected_a.append(with_white)
    assert len(pixels[0]) == 5
    for want in expected_a:
        assert any(np.array_equal(have, want) for have in pixels[0]), want[0, :2]
    # class b: the palette's colours; the JPEG turned upright: red rows on top
    colours = np.array([[255, 0, 0], [0, 255, 0], [0, 0, 255], [9, 9, 9]], np.uint8)
    assert any(np.array_equal(have, colours[block[..., 0] % 4]) for have in pixels[1])
    turned = [have for have in pixels[1] if have[..., 1].max() < 60 and have[..., 2].max() > 200]
    assert len(turned) == 1
    top, bottom = turned[0][:3], turned[0][5:]  # rows away from the edge JPEG blurs
    assert (top[..., 0] > 200).all() and (bottom[..., 0] < 60).all(), turned[0][..., 0]
    assert verify(str(out))[1] == []


# ---------------------------------------------------------------- layouts and the val draw

def test_train_val_layout_hidden_names_and_jpeg_variant(tmp_path):
    src = tmp_path / "src"
    train = make_picture_folder(src / "train", per_class=4)
    val = make_picture_folder(src / "val", classes=CLASSES[:2], per_class=2, seed=1)
    (src / "train" / "cat" / ".DS_Store").write_bytes(b"\0junk")
    (src / "train" / ".cache").mkdir()
    (src / "train" / ".cache" / "x.txt").write_text("ignored")
    (src / "val" / "dog" / ".hidden.jpg").write_bytes(b"not even a picture")
    out = tmp_path / "set.h5"
    status, _, err = run_packer("folder", "--source", src, "--out", out, "--size", 24,
                                "--workers", 2)
    assert status == 0, err
    data, names = packed(out)
    assert names == list(CLASSES)
    assert data["train"][1].tolist() == [c for c in range(3) for _ in range(4)]
    assert data["val"][1].tolist() == [0, 0, 1, 1]
    files = [p for c in CLASSES for p in train[c]] + [p for c in CLASSES[:2] for p in val[c]]
    stored = data["train"][0] + data["val"][0]
    assert stored == [encode(str(p), 24)[0] for p in files]  # in order, as encode stores them
    with h5py.File(out, "r") as f:
        assert int(f.attrs["image_size"]) == 24 and f.attrs["source"] == "folder"
    assert verify(str(out))[1] == []


def test_val_fraction_is_stratified_and_seeded(tmp_path):
    src = tmp_path / "src"
    make_picture_folder(src, per_class=10)
    for name, extra in (("dog", 10), ("fox", 20)):  # 10, 20 and 30 pictures
        more = make_picture_folder(tmp_path / f"more_{name}", classes=(name,), per_class=extra,
                                   seed=2)
        for i, path in enumerate(more[name]):
            path.rename(src / name / f"more_{i:02d}{path.suffix}")

    def val_of(seed, out):
        status, _, err = run_packer("folder", "--source", src, "--out", out, "--raw", 8,
                                    "--val-fraction", 0.2, "--seed", seed, "--workers", 1)
        assert status == 0, err
        data, _ = packed(out)
        assert np.bincount(data["val"][1]).tolist() == [2, 4, 6]  # 20 % of each class
        assert np.bincount(data["train"][1]).tolist() == [8, 16, 24]
        return data["val"][0]
    first, again = val_of(0, tmp_path / "a.h5"), val_of(0, tmp_path / "b.h5")
    assert np.array_equal(first, again)
    assert not np.array_equal(first, val_of(1, tmp_path / "c.h5"))


# ---------------------------------------------------------------- bad input

def good_folder(tmp_path):
    src = tmp_path / "src"
    make_picture_folder(src / "train", per_class=3)
    make_picture_folder(src / "val", per_class=2, seed=1)
    return src


def unreadable(src):
    path = src / "train" / "dog" / "garbage.jpg"
    path.write_bytes(b"these bytes are no picture at all" * 10)
    return path


def truncated(src):
    path = src / "train" / "fox" / "cut.jpg"
    path.write_bytes((src / "train" / "fox" / "fox_00.jpg").read_bytes()[:200])
    return path


def empty_class(src):
    path = src / "train" / "emu"
    path.mkdir()
    return path


def class_only_in_val(src):
    path = src / "val" / "gnu"
    make_picture_folder(src / "val", classes=("gnu",), per_class=2, seed=3)
    return path


def not_a_picture(src):
    path = src / "train" / "cat" / "notes.txt"
    path.write_text("a note beside the photos")
    return path


def beside_the_classes(src):
    path = src / "train" / "labels.csv"
    path.write_text("cat,dog\n")
    return path


BAD = {"unreadable": (unreadable, "cannot decode image"),
       "truncated": (truncated, "cannot decode image"),
       "empty class": (empty_class, "empty class folder"),
       "class only in val": (class_only_in_val, "class only in val"),
       "not a picture": (not_a_picture, "not a picture"),
       "beside the classes": (beside_the_classes, "a file beside the class folders")}


@pytest.mark.parametrize("case", BAD)
def test_bad_input_stops_with_one_line_or_is_skipped(tmp_path, case):
    make_bad, why = BAD[case]
    src = good_folder(tmp_path)
    where = make_bad(src)
    out = tmp_path / "out.h5"
    args = ("--source", src, "--out", out, "--size", 16, "--workers", 2)
    assert_stops_on(run_packer("folder", *args), str(out), where, why, "--skip-bad")
    status, stdout, err = run_packer("folder", *args, "--skip-bad")
    assert status == 0, err
    skipped = [line for line in err.splitlines() if line.startswith("skipped ")]
    assert len(skipped) == 1 and skipped[0].startswith(f"skipped {where}: {why}"), skipped
    assert "skipped 1 input(s)" in stdout
    data, names = packed(out)
    assert (len(data["train"][1]), len(data["val"][1])) == (9, 6)  # all the good pictures
    assert names == list(CLASSES)


def corrupt_middle(tmp_path, count=1000):
    """A folder of `count` tiny pictures (two classes, train/ and val/) with, in the middle, a
    JPEG cut short and followed by garbage: the path of that one."""
    src = tmp_path / "src"
    rng = np.random.default_rng(0)
    for i in range(count):
        split, name = ("val" if i % 10 == 9 else "train"), ("a" if i % 2 else "b")
        (src / split / name).mkdir(parents=True, exist_ok=True)
        pixels = np.full((12, 10, 3), rng.integers(0, 256, 3), np.uint8)
        Image.fromarray(pixels).save(src / split / name / f"{i:04d}.{'png' if i % 3 else 'jpg'}")
    bad = src / "train" / "a" / "0501.jpg"
    data = bad.read_bytes()
    bad.write_bytes(data[:len(data) * 3 // 5] + bytes(range(40)))  # cut, and garbage after
    return src, bad


def test_a_corrupt_jpeg_among_1000_stops_cleanly_and_fast(tmp_path):
    """Through the real command with a pool of 2 and a timeout: it neither hangs nor leaves
    a file that looks valid; --skip-bad packs the 999 others."""
    src, bad = corrupt_middle(tmp_path)
    out = tmp_path / "out.h5"
    cmd = [sys.executable, "-m", "petra_mpi.prep.folder", "--source", str(src), "--out", str(out),
           "--size", 16, "--workers", 2]
    proc = subprocess.run(list(map(str, cmd)), cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert_stops_on((proc.returncode, proc.stdout, proc.stderr), str(out), bad, "cannot decode")
    proc = subprocess.run(list(map(str, cmd + ["--skip-bad"])), cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert f"skipped {bad}: cannot decode image" in proc.stderr
    data, _ = packed(out)
    assert (len(data["train"][1]), len(data["val"][1])) == (899, 100)
    assert verify(str(out))[1] == []


def test_a_folder_that_is_not_there_or_has_no_classes(tmp_path):
    out = tmp_path / "out.h5"
    assert_stops_on(run_packer("folder", "--source", tmp_path / "nowhere", "--out", out),
                    str(out), tmp_path / "nowhere", "not a folder")
    (tmp_path / "src" / "val").mkdir(parents=True)
    assert_stops_on(run_packer("folder", "--source", tmp_path / "src", "--out", out), str(out),
                    tmp_path / "src" / "val", "train")


# ---------------------------------------------------------------- files from elsewhere

def test_an_output_onto_an_input_a_folder_or_an_existing_file_is_refused_at_once(tmp_path):
    """Each refusal comes before any picture is read (the truncated one would stop the packer
    first otherwise) and leaves every input as it was; --force replaces an existing output, and
    a temporary file that a killed packer left beside it is removed with a line."""
    src = good_folder(tmp_path)
    truncated(src)
    (tmp_path / "a_folder").mkdir()
    existing = tmp_path / "old.h5"
    existing.write_bytes(b"an older file")
    before = checksums(tmp_path)
    args = ("--source", src, "--size", 16, "--workers", 1)
    picture = src / "train" / "cat" / "cat_00.jpg"
    for out, why in ((picture, "lies inside the input folder"),
                     (src / "packed.h5", "lies inside the input folder"),
                     (tmp_path / "a_folder", "is a folder"),
                     (existing, "exists: --force replaces it")):
        status, _, err = run_packer("folder", *args, "--out", out)
        assert status == 2 and len(err.splitlines()) == 1 and why in err, err
        assert checksums(tmp_path) == before
    stale = tmp_path / f"old.h5.tmp-{ended_process()}"
    stale.write_bytes(b"partial")
    status, _, err = run_packer("folder", *args, "--out", existing, "--force", "--skip-bad")
    assert status == 0 and f"removed {stale}, left by an earlier run that was killed" in err
    assert packed(existing)[1] == list(CLASSES) and not stale.exists()


def test_links_are_followed_and_a_loop_is_said(tmp_path):
    """A subfolder that is a link to pictures elsewhere is packed with its class; a link back to
    a folder above is not followed, and said."""
    src = good_folder(tmp_path)
    elsewhere = make_picture_folder(tmp_path / "elsewhere", classes=("more",), per_class=2)
    (src / "train" / "cat" / "more").symlink_to(tmp_path / "elsewhere" / "more")
    loop = src / "train" / "dog" / "loop"
    loop.symlink_to(src / "train" / "dog")
    before = {**checksums(src), **checksums(tmp_path / "elsewhere")}
    out = tmp_path / "out.h5"
    args = ("--source", src, "--out", out, "--size", 16, "--workers", 1)
    assert_stops_on(run_packer("folder", *args), str(out), loop, "a link to a folder above it",
                    "(a loop)")
    status, _, err = run_packer("folder", *args, "--skip-bad")
    assert status == 0 and f"skipped {loop}: a link to a folder above it" in err, err
    data, _ = packed(out)
    assert data["train"][1].tolist() == [0] * 5 + [1] * 3 + [2] * 3  # cat: 3 + the 2 linked
    assert encode(str(elsewhere["more"][1]), 16)[0] in data["train"][0]
    assert {**checksums(src), **checksums(tmp_path / "elsewhere")} == before


def test_a_fifo_named_as_a_picture_is_not_read(tmp_path):
    """Opening a FIFO would block the packer forever: only regular files are pictures."""
    src = good_folder(tmp_path)
    fifo = src / "train" / "fox" / "x.jpg"
    os.mkfifo(fifo)
    problems = []
    pictures = class_pictures(str(src / "train" / "fox"), problems)
    assert str(fifo) not in pictures and len(pictures) == 3
    assert problems == [(str(fifo), "not a regular file (a FIFO, socket, device or broken link)")]


def test_names_that_are_not_utf8_or_hold_a_newline_stay_on_one_line(tmp_path):
    """A class folder whose name cannot name a class (not UTF-8, a newline) is bad input, said
    on one line with its bytes escaped; a picture's own name may be anything."""
    src = good_folder(tmp_path)
    for name in (b"caf\xe9", b"two\nlines"):
        folder = os.path.join(bytes(src / "train"), name)
        os.mkdir(folder)
        Image.new("RGB", (20, 20)).save(os.path.join(folder, b"a.png"))
    Image.new("RGB", (20, 20)).save(os.path.join(bytes(src / "train" / "cat"), b"new\nline\xff.png"))
    out = tmp_path / "out.h5"
    args = ("--source", src, "--out", out, "--size", 16, "--workers", 1)
    status, _, err = run_packer("folder", *args)
    assert status == 2 and "Traceback" not in err, err
    assert err.splitlines() == [
        f"bad input: {src}/train/two\\nlines: a class folder whose name is not printable UTF-8 "
        f"text (rename it)",
        f"petra_mpi.prep.folder: error: {src}/train/caf\\xe9: a class folder whose name is not "
        f"printable UTF-8 text (rename it); 1 more listed above; --skip-bad packs the rest"]
    status, _, err = run_packer("folder", *args, "--skip-bad")
    assert status == 0 and f"skipped {src}/train/caf\\xe9: a class folder" in err, err
    data, names = packed(out)
    assert names == list(CLASSES) and len(data["train"][1]) == 10  # the newline picture in


def test_a_picture_above_the_pixel_limit_is_not_decoded(tmp_path):
    """--max-pixels counts the pixels a picture decodes to: a JPEG's at its reduced scale."""
    src = good_folder(tmp_path)
    Image.new("RGB", (100, 100)).save(src / "train" / "dog" / "large.png")
    Image.new("RGB", (400, 400)).save(src / "train" / "dog" / "photo.jpg")  # decoded at 50 x 50
    out = tmp_path / "out.h5"
    args = ("--source", src, "--out", out, "--size", 16, "--max-pixels", 7000, "--workers", 1)
    assert_stops_on(run_packer("folder", *args), str(out), src / "train" / "dog" / "large.png",
                    "cannot decode image (TooManyPixels: 100 x 100 pixels, more than the limit of "
                    "7,000)")
    status, _, err = run_packer("folder", *args, "--skip-bad")
    assert status == 0 and f"skipped {src}/train/dog/large.png: cannot decode image (TooMany" in err
    assert len(packed(out)[0]["train"][1]) == 10  # photo.jpg in, large.png out


def test_a_class_whose_val_pictures_all_fail_is_named(tmp_path):
    src = good_folder(tmp_path)
    for path in (src / "val" / "fox").iterdir():
        path.write_bytes(b"not a picture any more")
    out = tmp_path / "out.h5"
    status, _, err = run_packer("folder", "--source", src, "--out", out, "--size", 16,
                                "--workers", 1, "--skip-bad")
    assert status == 0, err
    assert "note: the val split holds no picture of class fox (none of its 2 decoded)" in err
    assert packed(out)[0]["val"][1].tolist() == [0, 0, 1, 1]


# ---------------------------------------------------------------- shards

def test_shards_merge_to_the_single_pass_pack_also_with_skipped_pictures(tmp_path):
    src = good_folder(tmp_path)
    truncated(src)
    common = ("--source", src, "--size", 16, "--workers", 1, "--skip-bad")
    single = tmp_path / "single.h5"
    assert run_packer("folder", *common, "--out", single)[0] == 0
    shards = [tmp_path / f"part{i}.h5" for i in range(2)]
    for i, shard in enumerate(shards):
        assert run_packer("folder", *common, "--out", shard, "--shard", f"{i}/2")[0] == 0
    merged = tmp_path / "merged.h5"
    status, _, err = run_packer("folder", "merge", "--out", merged, "--copy", *shards[::-1])
    assert status == 0, err
    (joined, names), (one_pass, same_names) = packed(merged), packed(single)
    assert names == same_names
    for split in ("train", "val"):
        assert joined[split][0] == one_pass[split][0]  # the JPEGs, in order
        assert joined[split][1].tolist() == one_pass[split][1].tolist()
    assert len(one_pass["train"][1]) == 9  # the truncated picture left out
    with h5py.File(merged, "r") as a, h5py.File(single, "r") as b:
        for key in ("mean", "std", "num_classes", "image_size", "source"):
            assert np.array_equal(a.attrs[key], b.attrs[key]), key
    status, _, err = run_packer("folder", "--source", src, "--out", tmp_path / "x.h5",
                                "--raw", 8, "--shard", "0/2")
    assert status == 2 and "--shard packs the JPEG variant" in err
    # the output among the shards (a virtual file that would read itself), an existing output
    before = checksums(tmp_path)
    for out, why in ((shards[0], "is an input of this command"),
                     (merged, "exists: --force replaces it")):
        status, _, err = run_packer("folder", "merge", "--out", out, *shards)
        assert status == 2 and len(err.splitlines()) == 1 and why in err, err
        assert checksums(tmp_path) == before
    status, _, err = run_packer("folder", "merge", "--out", merged, "--force", *shards)
    assert status == 0 and packed(merged)[0]["val"][1].tolist() == one_pass["val"][1].tolist()


def test_a_picture_resized_as_imagenet_packs_it(tmp_path):
    """The picture path is shared: a JPEG of the folder packer equals encode's, the one the
    imagenet packer and predict use (no copy of the decoding that could drift)."""
    path = tmp_path / "p.png"
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (30, 50, 3), np.uint8)).save(path)
    data, stats, err = encode(str(path), 20)
    assert err is None and Image.open(io.BytesIO(data)).size == (33, 20)
    pixels, _, _ = encode(str(path), 20, raw=True)
    assert pixels.shape == (20, 20, 3) and stats.count == 33 * 20


def test_verify_knows_a_folder_file_and_its_class_names(tmp_path):
    src = good_folder(tmp_path)
    good = tmp_path / "good.h5"
    assert run_packer("folder", "--source", src, "--out", good, "--size", 16)[0] == 0
    assert verify(str(good))[1] == []

    def rename_a_class_as_another(f):
        names = [c.decode() for c in f["classes"][:]]
        del f["classes"]
        f.create_dataset("classes", data=names[:1] + names[:-1], dtype=h5py.string_dtype())
    assert_one_problem(good, tmp_path, rename_a_class_as_another, ["/classes", "twice", "cat"])
