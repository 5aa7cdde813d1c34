"""The table of a race (race.py) from the launches it kept: per contender its settings, images/s
over the rounds (median, min-max), each rank's real peak memory (the process's high-water mark,
median over the rounds) with the fullest rank first, its activation count; the ratio of our
variants over every rival in the same round (median, min-max, and in how many rounds ours was
ahead); the targets; the figure of images/s against the fullest rank's real peak; and, from the
accuracy runs given, the time each method needs to reach a validation accuracy."""
import glob
import json
import os
import re
import statistics

from .common import emit, last_json_line, save_figure
from .peers import RATIO_OURS, spread

MIB = 2.0 ** 20
# our variants with PETRA's arithmetic: plain, its last stage rebuilding, with kept blocks
PETRAS = ("petra", "petra_rebuild_last", "petra_unlimited", "petra_budget_1f1b",
          "petra_budget_1f1b_checkpointed")


def main(a):
    record = summarize(a.table)
    if a.accuracy:
        speeds = race_speeds(a.table, record)
        if a.emulated:
            speeds.update(emulated_speeds(last_json_line(a.emulated)))
        record["time_to_accuracy"] = time_to_accuracy(accuracy_runs(a.accuracy, a.target),
                                                      speeds, a.target)
    figure = os.path.join(a.table, "race.png")
    if os.path.exists(figure):
        print(f"figure: {figure} exists and is kept (remove it to draw it again)")
    elif record["contenders"]:
        print(f"figure: {draw(record, figure)}")
    report(record)
    emit(record)


def summarize(out) -> dict:
    """The race in directory `out`: its settings and every round's launch, summed up."""
    with open(os.path.join(out, "settings.json")) as f:
        settings = json.load(f)
    rounds = {}  # race name -> [record of round r, or None]
    paths = glob.glob(os.path.join(out, "rounds", "round*_*.txt"))
    count = max((int(re.match(r"round(\d+)_", os.path.basename(p)).group(1)) for p in paths),
                default=0)
    for name, s in settings.items():
        if "contender" in s:
            rounds[name] = [_record(os.path.join(out, "rounds", f"round{r + 1}_{name}.txt"))
                            for r in range(count)]
    contenders = {name: _contender(settings[name], runs) for name, runs in rounds.items()
                  if any(runs)}
    first = next((r for runs in rounds.values() for r in runs if r), {})
    record = {"bench": "race", "out": out, "rounds": count,
              "ranks": first.get("ranks"), "machine": first.get("machine"),
              "allocator": first.get("allocator"), "compile": first.get("compile"),
              "transport": first.get("transport"), "width": first.get("width"),
              "update": _update(first), "contenders": contenders,
              "skipped": {n: s["skipped"] for n, s in settings.items() if "skipped" in s}}
    record["failed_launches"] = failed_launches(out)
    record["ratios"] = ratios(rounds)
    record["pareto"] = pareto(contenders)
    record["targets"] = targets(contenders, record["ratios"])
    return record


def failed_launches(out) -> dict:
    """{a launch's output file, relative to `out`: whether a later try of it finished} for every
    launch that failed at least once (race.launch keeps each failed try in FILE.failed)."""
    found = sorted(glob.glob(os.path.join(out, "tune", "*.failed")) +
                   glob.glob(os.path.join(out, "rounds", "*.failed")))
    return {os.path.relpath(p, out).removesuffix(".failed"):
            os.path.exists(p.removesuffix(".failed")) for p in found}


def _record(path):
    return last_json_line(path) if os.path.exists(path) else None


def _update(r) -> int | None:
    return r["batch"] * r["accumulation"] if r else None


