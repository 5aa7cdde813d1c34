"""PNG figures from run directories: `python -m petra_mpi.plot RUN_DIR [RUN_DIR ...]`.

Reads each RUN_DIR/metrics.jsonl (and RUN_DIR/summary.json when there) and writes, into --out
(default: the first RUN_DIR):
  loss.png, accuracy.png, lr.png, throughput.png      several runs overlaid, one legend entry each
  grad_cosine.png, grad_norm_ratio.png,               when the runs logged "diag" events (paper
  grad_by_stage.png, rebuild_error.png                App. B, Fig. 5 and 6); one row per run
  timeline.png                                        when RUN_DIR/trace.json exists (run.trace):
                                                      one row per rank, spans coloured by kind
A RUN_DIR may also be a trace JSON file itself (e.g. from `bench pipeline --trace FILE`).

Reading is forgiving on purpose: a run killed mid-write leaves a truncated last line, older or
newer trainers add events and keys, and non-finite numbers are logged as strings ("nan"). All of
that is skipped rather than fatal, so the figures of a crashed run can still be looked at.
Epochs are shown 1-indexed ("epoch 1" = the first pass), as the trainer prints them.

matplotlib is optional (extra `plot`); only `main` and the draw functions import it.
"""
import argparse
import json
import math
import os
import sys
from collections import defaultdict
from dataclasses import dataclass, field
from typing import NamedTuple

DIAG_PAIRS = ("petra_delayed", "petra_e2e", "delayed_e2e")
# Display names of the three gradient comparisons (PETRA, standard delayed, end-to-end).
PAIR_NAMES = {"petra_delayed": "PETRA vs delayed", "petra_e2e": "PETRA vs end-to-end",
              "delayed_e2e": "delayed vs end-to-end"}


class Curve(NamedTuple):
    run: int      # index of the run, which picks its colour
    label: str    # legend entry
    x: list
    y: list
    style: str    # matplotlib line style: train solid, val dashed, ...


class PlotError(Exception):
    """A reason to stop with exit status 2 (bad input, matplotlib missing)."""


@dataclass
class Run:
    path: str
    label: str
    start: dict = field(default_factory=dict)
    train: list = field(default_factory=list)
    eval: list = field(default_factory=list)
    diag: list = field(default_factory=list)


