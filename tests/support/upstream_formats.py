"""Data sets in their upstream formats, made small and random: the CIFAR-10/100 tarballs and an
ILSVRC-style JPEG tree, as the packers' tests and the end-to-end tests build them."""
import io
import os
import pickle
import tarfile

import numpy as np
from PIL import Image, ImageFilter


def to_planes(images):
    """(N, S, S, 3) -> the upstream rows (N, 3*S*S): R plane, G plane, B plane."""
    return images.transpose(0, 3, 1, 2).reshape(len(images), -1)


def make_cifar10(folder, n=12, n_test=10, bad_label=False, seed=0):
    """A cifar-10-python.tar.gz like upstream (5 data batches, test_batch, batches.meta), with
    bytes keys as Python 2 pickles load under encoding='bytes'."""
    rng = np.random.default_rng(seed)
    train_x = rng.integers(0, 256, (5 * n, 32, 32, 3), dtype=np.uint8)
    train_y = rng.integers(0, 10, 5 * n)
    val_x = rng.integers(0, 256, (n_test, 32, 32, 3), dtype=np.uint8)
    val_y = rng.integers(0, 10, n_test)
    if bad_label:
        train_y[3 * n + 1] = 10
    names = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]
    members = {}
    for b in range(5):
        sl = slice(b * n, (b + 1) * n)
        members[f"data_batch_{b + 1}"] = {b"batch_label": f"training batch {b + 1} of 5".encode(),
                                          b"labels": train_y[sl].tolist(),
                                          b"data": to_planes(train_x[sl]),
                                          b"filenames": [b"x.png"] * n}
    members["test_batch"] = {b"batch_label": b"testing batch 1 of 1", b"labels": val_y.tolist(),
                             b"data": to_planes(val_x), b"filenames": [b"y.png"] * n_test}
    members["batches.meta"] = {b"label_names": [s.encode() for s in names],
                               b"num_cases_per_batch": n, b"num_vis": 3072}
    path = write_tar(folder, "cifar-10-python.tar.gz", "cifar-10-batches-py", members)
    return path, (train_x, train_y, val_x, val_y, names)


def make_cifar100(folder, n=20, n_test=8, seed=1):
    """A cifar-100-python.tar.gz like upstream (train, test, meta), with str keys."""
    rng = np.random.default_rng(seed)
    fine, coarse = rng.integers(0, 100, n + n_test), rng.integers(0, 20, n + n_test)
    x = rng.integers(0, 256, (n + n_test, 32, 32, 3), dtype=np.uint8)
    members = {
        "train": {"data": to_planes(x[:n]), "fine_labels": fine[:n].tolist(),
                  "coarse_labels": coarse[:n].tolist(), "batch_label": "training batch 1 of 1"},
        "test": {"data": to_planes(x[n:]), "fine_labels": fine[n:].tolist(),
                 "coarse_labels": coarse[n:].tolist(), "batch_label": "testing batch 1 of 1"},
        "meta": {"fine_label_names": [f"fine{i}" for i in range(100)],
                 "coarse_label_names": [f"coarse{i}" for i in range(20)]},
    }
    path = write_tar(folder, "cifar-100-python.tar.gz", "cifar-100-python", members)
    return path, (x, fine, coarse, n)


def write_tar(folder, name, root, members):
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, name)
    with tarfile.open(path, "w:gz") as tar:
        for member, obj in members.items():
            data = pickle.dumps(obj, protocol=2)
            info = tarfile.TarInfo(f"{root}/{member}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


CLASSES = ["n01440764", "n01443537", "n02102040"]
# (width, height) of the originals; several are >= 2x the target size so that the JPEG
# draft (reduced-scale decoding) path is exercised too.
# (20, 28) is upscaled.
SIZES = [(48, 36), (40, 64), (80, 70), (120, 50), (20, 28)]
TARGET = 32


def smooth_image(rng, w, h):
    """A JPEG-friendly picture: colour gradients and a soft-edged rectangle. (Sharp colour
    edges in images this small would be smeared by JPEG's 4:2:0 chroma subsampling.)"""
    yy, xx = np.mgrid[0:h, 0:w] / max(w, h)
    c = rng.uniform(0, 1, (3, 3))
    img = np.stack([c[i, 0] * 255 * xx + c[i, 1] * 255 * yy + 40 * c[i, 2] for i in range(3)], -1)
    x0, y0 = rng.integers(0, w // 2), rng.integers(0, h // 2)
    img[y0:y0 + h // 3, x0:x0 + w // 3] = rng.uniform(0, 255, 3)
    return Image.fromarray(np.clip(img, 0, 255).astype(np.uint8)).filter(ImageFilter.GaussianBlur(2))


def make_imagenet(root, val_folders=False, corrupt=False, seed=0):
    """train/<wnid>/*.JPEG and val/ (flat + labels file, or class folders); returns the
    expected (path, label) lists in the packer's order."""
    rng = np.random.default_rng(seed)
    train, val = [], []
    for c, wnid in enumerate(CLASSES):
        os.makedirs(root / "train" / wnid)
        for j in range(3):
            p = root / "train" / wnid / f"{wnid}_{j}.JPEG"
            smooth_image(rng, *SIZES[(c + j) % len(SIZES)]).save(p, quality=95)
            train.append((p, c))
    if corrupt:  # a truncated JPEG in the last class: the pack fails halfway through
        p = root / "train" / CLASSES[-1] / f"{CLASSES[-1]}_zz.JPEG"
        p.write_bytes(train[0][0].read_bytes()[:300])
    lines = []
    os.makedirs(root / "val")
    for j in range(4):
        c = (j * 2) % 3
        name = f"ILSVRC2012_val_{j + 1:08d}.JPEG"
        folder = root / "val" / CLASSES[c] if val_folders else root / "val"
        folder.mkdir(exist_ok=True)
        smooth_image(rng, *SIZES[j]).save(folder / name, quality=95)
        val.append((folder / name, c))
        lines.append(f"{name} {CLASSES[c]}\n")
    if val_folders:
        val.sort(key=lambda item: (item[1], item[0].name))  # class folders in sorted order
    labels_file = root / "val_labels.txt"
    labels_file.write_text("".join(reversed(lines)))  # matched by name, not by line order
    return train, val, labels_file