def _contender(setting, runs) -> dict:
    """One contender's figures over the rounds it finished."""
    done = [r for r in runs if r]
    name = setting["contender"]
    speeds = [r["images_per_s"][name] for r in done]
    steady = [r["steady_images_per_s"][name] for r in done if name in r["steady_images_per_s"]]
    per_rank = list(zip(*(r["peak_rss_bytes"][name] for r in done)))
    rss = [statistics.median(v) for v in per_rank]
    first = done[0]
    out = {"contender": name, "net": first["net"][name], "batch": first["batch"],
           "accumulation": first["accumulation"], "pt_microbatches": first["pt_microbatches"],
           "runs": len(done), "images_per_s": spread(speeds), "images_per_s_rounds": speeds,
           "real_peak_bytes": rss, "real_peak_fullest_bytes": max(rss),
           "real_peak_range_bytes": [min(max(r["peak_rss_bytes"][name]) for r in done),
                                     max(max(r["peak_rss_bytes"][name]) for r in done)],
           "base_rss_bytes": first["base_rss_bytes"]}
    if steady:
        out["steady_images_per_s"] = spread(steady)
    detailed = next((r for r in done if name in r.get("peak_activation_bytes", {})), None)
    if detailed:
        out["peak_activation_bytes"] = detailed["peak_activation_bytes"][name]
        if name in (detailed.get("waterfall") or {}):
            out["waterfall"] = detailed["waterfall"][name]
        if name in detailed.get("kept", {}):
            out["kept"] = detailed["kept"][name]
    return out


def ratios(rounds) -> dict:
    """"{ours} / {rival}": our images/s over the rival's of the same round, for every PETRA
    variant over every other contender: median, min, max and the rounds in which ours was at
    least as fast ("ahead", of "of")."""
    out = {}
    for ours in [n for n in RATIO_OURS if n in rounds]:
        for rival in [n for n in rounds if n not in PETRAS]:
            pairs = [(m, r) for m, r in zip(rounds[ours], rounds[rival]) if m and r]
            values = [m["images_per_s"][_name(m)] / r["images_per_s"][_name(r)]
                      for m, r in pairs]
            if values:
                out[f"{ours} / {rival}"] = {**spread(values), "values": values,
                                            "ahead": sum(v >= 1.0 for v in values),
                                            "of": len(values)}
    return out


def _name(r) -> str:
    (name,) = r["images_per_s"]  # a round's launch runs one contender
    return name


def pareto(contenders) -> list:
    """The contenders no other beats on both median images/s and the fullest rank's real
    peak, fastest first."""
    front = [n for n, c in contenders.items() if not any(
        o["images_per_s"]["median"] >= c["images_per_s"]["median"]
        and o["real_peak_fullest_bytes"] <= c["real_peak_fullest_bytes"]
        and (o["images_per_s"]["median"], -o["real_peak_fullest_bytes"])
        != (c["images_per_s"]["median"], -c["real_peak_fullest_bytes"])
        for o in contenders.values())]
    return sorted(front, key=lambda n: -contenders[n]["images_per_s"]["median"])


def targets(contenders, pairs) -> list:
    """The race's targets, each with the contenders it compares, the ratio's median and range,
    and the rounds that met it: the best PETRA variant at most at a rival's fullest-rank real
    peak against 1F1B and against the fastest schedule (>= 1.0), plain PETRA (or with its last
    stage rebuilding) against checkpointed 1F1B at most at its memory (>= 1.15)."""
    schedules = [n for n in contenders if n not in PETRAS and n not in ("delayed", "pipedream",
                                                                          "backprop")]
    fastest = max(schedules, key=lambda n: contenders[n]["images_per_s"]["median"],
                  default=None)
    out = []
    goals = [("1f1b", PETRAS, 1.0)] + ([(fastest, PETRAS, 1.0)] if fastest != "1f1b" else []) \
        + [("1f1b_checkpointed", ("petra", "petra_rebuild_last"), 1.15)]
    for rival, ours, goal in goals:
        if rival not in contenders:
            continue
        room = contenders[rival]["real_peak_fullest_bytes"]
        fits = [o for o in ours if o in contenders and f"{o} / {rival}" in pairs
                and contenders[o]["real_peak_fullest_bytes"] <= room]
        entry = {"rival": rival, "goal": goal, "rival_real_peak_fullest_bytes": room}
        if fits:
            best = max(fits, key=lambda o: pairs[f"{o} / {rival}"]["median"])
            ratio = pairs[f"{best} / {rival}"]
            entry.update(ours=best, ours_real_peak_fullest_bytes=contenders[best][
                "real_peak_fullest_bytes"], ratio=ratio,
                met=sum(v >= goal for v in ratio["values"]), of=ratio["of"])
        out.append(entry)
    return out