def num(value):
    """A finite float, or None: the trainer writes nan/inf as strings, and null happens too."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    value = float(value)
    return value if math.isfinite(value) else None


def read_records(path: str) -> list:
    """The JSON objects of a .jsonl file; lines that do not parse (a killed run's last line) or
    that are not objects are skipped."""
    records = []
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if isinstance(record, dict):
                records.append(record)
    return records


def load_run(run_dir: str, label: str | None = None) -> Run:
    """Parse one run directory; PlotError when it has no metrics.jsonl or nothing to plot."""
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.isfile(path):
        raise PlotError(f"{run_dir}: no metrics.jsonl")
    run = Run(path=run_dir, label=label or "")
    for record in read_records(path):
        kind = record.get("event")
        if kind == "start" and not run.start:  # a resumed run appends more starts; keep the first
            run.start = record
        elif kind in ("train", "eval", "diag"):
            getattr(run, kind).append(record)
    if not (run.train or run.eval or run.diag):
        raise PlotError(f"{run_dir}: no usable lines in metrics.jsonl")
    if not run.label:
        run.label = default_label(run)
    return run


def default_label(run: Run) -> str:
    """'method/arch' from the start line (or summary.json), else the directory's name."""
    info = run.start
    if not info.get("method"):
        try:
            with open(os.path.join(run.path, "summary.json"), encoding="utf-8") as f:
                info = json.load(f)
        except (OSError, ValueError):
            info = {}
        info = info if isinstance(info, dict) else {}
    parts = [str(info[k]) for k in ("method", "arch") if info.get(k)]
    return "/".join(parts) or os.path.basename(os.path.normpath(run.path))


def load_runs(run_dirs: list, labels: list | None = None) -> list:
    if labels is not None and len(labels) != len(run_dirs):
        raise PlotError(f"--labels has {len(labels)} names for {len(run_dirs)} run dirs")
    runs = [load_run(d, labels[i] if labels else None) for i, d in enumerate(run_dirs)]
    # Two runs of the same method/arch would get the same legend entry: add the directory name.
    names = [r.label for r in runs]
    for r in runs:
        if not labels and names.count(r.label) > 1:
            r.label = f"{r.label} ({os.path.basename(os.path.normpath(r.path))})"
    return runs


def xy(records: list, xkey: str, ykey: str, x_offset: float = 0) -> tuple:
    """(xs, ys) of the records with both values finite, sorted by x. A resumed run logs some
    steps twice (it restarts from the last checkpoint); the later line wins, as it is the one
    the run continued from."""
    points = {}
    for r in records:
        x, y = num(r.get(xkey)), num(r.get(ykey))
        if x is not None and y is not None:
            points[x + x_offset] = y
    xs = sorted(points)
    return xs, [points[x] for x in xs]


def epoch_means(records: list, key: str) -> tuple:
    """(epochs, means): the mean of `key` over each epoch's records, epochs 1-indexed. The
    training lines are windowed means over equal numbers of steps (except an epoch's last), so
    their plain mean is close to the epoch's mean."""
    sums = defaultdict(lambda: [0.0, 0])
    for r in records:
        e, v = num(r.get("epoch")), num(r.get(key))
        if e is not None and v is not None:
            sums[int(e) + 1][0] += v  # epochs are whole numbers; int keeps titles "epoch 3"
            sums[int(e) + 1][1] += 1
    epochs = sorted(sums)
    return epochs, [sums[e][0] / sums[e][1] for e in epochs]


def step_means(records: list, key: str) -> tuple:
    """(steps, means of key per step): diagnostics may log several measurements under one step
    (e.g. written at an epoch's end), so they are averaged rather than one kept."""
    sums = defaultdict(list)
    for r in records:
        x, v = num(r.get("step")), num(r.get(key))
        if x is not None and v is not None:
            sums[x].append(v)
    steps = sorted(sums)
    return steps, [sum(sums[x]) / len(sums[x]) for x in steps]


def diag_by_stage(records: list, key: str) -> dict:
    """{stage: (epochs, epoch means of key)}: Fig. 5's points, one curve per stage."""
    per_stage = defaultdict(list)
    for r in records:
        s = num(r.get("stage"))
        if s is not None:
            per_stage[int(s)].append(r)
    curves = {s: epoch_means(rs, key) for s, rs in sorted(per_stage.items())}
    return {s: c for s, c in curves.items() if c[0]}


def num_stages(run: Run) -> int:
    stages = num(run.start.get("stages"))
    seen = [int(s) for s in (num(r.get("stage")) for r in run.diag) if s is not None]
    return max(int(stages or 0), max(seen, default=-1) + 1, 1)


def stage_epochs(run: Run, count: int = 3) -> list:
    """The epochs shown in Fig. 6 style: first, middle and last epoch with diagnostics."""
    epochs = sorted({int(e) + 1 for e in (num(r.get("epoch")) for r in run.diag)
                     if e is not None})
    if len(epochs) <= count:
        return epochs
    picks = [epochs[round(i * (len(epochs) - 1) / (count - 1))] for i in range(count)]
    return sorted(set(picks))


def by_stage_at_epoch(run: Run, epoch: int, key: str) -> tuple:
    """(stages, means of key over that epoch's diagnostics) for one (1-indexed) epoch."""
    chosen = [r for r in run.diag if num(r.get("epoch")) is not None
              and int(num(r.get("epoch"))) + 1 == epoch]
    sums = defaultdict(list)
    for r in chosen:
        s, v = num(r.get("stage")), num(r.get(key))
        if s is not None and v is not None:
            sums[int(s)].append(v)
    stages = sorted(sums)
    return stages, [sum(sums[s]) / len(sums[s]) for s in stages]


def series(runs: list) -> dict:
    """The curves of the four overlay figures: {figure: [Curve, ...]}, one per run and quantity
    that has data. Kept free of matplotlib so tests can check
    what would be drawn."""
    out = {"loss": [], "accuracy": [], "lr": [], "throughput": []}
    for index, run in enumerate(runs):
        train_loss = xy(run.train, "step", "loss")
        val_loss = xy(run.eval, "step", "val_loss")
        val_acc = xy(run.eval, "epoch", "val_acc", x_offset=1)
        train_acc = epoch_means(run.train, "acc")
        candidates = [("loss", f"{run.label} train", train_loss, "-"),
                      ("loss", f"{run.label} val", val_loss, "--"),
                      ("accuracy", f"{run.label} val top-1", val_acc, "-"),
                      ("accuracy", f"{run.label} train", train_acc, ":"),
                      ("lr", run.label, xy(run.train, "step", "lr"), "-"),
                      ("throughput", run.label, xy(run.train, "step", "images_per_s"), "-")]
        for figure, label, (xs, ys), style in candidates:
            if xs:
                out[figure].append(Curve(index, label, xs, ys, style))
    return out


# ---- drawing (matplotlib only from here on) ----

def import_pyplot():
    try:
        import matplotlib
    except ImportError:
        raise PlotError("matplotlib is not installed: pip install 'petra_mpi[plot]'") from None
    matplotlib.use("Agg")  # files only: no display needed (clusters, CI)
    import matplotlib.pyplot as plt
    return plt


AXES = {"loss": ("step", "loss", "Loss (solid: train, dashed: val)"),
        "accuracy": ("epoch", "accuracy", "Accuracy (solid: val top-1, dotted: train)"),
        "lr": ("step", "learning rate", "Learning rate"),
        "throughput": ("step", "images/s", "Training throughput")}


def draw_overlays(plt, runs: list, out_dir: str) -> list:
    written = []
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for figure, curves in series(runs).items():
        if not curves:
            print(f"note: no data for {figure}.png, skipped", file=sys.stderr)
            continue
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for c in curves:
            # One colour per run, so a run's train and val curves read as a pair.
            ax.plot(c.x, c.y, c.style, color=colours[c.run % len(colours)], label=c.label,
                    marker="o" if len(c.x) < 30 else None, markersize=3)
        xlabel, ylabel, title = AXES[figure]
        ax.set(xlabel=xlabel, ylabel=ylabel, title=title)
        integer_ticks(ax)
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
        written.append(save(fig, plt, out_dir, f"{figure}.png"))
    return written


def integer_ticks(ax):
    """Steps, epochs and stages are whole numbers; no '2.5' ticks on short runs."""
    from matplotlib.ticker import MaxNLocator
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))


