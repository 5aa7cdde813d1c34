"""Write Fashion-MNIST as a folder of pictures, one folder per class, as a user keeps photos.

  python scripts/fashion_mnist_folder.py [--source /usr/share/datasets/fashion-mnist]
         [--out fashion_mnist_folder] [--train 600] [--val 100]

Reads the IDX release (`apt-get install dataset-fashion-mnist` puts it under --source) and writes
the first --train pictures of each class of its training set to OUT/train/<class>/ and the first
--val of each class of its test set to OUT/val/<class>/, every other one as PNG and the rest as
JPEG (quality 95), 28x28 grayscale as in the release: the input of `python -m
petra_mpi.prep.folder` for the figures of docs/own_data.md.
"""
import argparse
import os
import sys

import numpy as np
from PIL import Image

from petra_mpi.prep.idx import DATASETS, find_files, read_idx


def write_split(images, labels, folder, per_class, names):
    for label, name in enumerate(names):
        where = os.path.join(folder, name.replace("/", "-"))  # "T-shirt/top" is no folder name
        os.makedirs(where, exist_ok=True)
        for n, i in enumerate(np.flatnonzero(labels == label)[:per_class]):
            picture = Image.fromarray(images[i])
            if n % 2:
                picture.save(os.path.join(where, f"{i:05d}.png"))
            else:
                picture.save(os.path.join(where, f"{i:05d}.jpg"), quality=95)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--source", default="/usr/share/datasets/fashion-mnist")
    p.add_argument("--out", default="fashion_mnist_folder")
    p.add_argument("--train", type=int, default=600, help="training pictures per class")
    p.add_argument("--val", type=int, default=100, help="val pictures per class")
    args = p.parse_args(argv)
    files, _ = find_files(args.source)
    names = DATASETS["fashion-mnist"]["classes"]
    for split, per_class in (("train", args.train), ("val", args.val)):
        images = read_idx(files[split, "images"], 3)
        labels = read_idx(files[split, "labels"], 1)
        write_split(images, labels, os.path.join(args.out, split), per_class, names)
    print(f"wrote {10 * (args.train + args.val)} pictures under {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
