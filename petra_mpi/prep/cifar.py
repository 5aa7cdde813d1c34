"""Pack CIFAR-10 or CIFAR-100 from the official python tarballs.

  python -m petra_mpi.prep.cifar --variant cifar10 --source DIR_OR_TARBALL --out cifar10.h5 [--download]
  python -m petra_mpi.prep.cifar --variant cifar100 --labels fine|coarse --source DIR --out c100.h5

The tarballs hold pickled dicts whose `data` is N x 3072 uint8 (the R, G and B planes of a
32x32 image, one after the other); we store them as (N, 32, 32, 3). The test batch is the
`val` split.
"""
import argparse
import hashlib
import os
import sys
import tarfile
import time
import urllib.error
import urllib.request

import numpy as np

from .common import (ArrayWriter, ChannelStats, PrepError, Progress, add_output_options,
                     atomic_h5, atomic_path, check_labels, claim_output, load_pickle,
                     planes_to_nhwc, print_summary, run_cli, write_root_attrs)

URL_BASE = "https://www.cs.toronto.edu/~kriz/"

# Per variant: archive name, its published MD5, the folder inside it, the pickles per split,
# the meta pickle, and per label kind: (label key, names key, number of classes).
VARIANTS = {
    "cifar10": dict(
        file="cifar-10-python.tar.gz", md5="c58f30108f718f92721af3b95e74349a",
        root="cifar-10-batches-py", meta="batches.meta",
        splits={"train": [f"data_batch_{i}" for i in range(1, 6)], "val": ["test_batch"]},
        labels={"fine": ("labels", "label_names", 10)}),
    "cifar100": dict(
        file="cifar-100-python.tar.gz", md5="eb9058c3a382ffc7106e4002c42a8d85",
        root="cifar-100-python", meta="meta",
        splits={"train": ["train"], "val": ["test"]},
        labels={"fine": ("fine_labels", "fine_label_names", 100),
                "coarse": ("coarse_labels", "coarse_label_names", 20)}),
}

def download(url, dest, md5):
    """Fetch url to dest, checking the MD5 before the file takes its final name."""
    print(f"downloading {url} -> {dest}", file=sys.stderr)
    digest = hashlib.md5()
    try:
        with urllib.request.urlopen(url, timeout=60) as resp, atomic_path(dest) as tmp:
            total = int(resp.headers.get("Content-Length") or 0)
            bar = Progress(total, "download (bytes)")
            with open(tmp, "wb") as out:
                while chunk := resp.read(1 << 20):
                    out.write(chunk)
                    digest.update(chunk)
                    bar.advance(len(chunk))
            bar.close()
            if digest.hexdigest() != md5:
                raise PrepError(f"MD5 mismatch for {url}: got {digest.hexdigest()}, expected {md5}; "
                                "download discarded")
    except (urllib.error.URLError, OSError) as e:
        raise PrepError(f"download of {url} failed: {e}") from None


def file_md5(path):
    digest = hashlib.md5()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def tarball_path(args, spec):
    """--source is the tarball itself or a directory holding it (where --download puts it)."""
    src = args.source
    return src if src.endswith((".tar.gz", ".tgz", ".tar")) else os.path.join(src, spec["file"])


def find_tarball(args, spec):
    """The tarball, downloaded first with --download if it is not there."""
    path = tarball_path(args, spec)
    url = args.url or URL_BASE + spec["file"]
    md5 = args.md5 or spec["md5"]
    if args.download:
        if not os.path.exists(path):
            download(url, path, md5)
        elif file_md5(path) != md5:
            raise PrepError(f"MD5 mismatch for existing {path} (expected {md5}); remove it to re-download")
    if not os.path.isfile(path):
        raise PrepError(f"{path} not found (add --download to fetch it from {url})")
    return path


