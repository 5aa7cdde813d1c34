"""Accuracy against the number of stages J on Fashion-MNIST: PETRA against (reversible) backprop.

  python scripts/fashion_mnist_study.py [--stages 2 4 10] [--methods petra backprop]
         [--seeds 0 1] [--out runs/fmnist] [--config configs/fashion_mnist.yaml]
         [--set KEY=VALUE ...] [--report-only]

Trains every (method, J, seed) with the recipe of --config, each run in one process (the local
engine runs the schedule of the MPI engine, so the figures are those of `mpirun -n J`) and in its
own folder OUT/<method>_J<J>_mb<micro-batch>_s<seed>. A finished run (summary.json present) is kept
and an interrupted one resumes from its last checkpoint, so the command can be started again until
it is done. Then it draws each J's learning curves with `python -m petra_mpi.plot` into OUT/J<J>/
and prints a table (also written to OUT/table.md): per J and method the final test accuracy (median
and range over the seeds), minus backprop's median in points, and the minutes per run. Methods:
petra, backprop, and the paper's delayed-gradient baselines delayed_inputs, delayed_params and
delayed_both. Backprop does not depend on J (the engine's backprop follows plain autograd training
of the whole net at every J: invariant 2 of the test suite), so it is trained once per seed, at the
largest J, and is every J's reference; with a reversible net it rebuilds its inputs, i.e. it is
reversible backprop, equal to plain backprop to rounding. Stages are split with
model.balance=estimate (a cost model, not timings), so every run of a J cuts the net alike.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys

from petra_mpi.config import ConfigError, load_config

METHOD_SETTINGS = {
    "petra": ["train.method=petra"],
    "backprop": ["train.method=backprop"],
    "delayed_inputs": ["train.method=delayed", "train.buffer_inputs=true"],
    "delayed_params": ["train.method=delayed", "train.stash_weights=true"],
    "delayed_both": ["train.method=delayed", "train.buffer_inputs=true",
                     "train.stash_weights=true"],
}


def run_dir(args, method, stages, seed):
    """The run's folder, named as `bench race --accuracy` reads it (the micro-batch in the name
    since the same images per update can come in micro-batches of any size)."""
    return os.path.join(args.out, f"{method}_J{stages}_mb{args.batch}_s{seed}")


def runs_of(args):
    """(method, J, seed) of every run: backprop once per seed, at the largest J."""
    for seed in args.seeds:
        for method in sorted(args.methods, key=lambda m: m != "backprop"):  # the reference first
            for stages in ([max(args.stages)] if method == "backprop"
                           else sorted(args.stages, reverse=True)):
                yield method, stages, seed


def trained_at(args, method, stages):
    return max(args.stages) if method == "backprop" else stages


def train(args, method, stages, seed):
    folder = run_dir(args, method, stages, seed)
    if os.path.isfile(os.path.join(folder, "summary.json")):
        print(f"kept: {folder} (finished)", flush=True)
        return
    settings = METHOD_SETTINGS[method] + [
        f"model.stages={stages}", f"run.seed={seed}", f"run.out_dir={folder}",
        "model.balance=estimate"] + args.set
    cmd = [sys.executable, "-m", "petra_mpi.train", args.config]
    for setting in settings:
        cmd += ["--set", setting]
    print("run:", " ".join(cmd), flush=True)
    status = subprocess.run(cmd).returncode
    if status != 0:
        raise SystemExit(f"fashion_mnist_study: {folder} failed with status {status}")


def summary(folder):
    with open(os.path.join(folder, "summary.json")) as fh:
        return json.load(fh)


def report(args):
    """The table (and the per-J figures); returns its lines."""
    acc, minutes = {}, {}
    for method in args.methods:
        for stages in sorted({trained_at(args, method, j) for j in args.stages}):
            runs = [run_dir(args, method, stages, s) for s in args.seeds]
            done = [summary(r) for r in runs if os.path.isfile(os.path.join(r, "summary.json"))]
            if done:
                acc[method, stages] = [s["val_acc"] for s in done]
                minutes[method, stages] = statistics.median(s["wall_time_s"] / 60 for s in done)
    reference = acc.get(("backprop", max(args.stages)))
    lines = ["| J | method | runs | test accuracy, median | range | minus backprop (points) "
             "| minutes per run, median |", "|---|---|---|---|---|---|---|"]
    for (method, stages), values in acc.items():
        median = statistics.median(values)
        gap = ""
        if method != "backprop" and reference:
            gap = f"{100 * (median - statistics.median(reference)):+.2f}"
        lines.append(f"| {'any' if method == 'backprop' else stages} | {method} | "
                     f"{len(values)} | {median:.4f} | "
                     f"{min(values):.4f}–{max(values):.4f} | {gap} | "
                     f"{minutes[method, stages]:.1f} |")
    return lines


def plot(args):
    for stages in args.stages:
        runs, labels = [], []
        for method in args.methods:
            for seed in args.seeds:
                folder = run_dir(args, method, trained_at(args, method, stages), seed)
                if os.path.isfile(os.path.join(folder, "metrics.jsonl")):
                    runs.append(folder)
                    labels.append(f"{method} seed {seed}")
        if runs:
            subprocess.run([sys.executable, "-m", "petra_mpi.plot", *runs, "--out",
                            os.path.join(args.out, f"J{stages}"), "--labels", ",".join(labels)],
                           check=False)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--stages", type=int, nargs="+", default=[2, 4, 10])
    p.add_argument("--methods", nargs="+", choices=sorted(METHOD_SETTINGS),
                   default=["petra", "backprop"])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    p.add_argument("--out", default="runs/fmnist", help="the folder of the runs and figures")
    p.add_argument("--config", default="configs/fashion_mnist.yaml")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="a config override for every run (repeatable), e.g. run.threads=2")
    p.add_argument("--report-only", action="store_true", help="train nothing: figures and table")
    args = p.parse_args(argv)
    try:
        args.batch = load_config(args.config, args.set).data.batch_size
    except (ConfigError, OSError) as e:
        p.error(str(e))
    if not args.report_only:
        for method, stages, seed in runs_of(args):
            train(args, method, stages, seed)
    os.makedirs(args.out, exist_ok=True)
    plot(args)
    lines = report(args)
    print("\n".join(lines))
    with open(os.path.join(args.out, "table.md"), "w") as fh:
        fh.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