def save(fig, plt, out_dir: str, name: str) -> str:
    path = os.path.join(out_dir, name)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def stage_colours(plt, stages: int):
    """Colour = stage index (paper Fig. 5), with a colorbar to read it back."""
    import matplotlib as mpl
    norm = mpl.colors.Normalize(vmin=0, vmax=max(1, stages - 1))
    mappable = mpl.cm.ScalarMappable(norm=norm, cmap="viridis")
    return mappable.to_rgba, mappable


def draw_fig5(plt, runs: list, out_dir: str, metric: str) -> str:
    """grad_cosine.png / grad_norm_ratio.png: per run, (a) PETRA vs delayed, (b) PETRA vs
    end-to-end (solid) and delayed vs end-to-end (dashed); points are epoch means per stage."""
    title = "cosine similarity" if metric == "cos" else "norm ratio"
    fig, axes = plt.subplots(len(runs), 2, figsize=(11, 4 * len(runs)), squeeze=False)
    for row, run in zip(axes, runs):
        colour, mappable = stage_colours(plt, num_stages(run))
        panels = [(row[0], [("petra_delayed", "-")], "PETRA vs delayed"),
                  (row[1], [("petra_e2e", "-"), ("delayed_e2e", "--")],
                   "vs end-to-end (solid: PETRA, dashed: delayed)")]
        for ax, pairs, subtitle in panels:
            for pair, style in pairs:
                for stage, (xs, ys) in diag_by_stage(run.diag, f"{metric}_{pair}").items():
                    ax.plot(xs, ys, style, color=colour(stage), marker="o" if len(xs) < 30
                            else None, markersize=3)
            if metric == "norm":
                ax.axhline(1.0, color="grey", lw=0.8)  # equal norms
            ax.set(xlabel="epoch", ylabel=title, title=f"{run.label}: {subtitle}")
            integer_ticks(ax)
            ax.grid(alpha=0.3)
            fig.colorbar(mappable, ax=ax, label="stage")
    name = "grad_cosine.png" if metric == "cos" else "grad_norm_ratio.png"
    return save(fig, plt, out_dir, name)