# --- time to accuracy ---------------------------------------------------------------------

RUN_NAME = re.compile(r"(?P<method>[a-z_]+?)_J(?P<J>\d+)(?:_(?P<variant>[a-z0-9]+))?"
                      r"_s(?P<seed>\d+)$")


def accuracy_runs(dirs, target) -> dict:
    """{(method, J, variant): [per seed: {"seed", "epochs" trained, "final", "reached": the
    epochs to `target` (None: not reached)}]} of every run DIR/NAME/metrics.jsonl whose NAME
    reads METHOD_J<J>[_VARIANT]_s<SEED> (as the accuracy studies name them; a name without a
    variant is a run at micro-batch UNNAMED_BATCH). A NAME already read from an earlier DIR is
    passed over: it is the same run, copied (into docs/results from where it trained)."""
    groups, seen = {}, set()
    for d in dirs:
        for path in sorted(glob.glob(os.path.join(d, "*", "metrics.jsonl"))):
            name = os.path.basename(os.path.dirname(path))
            m = RUN_NAME.match(name)
            if not m or name in seen:
                continue
            seen.add(name)
            evals = _evals(path)
            if not evals:
                continue
            reached = next((e + 1 for e, acc in evals if acc >= target), None)
            key = (m["method"], int(m["J"]), m["variant"] or f"mb{UNNAMED_BATCH}")
            groups.setdefault(key, []).append({"seed": int(m["seed"]), "epochs": len(evals),
                                               "final": evals[-1][1], "reached": reached,
                                               "path": path})
    return groups


def _evals(path) -> list:
    """[(epoch, val_acc)] of a metrics file's evaluation lines, in order (a damaged line is
    passed over: a run being written may end mid-line)."""
    out = []
    with open(path) as f:
        for line in f:
            try:
                r = json.loads(line)
            except json.JSONDecodeError:
                continue
            if r.get("event") == "eval" and "val_acc" in r:
                out.append((r["epoch"], r["val_acc"]))
    return out


# whose accuracy runs stand for a contender: PETRA's variants train as PETRA (a kept
# micro-batch is the exact delayed gradient, which trained as PETRA at J = 10); delayed and
# PipeDream as the exact delayed gradient; every synchronous schedule as backprop
ACCURACY_OF = {**{n: "petra" for n in PETRAS}, "delayed": "delayed_both",
               "pipedream": "delayed_both"}
# the micro-batch of accuracy runs whose name has no _mb<B>: those made when configs/
# fashion_mnist.yaml trained in micro-batches of 64 (docs/results/fashion_mnist/*_J*_s*)
UNNAMED_BATCH = 64


def race_speeds(out, race) -> dict:
    """{(J, micro-batch): {contender: (images/s, where from)}} of a race: each contender at its
    chosen micro-batch over the rounds (ours in steady state: training's segments are
    epochs), and at the other micro-batches from the tuning runs (one round)."""
    J, speeds = race["ranks"], {}
    for name, c in race["contenders"].items():
        speeds.setdefault((J, c["batch"]), {})[name] = (
            c.get("steady_images_per_s", c["images_per_s"])["median"],
            f"median of {c['runs']} rounds")
    for path in sorted(glob.glob(os.path.join(out, "tune", "batch*.txt"))):
        tuned = last_json_line(path)
        at = speeds.setdefault((J, tuned["batch"]), {})
        for name, c in race["contenders"].items():
            runs = c["contender"]
            if name not in at and runs in tuned["images_per_s"]:
                at[name] = (tuned["steady_images_per_s"].get(runs, tuned["images_per_s"][runs]),
                            "tuning run")
    return speeds