def read_tarball(path, spec, variant, label_kind):
    """Return {split: (images uint8 (N,32,32,3), labels int64 (N,))} and the class names."""
    label_key, names_key, num_classes = spec["labels"][label_kind]
    wanted = {name for names in spec["splits"].values() for name in names} | {spec["meta"]}
    found = {}
    try:
        with tarfile.open(path, "r:*") as tar:
            bar = Progress(len(wanted), "reading archive members")
            for member in tar:  # one pass: seeking back in a .gz means decompressing again
                name = member.name.removeprefix("./")
                head, _, base = name.rpartition("/")
                if head == spec["root"] and base in wanted and member.isfile():
                    found[base] = load_pickle(tar.extractfile(member), f"{path}:{name}")
                    bar.advance()
            bar.close()
    except (tarfile.TarError, OSError, EOFError) as e:
        raise PrepError(f"{path}: not a readable tar archive ({e})") from None
    missing = sorted(wanted - found.keys())
    if missing:
        raise PrepError(f"{path}: no member {spec['root']}/{missing[0]} (is this the {variant} "
                        "python archive? check --variant)")

    def field(name, key):
        if key not in found[name]:
            raise PrepError(f"{path}: {spec['root']}/{name} has no key '{key}'")
        return found[name][key]

    splits = {}
    for split, names in spec["splits"].items():
        xs, ys = [], []
        for name in names:
            data = np.asarray(field(name, "data"))
            labels = np.asarray(field(name, label_key), dtype=np.int64)
            where = f"{path}:{spec['root']}/{name}"
            if data.dtype != np.uint8 or data.ndim != 2 or data.shape[1] != 3 * 32 * 32:
                raise PrepError(f"{where}: data is {data.dtype}{data.shape}, expected uint8 (N, 3072)")
            if labels.shape != (len(data),):
                raise PrepError(f"{where}: {labels.shape[0]} labels for {len(data)} images")
            check_labels(labels, num_classes, where)
            xs.append(data)
            ys.append(labels)
        splits[split] = (planes_to_nhwc(np.concatenate(xs), 32), np.concatenate(ys))
    names = [str(n.decode() if isinstance(n, bytes) else n) for n in field(spec["meta"], names_key)]
    if len(names) != num_classes:
        raise PrepError(f"{path}: {len(names)} names under '{names_key}', expected {num_classes}")
    return splits, names


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m petra_mpi.prep.cifar", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variant", choices=sorted(VARIANTS), default="cifar10")
    p.add_argument("--source", required=True,
                   help="the official python tarball, or a directory holding (or to receive) it")
    add_output_options(p)
    p.add_argument("--download", action="store_true",
                   help="download the tarball into --source if missing; checks its MD5")
    p.add_argument("--labels", choices=["fine", "coarse"], default="fine",
                   help="CIFAR-100 only: 100 fine classes (default) or 20 coarse superclasses")
    p.add_argument("--url", help=argparse.SUPPRESS)  # tests: a local server instead of the official URL
    p.add_argument("--md5", help=argparse.SUPPRESS)  # tests: the checksum of that local file
    args = p.parse_args(argv)
    if args.labels not in VARIANTS[args.variant]["labels"]:
        p.error(f"--labels {args.labels} exists only for cifar100")

    start = time.monotonic()
    spec = VARIANTS[args.variant]
    claim_output(args, [tarball_path(args, spec)])
    tarball = find_tarball(args, spec)
    splits, names = read_tarball(tarball, spec, args.variant, args.labels)
    stats = ChannelStats().update(splits["train"][0])
    with atomic_h5(args.out) as f:
        for split, (images, labels) in splits.items():
            writer = ArrayWriter(f, split, 32, 32)
            writer.append(images, labels)
            writer.close()
        extra = {"label_kind": args.labels} if args.variant == "cifar100" else {}
        write_root_attrs(f, num_classes=len(names), stats=stats, source=args.variant,
                         classes=names, **extra)
    print_summary(args.out, start)


if __name__ == "__main__":
    run_cli(main)