def draw_fig6(plt, runs: list, out_dir: str) -> str:
    """grad_by_stage.png: the three cosine similarities against stage index, one panel per
    chosen epoch (first, middle, last with diagnostics), one row per run."""
    picks = [stage_epochs(run) for run in runs]
    cols = max(1, max(len(p) for p in picks))  # diag lines without epochs: one empty panel
    fig, axes = plt.subplots(len(runs), cols, figsize=(4.5 * cols, 3.8 * len(runs)),
                             squeeze=False)
    styles = {"petra_delayed": "-o", "petra_e2e": "-s", "delayed_e2e": "--^"}
    for row, run, epochs in zip(axes, runs, picks):
        for ax in row[len(epochs):]:
            ax.axis("off")
        for ax, epoch in zip(row, epochs):
            for pair in DIAG_PAIRS:
                xs, ys = by_stage_at_epoch(run, epoch, f"cos_{pair}")
                if xs:
                    ax.plot(xs, ys, styles[pair], label=PAIR_NAMES[pair], markersize=4)
            ax.set(xlabel="stage", ylabel="cosine similarity", title=f"{run.label}: epoch {epoch}")
            integer_ticks(ax)
            ax.grid(alpha=0.3)
            ax.legend(fontsize="small")
    return save(fig, plt, out_dir, "grad_by_stage.png")


def draw_rebuild(plt, runs: list, out_dir: str) -> str | None:
    """rebuild_error.png: relative error of the reversible stages' input reconstruction, per
    stage against step (null for stages without reversible blocks, which are left out)."""
    fig, axes = plt.subplots(len(runs), 1, figsize=(7, 4 * len(runs)), squeeze=False)
    drawn, positive = False, True
    for (ax,), run in zip(axes, runs):
        colour, mappable = stage_colours(plt, num_stages(run))
        per_stage = defaultdict(list)
        for r in run.diag:
            s = num(r.get("stage"))
            if s is not None:
                per_stage[int(s)].append(r)
        for stage, records in sorted(per_stage.items()):
            xs, ys = step_means(records, "rebuild_error")
            if xs:
                drawn = True
                positive = positive and min(ys) > 0
                ax.plot(xs, ys, color=colour(stage), marker="o" if len(xs) < 30 else None,
                        markersize=3)
        ax.set(xlabel="step", ylabel="relative rebuild error", title=run.label)
        ax.grid(alpha=0.3)
        fig.colorbar(mappable, ax=ax, label="stage")
    if not drawn:
        plt.close(fig)
        print("note: no rebuild_error values, rebuild_error.png skipped", file=sys.stderr)
        return None
    if positive:  # errors span orders of magnitude; a log axis cannot show exact zeros
        for (ax,) in axes:
            ax.set_yscale("log")
    return save(fig, plt, out_dir, "rebuild_error.png")