def emulated_speeds(record) -> dict:
    """The same of a `bench emulate` record: each method's best images/s over its m (PETRA in
    steady state), kept-blocks runs left out."""
    best = {}
    for row in record["rows"]:
        if "@" in row["name"] or "unlimited" in row["name"]:
            continue
        rate = row.get("steady_images_per_s", row["images_per_s"])
        if rate > best.get(row["method"], (0,))[0]:
            best[row["method"]] = (rate, f"emulated, {row['name']}")
    return {(record["ranks"], record["batch"]): best}


def time_to_accuracy(groups, speeds, target, epoch_images=60_000) -> dict:
    """Rows of (J, micro-batch, contender, its images/s and where from, the accuracy runs of
    the same J and micro-batch it takes its epochs from, the epochs to `target` over their
    seeds (median; None when a seed did not reach it), minutes to the target at that speed for
    `epoch_images` images per epoch). `speeds`: race_speeds and emulated_speeds."""
    rows = []
    for (J, batch), rates in sorted(speeds.items()):
        variant = f"mb{batch}"
        for name, (rate, source) in sorted(rates.items(), key=lambda kv: -kv[1][0]):
            method = ACCURACY_OF.get(name, "backprop")
            # backprop's accuracy does not depend on J (invariant 2)
            runs = next((v for (m, j, var), v in sorted(groups.items()) if m == method
                         and (j == J or method == "backprop") and var == variant), None)
            row = {"J": J, "batch": batch, "contender": name, "images_per_s": rate,
                   "from": source, "accuracy_of": method}
            if runs:
                reached = [r["reached"] for r in runs]
                epochs = statistics.median(reached) if None not in reached else None
                row.update(seeds=[r["seed"] for r in runs], epochs_to_target=reached,
                           epochs=epochs, minutes=(None if epochs is None else
                                                   epochs * epoch_images / rate / 60))
            rows.append(row)
    return {"target": target, "epoch_images": epoch_images, "rows": rows,
            "runs": {f"{m} J={j}" + (f" {v}" if v else ""): runs
                     for (m, j, v), runs in sorted(groups.items())}}


# --- output -------------------------------------------------------------------------------

