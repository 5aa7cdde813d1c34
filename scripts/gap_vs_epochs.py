"""PETRA's accuracy gap to backprop against the length of training: one figure and a table.

  python scripts/gap_vs_epochs.py --out FIGURE.png \\
      --pair LABEL PETRA_RUN BACKPROP_RUN [--pair LABEL PETRA_RUN BACKPROP_RUN ...] \\
      [--point LABEL EPOCHS GAP_POINTS ...]

Each --pair is one point of the curve LABEL: the run folders' final test accuracies (their
summary.json), PETRA minus backprop in points, at the epochs PETRA's run trained. The pairs of a
label make its line, in order of epochs. --point adds a point measured elsewhere (the paper's,
say) as a marker of its own. Prints the table (label, epochs, PETRA, backprop, gap) in Markdown.
"""
import argparse
import json
import os
import sys
from collections import defaultdict


def summary(folder):
    path = os.path.join(folder, "summary.json")
    try:
        with open(path) as fh:
            return json.load(fh)
    except (OSError, json.JSONDecodeError) as e:
        raise SystemExit(f"gap_vs_epochs: {path}: not a finished run ({e})")


def gaps(pairs) -> dict:
    """{label: [(epochs, PETRA accuracy, backprop accuracy, gap in points)]}, by epochs."""
    out = defaultdict(list)
    for label, petra_dir, backprop_dir in pairs:
        petra, backprop = summary(petra_dir), summary(backprop_dir)
        if petra["epochs"] != backprop["epochs"]:
            raise SystemExit(f"gap_vs_epochs: {petra_dir} trained {petra['epochs']} epochs, "
                             f"{backprop_dir} {backprop['epochs']}: not a pair")
        out[label].append((petra["epochs"], petra["val_acc"], backprop["val_acc"],
                           100 * (petra["val_acc"] - backprop["val_acc"])))
    return {label: sorted(points) for label, points in out.items()}


def table(curves, points) -> list:
    lines = ["| run | epochs | PETRA | backprop | PETRA − backprop (points) |",
             "|---|---|---|---|---|"]
    for label, rows in curves.items():
        lines += [f"| {label} | {e} | {p:.4f} | {b:.4f} | {g:+.2f} |" for e, p, b, g in rows]
    lines += [f"| {label} | {e:g} | | | {g:+.2f} |" for label, e, g in points]
    return lines


def draw(curves, points, out):
    import matplotlib
    matplotlib.use("Agg")  # files only
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6.4, 4))
    for label, rows in curves.items():
        ax.plot([r[0] for r in rows], [r[3] for r in rows], "o-", label=label)
    for label, epochs, gap in points:
        ax.plot([epochs], [gap], "s", label=label)
    ax.axhline(0, color="grey", linewidth=0.8)
    ax.set_xscale("log")
    ticks = sorted({r[0] for rows in curves.values() for r in rows} | {e for _, e, _ in points})
    ax.set_xticks(ticks, [f"{t:g}" for t in ticks])
    ax.minorticks_off()
    ax.set_xlabel("epochs of training (log scale)")
    ax.set_ylabel("PETRA − backprop, test accuracy (points)")
    ax.legend(fontsize="small")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="the figure (PNG)")
    p.add_argument("--pair", nargs=3, action="append", required=True,
                   metavar=("LABEL", "PETRA_RUN", "BACKPROP_RUN"))
    p.add_argument("--point", nargs=3, action="append", default=[],
                   metavar=("LABEL", "EPOCHS", "GAP_POINTS"))
    args = p.parse_args(argv)
    try:
        points = [(label, float(e), float(g)) for label, e, g in args.point]
    except ValueError:
        p.error("--point LABEL EPOCHS GAP_POINTS: EPOCHS and GAP_POINTS are numbers")
    curves = gaps(args.pair)
    print("\n".join(table(curves, points)))
    draw(curves, points, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