def plot_runs(runs: list, out_dir: str) -> list:
    """Draw every figure that has data; returns the paths written."""
    plt = import_pyplot()
    os.makedirs(out_dir, exist_ok=True)
    written = draw_overlays(plt, runs, out_dir)
    with_diag = [r for r in runs if r.diag]
    if with_diag:
        written.append(draw_fig5(plt, with_diag, out_dir, "cos"))
        written.append(draw_fig5(plt, with_diag, out_dir, "norm"))
        written.append(draw_fig6(plt, with_diag, out_dir))
        rebuild = draw_rebuild(plt, with_diag, out_dir)
        if rebuild:
            written.append(rebuild)
    return written


# ---- timeline (trace.json, see petra_mpi/core/trace.py) ----

# Colours of the measured kinds; plan ticks are drawn as a grey strip above each row.
TIMELINE_KINDS = {"forward": "tab:blue", "backward": "tab:orange", "step": "tab:green",
                  "loss": "tab:red", "log": "tab:pink", "wait": "tab:gray",
                  "checkpoint": "tab:brown", "eval": "#d8e8f0"}


def load_trace(path: str) -> list:
    """The complete ("X") events of a Chrome-trace file: a {"traceEvents": [...]} object or a
    bare list (both are valid Trace Event Format)."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError) as e:
        raise PlotError(f"{path}: not a readable trace ({e})") from None
    events = data.get("traceEvents", []) if isinstance(data, dict) else data
    spans = [e for e in events if isinstance(e, dict) and e.get("ph") == "X"
             and num(e.get("ts")) is not None and num(e.get("dur")) is not None]
    if not spans:
        raise PlotError(f"{path}: no spans in the trace")
    return spans


def timeline_rows(spans: list, window: float = 5.0, start: float | None = None):
    """{pid: {kind: [(start_s, duration_s), ...]}} of the spans that overlap the window, and the
    window (t0, t1) in seconds. By default the window opens at the first forward (after start-up)
    and lasts `window` seconds; window <= 0 shows the whole trace."""
    first = min(e["ts"] for e in spans) / 1e6
    last = max(e["ts"] + e["dur"] for e in spans) / 1e6
    if start is None:
        forwards = [e["ts"] for e in spans if e.get("cat") == "forward"]
        start = min(forwards) / 1e6 if forwards else first
    t0, t1 = (first, last) if window <= 0 else (start, min(last, start + window))
    rows = defaultdict(lambda: defaultdict(list))
    for e in spans:
        s, d = e["ts"] / 1e6, e["dur"] / 1e6
        if s + d >= t0 and s <= t1:
            rows[int(num(e.get("pid")) or 0)][e.get("cat", "")].append((s, d, e.get("name", "")))
    return rows, (t0, t1)


def draw_timeline(plt, trace_path: str, out_path: str, window: float = 5.0,
                  start: float | None = None) -> str:
    """timeline.png: one row per rank (rank 0 on top); measured spans coloured by kind, the
    planned ticks (the schedule's actions) as a strip above, labelled when few enough to read."""
    rows, (t0, t1) = timeline_rows(load_trace(trace_path), window, start)
    pids = sorted(rows)
    fig, ax = plt.subplots(figsize=(14, 1.0 + 0.8 * len(pids)))
    for pid in pids:
        y = -pid  # rank 0 on top
        kinds = rows[pid]
        for kind, colour in TIMELINE_KINDS.items():
            bars = [(s, d) for s, d, _ in kinds.get(kind, [])]
            if bars:  # eval/checkpoint first: they contain the waits drawn over them
                ax.broken_barh(bars, (y - 0.35, 0.5), facecolors=colour,
                               zorder=1 if kind in ("eval", "checkpoint") else 2)
        ticks = sorted(kinds.get("plan", []))
        for i, (s, d, name) in enumerate(ticks):
            ax.broken_barh([(s, d)], (y + 0.18, 0.14), facecolors="#bbbbbb" if i % 2 else "#dddddd")
            if len(ticks) <= 40 and t0 <= s + d / 2 <= t1:
                ax.text(s + d / 2, y + 0.25, name, ha="center", va="center", fontsize=6,
                        clip_on=True)
    ax.set_yticks([-p for p in pids], [f"rank {p}" for p in pids])
    ax.set_ylim(-pids[-1] - 0.6, 0.6)
    ax.set_xlim(t0, t1)
    ax.set(xlabel="seconds", title=f"Timeline ({os.path.basename(trace_path)}; grey strip: "
                                   f"planned ticks)")
    from matplotlib.patches import Patch
    present = {k for p in pids for k in rows[p]}
    ax.legend(handles=[Patch(color=c, label=k) for k, c in TIMELINE_KINDS.items() if k in present],
              loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize="small")
    ax.grid(axis="x", alpha=0.3)
    return save(fig, plt, os.path.dirname(out_path) or ".", os.path.basename(out_path))


def trace_file(run_dir: str) -> str | None:
    """RUN_DIR/trace.json, or RUN_DIR when it is a trace file itself."""
    if run_dir.endswith(".json") and os.path.isfile(run_dir):
        return run_dir
    path = os.path.join(run_dir, "trace.json")
    return path if os.path.isfile(path) else None


def plot_timelines(run_dirs: list, out_dir: str, window: float, start: float | None):
    """(paths written, why each trace that drew nothing was skipped). A trace without spans (a
    run that trained nothing) is skipped, not fatal: the run's other figures still count."""
    traces = [t for t in map(trace_file, run_dirs) if t]
    if not traces:
        return [], []
    plt = import_pyplot()
    os.makedirs(out_dir, exist_ok=True)
    written, skipped = [], []
    for path in traces:
        # several runs into one folder: name each timeline after its run
        name = "timeline.png" if len(traces) == 1 else \
            f"timeline_{os.path.basename(os.path.dirname(os.path.abspath(path)))}.png"
        try:
            written.append(draw_timeline(plt, path, os.path.join(out_dir, name), window, start))
        except PlotError as e:
            skipped.append(f"{name} not drawn: {e}")
    return written, skipped


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m petra_mpi.plot",
                                     description="PNG figures from petra_mpi run directories.")
    parser.add_argument("run_dirs", nargs="+", metavar="RUN_DIR")
    parser.add_argument("--out", help="folder for the PNGs (default: the first RUN_DIR)")
    parser.add_argument("--labels", help="comma-separated legend names, one per RUN_DIR")
    parser.add_argument("--trace-window", type=float, default=5.0, metavar="SECONDS",
                        help="timeline.png shows this many seconds (0: the whole trace)")
    parser.add_argument("--trace-start", type=float, metavar="SECONDS",
                        help="where the timeline window opens (default: the first forward)")
    args = parser.parse_args(argv)
    labels = [s.strip() for s in args.labels.split(",")] if args.labels else None
    first = args.run_dirs[0]
    out = args.out or (os.path.dirname(first) or "." if first.endswith(".json") else first)
    # A run dir (or file) with a trace but no metrics (the benchmark's) gets its timeline only.
    with_metrics = [i for i, d in enumerate(args.run_dirs)
                    if os.path.isfile(os.path.join(d, "metrics.jsonl")) or not trace_file(d)]
    try:
        written = []
        if with_metrics:
            runs = load_runs([args.run_dirs[i] for i in with_metrics],
                             [labels[i] for i in with_metrics] if labels and
                             len(labels) == len(args.run_dirs) else labels)
            written = plot_runs(runs, out)
        timelines, skipped = plot_timelines(args.run_dirs, out, args.trace_window,
                                            args.trace_start)
    except PlotError as e:
        print(f"petra_mpi.plot: {e}", file=sys.stderr)
        return 2
    for path in written + timelines:
        print(path)
    for line in skipped:
        print(f"petra_mpi.plot: skipped: {line}", file=sys.stderr)
    return 0 if written or timelines else 2


if __name__ == "__main__":
    sys.exit(main())
