"""Write the built-in synthetic set (petra_mpi.data.synthetic) as an HDF5 file of the schema.

  python -m petra_mpi.prep.synthetic --out synthetic.h5 [--train 50000 --val 10000 --seed 0]
                                   [--size 32]

The training split is make_synthetic(train, seed), the validation split
make_synthetic(val, seed + 1): the same convention as `data.path: synthetic` in the trainer,
so a packed file and the in-memory set hold the same images.
"""
import argparse
import time

from .common import (ArrayWriter, ChannelStats, PrepError, add_output_options, atomic_h5,
                     check_labels, claim_output, print_summary, run_cli, write_root_attrs)


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m petra_mpi.prep.synthetic", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_output_options(p)
    p.add_argument("--train", type=int, default=50000, help="training images (default 50000)")
    p.add_argument("--val", type=int, default=10000, help="validation images (default 10000)")
    p.add_argument("--seed", type=int, default=0, help="training seed; validation uses seed + 1")
    p.add_argument("--size", type=int, default=32,
                   help="image side (default 32, the trainer's built-in set; smaller sets train "
                        "faster, for quick checks)")
    args = p.parse_args(argv)
    # Imported here, not at the top: petra_mpi.data pulls in torch, which --help does not need.
    from petra_mpi.data.synthetic import NUM_CLASSES, make_synthetic
    if args.train < 1 or args.val < 1:
        raise PrepError("--train and --val must be at least 1")
    if args.size < 8:
        raise PrepError(f"--size must be at least 8, not {args.size}")
    claim_output(args)

    start = time.monotonic()
    stats = ChannelStats()
    with atomic_h5(args.out) as f:
        for split, n, seed in (("train", args.train, args.seed), ("val", args.val, args.seed + 1)):
            images, labels = make_synthetic(n, seed, args.size)
            check_labels(labels, NUM_CLASSES, f"make_synthetic({n}, {seed})")
            writer = ArrayWriter(f, split, images.shape[1], images.shape[2])
            writer.append(images, labels)
            writer.close()
            if split == "train":
                stats.update(images)
        write_root_attrs(f, num_classes=NUM_CLASSES, stats=stats, source="synthetic",
                         seed=args.seed)
    print_summary(args.out, start)


if __name__ == "__main__":
    run_cli(main)
