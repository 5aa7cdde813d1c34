"""Folders of pictures as users keep them (one folder per class), for the folder packer,
predict and the docs' own-data page, and the checksums that show a command left them alone."""
import hashlib
import os

import numpy as np
from PIL import Image, ImageColor

from tests.support.upstream_formats import SIZES, smooth_image

CLASSES = ("cat", "dog", "fox")


def class_picture(rng, index, count, w, h):
    """A smooth picture tinted by its class's own hue (index of count): learnable in a few
    steps, and JPEG-friendly."""
    tint = np.array(ImageColor.getrgb(f"hsv({360 * index // count}, 90%, 90%)"), np.float64)
    base = np.asarray(smooth_image(rng, w, h), np.float64)
    return Image.fromarray((0.5 * base + 0.5 * tint).astype(np.uint8))


def make_picture_folder(root, classes=CLASSES, per_class=14, seed=0):
    """root/<class>/ holding per_class pictures each, PNGs and JPEGs in turn, of several sizes;
    returns {class: [paths, sorted]}."""
    rng = np.random.default_rng(seed)
    paths = {}
    for c, name in enumerate(classes):
        folder = root / name
        folder.mkdir(parents=True)
        paths[name] = []
        for j in range(per_class):
            path = folder / f"{name}_{j:02d}.{'png' if j % 2 else 'jpg'}"
            class_picture(rng, c, len(classes), *SIZES[(c + j) % len(SIZES)]).save(path)
            paths[name].append(path)
    return paths


def checksums(root):
    """{path: SHA-1 of its bytes} of every file below `root` (links followed, FIFOs and other
    files that are not regular left out): what a command must leave unchanged."""
    sums = {}
    for folder, _, names in os.walk(root):
        for name in names:
            path = os.path.join(folder, name)
            if os.path.isfile(path):
                with open(path, "rb") as f:
                    sums[path] = hashlib.sha1(f.read()).hexdigest()
    return sums