def report(r):
    m = r["machine"] or {}
    print(f"race: {r['rounds']} rounds, {r['ranks']} ranks, width {r['width']}, "
          f"{r['update']} images per update; messages: ours over "
          f"{(r['transport'] or {}).get('ours')}, pipelining over gloo"
          + ("; compiled" if r["compile"] else "") + f"; {m.get('cpu')}, {m.get('cores')} "
          f"cores, load {m.get('load_average', [0])[0]:.1f} at the first launch, allocator "
          f"{r['allocator']}")
    print(f"{'contender':<31} {'net':<9} {'mb':>3} {'k=M':>4} {'images/s':>9} "
          f"{'min-max':>13} {'steady':>7}  {'real peak MiB':>13} {'per rank':<15} "
          f"{'activations MiB'}")
    for name, c in sorted(r["contenders"].items(),
                          key=lambda kv: -kv[1]["images_per_s"]["median"]):
        s = c["images_per_s"]
        steady = f"{c['steady_images_per_s']['median']:7.1f}" if "steady_images_per_s" in c \
            else f"{'':7}"
        per_rank = " ".join(f"{b / MIB:.0f}" for b in c["real_peak_bytes"])
        acts = " ".join(f"{b / MIB:.1f}" for b in c.get("peak_activation_bytes", []))
        star = "*" if name in r["pareto"] else " "
        print(f"{star}{name:<30} {c['net']:<9} {c['batch']:>3} "
              f"{c['accumulation']:>4} {s['median']:9.1f} {s['min']:6.1f}-{s['max']:<6.1f} "
              f"{steady}  {c['real_peak_fullest_bytes'] / MIB:13.0f} {per_rank:<15} {acts}")
    for name, why in r["skipped"].items():
        print(f" {name:<30} did not run: {why}")
    for path, finished in r.get("failed_launches", {}).items():
        print(f" launch {path} failed" + (", then finished when run again" if finished else
                                          ", every try") + f" (output in {path}.failed)")
    print("* the Pareto front (no other contender is both faster and holds less on its fullest "
          "rank)")
    print("ours / rival, the same round: median (min-max), rounds ours was at least as fast")
    for key, v in r["ratios"].items():
        print(f"  {key:<52} {v['median']:.2f} ({v['min']:.2f}-{v['max']:.2f}), "
              f"{v['ahead']} of {v['of']}")
    for t in r["targets"]:
        where = (f"{t['ours']} ({t['ours_real_peak_fullest_bytes'] / MIB:.0f} MiB) / "
                 f"{t['rival']} ({t['rival_real_peak_fullest_bytes'] / MIB:.0f} MiB): "
                 f"{t['ratio']['median']:.2f} ({t['ratio']['min']:.2f}-{t['ratio']['max']:.2f})"
                 f", >= {t['goal']} in {t['met']} of {t['of']} rounds" if "ours" in t else
                 f"no PETRA variant holds at most {t['rival']}'s "
                 f"{t['rival_real_peak_fullest_bytes'] / MIB:.0f} MiB on its fullest rank")
        print(f"target >= {t['goal']}, the fastest PETRA at most at {t['rival']}'s real memory: "
              f"{where}")
    tta = r.get("time_to_accuracy")
    if tta:
        print(f"time to {tta['target']:.0%} validation accuracy ({tta['epoch_images']} images "
              "per epoch; epochs: median over the seeds of the accuracy runs of the same J and "
              "micro-batch)")
        for row in tta["rows"]:
            epochs = ("no accuracy run" if "seeds" not in row else
                      f"{row['epochs']} epochs ({row['accuracy_of']}, seeds {row['seeds']}: "
                      f"{row['epochs_to_target']})" if row["epochs"] is not None else
                      f"not reached in every seed ({row['accuracy_of']}: "
                      f"{row['epochs_to_target']})")
            minutes = f", {row['minutes']:.1f} min" if row.get("minutes") else ""
            print(f"  J = {row['J']:<3} mb {row['batch']:<3} {row['contender']:<31} "
                  f"{row['images_per_s']:8.1f} images/s ({row['from']}), {epochs}{minutes}")


def draw(r, path) -> str:
    """Images/s (median, bars from min to max) against the fullest rank's real peak MiB of
    every contender, the Pareto front joined, ours in blue."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7.5, 5))
    for name, c in r["contenders"].items():
        s, x = c["images_per_s"], c["real_peak_fullest_bytes"] / MIB
        colour = "tab:blue" if name in PETRAS else "tab:green" if name in (
            "delayed", "pipedream") else "tab:red"
        ax.errorbar(x, s["median"], yerr=[[s["median"] - s["min"]], [s["max"] - s["median"]]],
                    fmt="o", color=colour, capsize=3)
        ax.annotate(name, (x, s["median"]), fontsize=7, xytext=(4, 3),
                    textcoords="offset points")
    front = sorted(r["pareto"], key=lambda n: r["contenders"][n]["real_peak_fullest_bytes"])
    ax.plot([r["contenders"][n]["real_peak_fullest_bytes"] / MIB for n in front],
            [r["contenders"][n]["images_per_s"]["median"] for n in front], "k--", lw=0.8)
    ax.set_xlabel("real peak memory of the fullest rank (VmHWM), MiB")
    ax.set_ylabel("images/s (median, min-max over the rounds)")
    ax.set_title(f"{r['ranks']} ranks, {r['rounds']} rounds: PETRA (blue), delayed gradients "
                 "(green), torch's schedules (red)", fontsize=9)
    return save_figure(fig, path)
