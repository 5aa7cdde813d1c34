"""`python -m petra_mpi.bench race`: PETRA against every strong pipeline, each at its best
settings, over several rounds, each contender's real memory from a process of its own. It starts
`mpirun -n J python -m petra_mpi.bench peers` itself, one launch at a time, in four phases:

1. tune: one `bench peers` run per micro-batch size of --batches (64, 32, 16), every contender
   but the kept-blocks variants, at the same images per update (--update, 256: k = M = 256 /
   micro-batch) and the same images per timed segment. The first run measures the splits
   (layout.json); the others reuse them.
2. choose and plan: each contender's best micro-batch (highest images/s), and for each schedule
   its best net (ResNet18, or RevNet18 with the suffix _rev); the kept variants are planned once
   at PETRA's best micro-batch, their budgets from the chosen 1F1B's and checkpointed 1F1B's
   activation memory less PETRA's own (layout_kept.json, settings.json).
3. rounds: --rounds rounds, the contenders in an order shuffled per round, each contender in a
   launch of its own at its settings with the fixed layout: its images/s, and each rank's peak
   resident memory (VmHWM) of a process that ran it alone. The first round also counts its
   activation memory and says where its time went (the waterfall).
4. the table (race_table.py): medians and ranges over the rounds of every speed and every ratio
   of the same round, the fullest rank's real peak, the targets, and the figure.

Every launch's output is kept under --out (tune/, rounds/); a race started again with the same
--out reuses the launches that finished, so an interrupted race goes on where it stopped.
`--table` redraws the table of a finished race, and with --accuracy puts each method's
images/s beside the epochs it needs to reach a target accuracy (time to accuracy)."""
import argparse
import json
import os
import random
import subprocess
import sys

import torch

from . import peers_layout
from .common import last_json_line
from .peers import BUDGETS, KEPT, OURS, REBUILDING, SAME_NET, UNLIMITED, Workload
from .pipelining import SCHEDULES

# the race's contenders: ours (backprop, one stage busy at a time, is no pipeline and is left
# out unless asked for) and every schedule at its best net
RACE_OURS = tuple(n for n in OURS if n != "backprop")


def main(argv):
    a = parse_args(argv)
    from . import race_table
    if a.table:
        race_table.main(a)
        return
    Race(a).run()
    a.table = a.out
    race_table.main(a)


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m petra_mpi.bench race", description=__doc__)
    p.add_argument("--ranks", type=int, default=2, help="J: mpirun -n J")
    p.add_argument("--rounds", type=int, default=5, help="timed rounds (each contender once)")
    p.add_argument("--batches", default="64,32,16",
                   help="micro-batch sizes tuned, each at the same images per update")
    p.add_argument("--update", type=int, default=256, help="images per weight update")
    p.add_argument("--microbatches", type=int, default=24,
                   help="ours: micro-batches of 64 per timed segment (as many images at every "
                        "micro-batch size; the pipelines the same images)")
    p.add_argument("--tune-microbatches", type=int, default=12,
                   help="the same in the tuning runs")
    p.add_argument("--width", type=int, default=32)
    p.add_argument("--threads", type=int, default=0, help="torch threads per rank (0: share)")
    p.add_argument("--transport", choices=("mpi", "torch"), default="torch",
                   help="what carries PETRA's messages: torch (gloo, the pipelines' transport: "
                        "one transport for every contender) or mpi")
    p.add_argument("--compile", action="store_true",
                   help="every contender's blocks through torch.compile")
    p.add_argument("--contenders", metavar="A,B,...",
                   help="ours and schedules (without a net's suffix) to race; default: every "
                        "one but backprop")
    p.add_argument("--seed", type=int, default=0, help="of the rounds' shuffled orders")
    p.add_argument("--launch-timeout", type=int, default=1800,
                   help="seconds one launch may take before it counts as failed")
    p.add_argument("--launch-tries", type=int, default=2,
                   help="times a launch that exits with an error is run before it counts as "
                        "failed")
    p.add_argument("--out", default="runs/race", help="where every launch's output goes")
    p.add_argument("--table", metavar="OUT",
                   help="no race: the table and figure of the race in OUT")
    p.add_argument("--accuracy", metavar="DIR", nargs="+", default=[],
                   help="with the table: accuracy runs (DIR/NAME/metrics.jsonl, NAME as "
                        "METHOD_J<J>[_VARIANT]_s<SEED>) for the time to accuracy")
    p.add_argument("--emulated", metavar="RUN.txt",
                   help="with --accuracy: a `bench emulate` output whose images/s stand for "
                        "its J")
    p.add_argument("--target", type=float, default=0.9,
                   help="the validation accuracy the time to accuracy is measured to")
    a = p.parse_args(argv)
    a.batches = [int(b) for b in a.batches.split(",")]
    if a.ranks < 2:
        p.error("--ranks must be at least 2")
    if a.rounds < 1:
        p.error("--rounds must be at least 1")
    if a.launch_tries < 1:
        p.error("--launch-tries must be at least 1")
    for b in a.batches:
        if b < 1 or a.update % b:
            p.error(f"--batches: {b} does not divide --update {a.update}")
    methods = [*RACE_OURS, "backprop", *SCHEDULES]
    a.contenders = (a.contenders.split(",") if a.contenders else
                    [*RACE_OURS, *SCHEDULES])
    unknown = [n for n in a.contenders if n not in methods]
    if unknown:
        p.error(f"--contenders: no contender {', '.join(unknown)} (choose from "
                f"{', '.join(methods)})")
    if not a.table and os.path.exists(a.out) and not os.path.isdir(a.out):
        p.error(f"--out {a.out}: not a directory")
    return a


class Race:
    """The phases of a race in a.out (see the module's docstring)."""

    def __init__(self, a):
        self.a = a
        self.work = Workload("revnet18", "resnet18", a.width, 10, {}, compiled=a.compile)
        os.makedirs(os.path.join(a.out, "tune"), exist_ok=True)
        os.makedirs(os.path.join(a.out, "rounds"), exist_ok=True)

    def path(self, *parts):
        return os.path.join(self.a.out, *parts)

    def run(self):
        self.rounds(self.settings(self.tune()))

    # --- 1. tune ---------------------------------------------------------------------------

    def tune(self) -> dict:
        """{micro-batch: the tuning run's record} of every size of a.batches (None where the
        run failed): every contender of the race but the kept variants, which are planned
        after it."""
        a, layout = self.a, self.path("layout.json")
        names = [n for n in self.names() if n not in KEPT]
        records = {}
        for i, b in enumerate(a.batches):
            fixed = (["--layout", layout] if os.path.exists(layout) else
                     ["--save-layout", layout])
            records[b] = self.launch(self.path("tune", f"batch{b}.txt"), [
                *self.setting_args(b, a.tune_microbatches), "--rounds", "1",
                "--contenders", ",".join(names), *fixed])
        if not os.path.exists(layout):
            raise SystemExit(f"bench race: no tuning run finished, so no layout "
                             f"(see {self.path('tune')})")
        return records

    def names(self) -> list:
        """Every contender of the race's tuning: ours, and each schedule on both nets."""
        return [n for n in self.a.contenders if n in OURS] + [
            s + suffix for s in self.a.contenders if s in SCHEDULES for suffix in ("", SAME_NET)]

    def setting_args(self, batch, microbatches) -> list:
        """bench peers' arguments of a run at micro-batch `batch`: k = M = update / batch, and
        as many images per timed segment as `microbatches` micro-batches of 64."""
        a, k = self.a, self.a.update // batch
        return ["--width", str(a.width), "--batch", str(batch), "--accumulation", str(k),
                "--pt-microbatches", str(max(k, a.ranks)),
                "--microbatches", str(max(1, microbatches * 64 // batch)),
                "--threads", str(a.threads), "--transport", a.transport, "--seed", str(a.seed),
                *(["--compile"] if a.compile else [])]

    # --- 2. choose and plan ----------------------------------------------------------------

    def settings(self, tuned) -> dict:
        """{contender: {"contender": the name bench peers runs, "batch": its micro-batch} or
        {"skipped": why}}, chosen once (settings.json) from the tuning runs `tuned`."""
        path = self.path("settings.json")
        if os.path.exists(path):  # a race that goes on: the settings it chose
            with open(path) as f:
                return json.load(f)
        settings = self.choose(tuned)
        self.plan(settings, tuned)
        _write_json(path, settings)
        return settings

    def choose(self, tuned) -> dict:
        """Each contender's fastest micro-batch in the tuning runs, and for a schedule its
        faster net's; with the images/s of every candidate, for the record."""
        best = {}  # name -> (images/s, batch)
        for b, record in tuned.items():
            for name, speed in (record or {}).get("images_per_s", {}).items():
                if speed > best.get(name, (0, 0))[0]:
                    best[name] = (speed, b)
        settings = {}
        for name in self.a.contenders:
            if name in KEPT:
                continue
            candidates = [name] if name in OURS else [name + s for s in ("", SAME_NET)]
            ran = [c for c in candidates if c in best]
            if not ran:
                settings[name] = {"skipped": _why_not(name, candidates, tuned)}
                continue
            winner = max(ran, key=lambda c: best[c][0])
            settings[name] = {"contender": winner, "batch": best[winner][1],
                              "tuned_images_per_s": {f"{c} at {b}": r["images_per_s"][c]
                                                     for b, r in tuned.items() if r
                                                     for c in ran if c in r["images_per_s"]}}
        return settings

    def plan(self, settings, tuned):
        """The kept variants' plans, made once into layout_kept.json (the layout the rounds
        run on), and their settings: PETRA's micro-batch."""
        out = self.path("layout_kept.json")
        if not os.path.exists(out):
            with open(self.path("layout.json")) as f:
                layout = json.load(f)
            layout["kept"] = self.kept_plans(settings, tuned, layout)
            peers_layout.write(out, layout)
        with open(out) as f:
            planned = json.load(f)["kept"]
        for name in KEPT:
            if name in self.a.contenders:
                settings[name] = (
                    {"contender": name, "batch": planned[name]["batch"]} if name in planned else
                    {"skipped": f"no budget: {BUDGETS[name][0]} or {BUDGETS[name][1]} did "
                                "not run"})

    def kept_plans(self, settings, tuned, layout) -> dict:
        """plan_kept's plans of the kept variants at PETRA's chosen micro-batch, as bench peers
        plans them: budgets per rank of the chosen 1F1B's (checkpointed 1F1B's) activation
        bytes at its own settings less PETRA's (with its last stage rebuilding) at that
        micro-batch, and no limit."""
        a = self.a
        kept = [n for n in KEPT if n in a.contenders]
        if not kept:
            return {}
        batch = settings.get("petra", {}).get("batch", a.batches[0])
        ours = _peaks_at(tuned, batch)
        budgets = {UNLIMITED: (None, None)}
        for name, (rival, mine) in BUDGETS.items():
            chosen = settings.get(rival, {})
            theirs = _peaks_at(tuned, chosen.get("batch")).get(chosen.get("contender"))
            if theirs and mine in ours:
                budgets[name] = ([max(0, f - p) for f, p in zip(theirs, ours[mine])],
                                 chosen["contender"])
        torch.set_num_threads(a.threads or max(1, (os.cpu_count() or 1) // a.ranks))
        costs = peers_layout.costs_of(layout, batch) or {"ours": _measure_ours(self.work,
                                                                                batch)}
        petra_split, rebuild_split, _ = peers_layout.splits_of(layout)
        return peers_layout.plan_kept(
            self.work.net(self.work.arch, compiled=False), a.ranks,
            {n: budgets[n] for n in kept if n in budgets}, costs["ours"], batch, petra_split,
            rebuild_split, None, REBUILDING)

    # --- 3. rounds -------------------------------------------------------------------------

    def rounds(self, settings):
        """a.rounds rounds, each contender alone in a launch, in a shuffled order per round."""
        a = self.a
        names = [n for n in a.contenders if "contender" in settings.get(n, {})]
        order = random.Random(a.seed)
        for r in range(a.rounds):
            names_now = list(names)
            order.shuffle(names_now)
            for i, name in enumerate(names_now):
                s = settings[name]
                print(f"bench race: round {r + 1} of {a.rounds}, {i + 1} of {len(names_now)}: "
                      f"{s['contender']} at micro-batch {s['batch']}", flush=True)
                self.launch(self.path("rounds", f"round{r + 1}_{name}.txt"), [
                    *self.setting_args(s["batch"], a.microbatches), "--rounds", "1",
                    "--contenders", s["contender"], "--layout", self.path("layout_kept.json"),
                    *([] if r == 0 else ["--timing-only"])])

    # --- launches --------------------------------------------------------------------------

    def launch(self, path, args) -> dict | None:
        """The record of `bench peers ARGS` under mpirun, its output kept at `path`: read from
        there when an earlier race finished it, else run now; None when it failed (its output
        then at path + .failed). A launch that exits with an error is run again, up to
        --launch-tries in all: a process under torch's gloo now and then aborts ("terminate
        called without an active exception"), which would cost a round its figure or a tuning
        run its micro-batch. A launch that runs past --launch-timeout is not run again: it
        hangs."""
        if os.path.exists(path):
            return last_json_line(path)
        argv = ["mpirun", "-n", str(self.a.ranks), sys.executable, "-m", "petra_mpi.bench",
                "peers", *args]
        print("bench race: " + " ".join(argv[4:]), flush=True)
        tries = self.a.launch_tries
        for attempt in range(1, tries + 1):
            try:
                proc = subprocess.run(argv, capture_output=True, text=True,
                                      timeout=self.a.launch_timeout)
                failed, hung = proc.returncode != 0, False
                text = proc.stdout + (f"\n--- stderr ---\n{proc.stderr}" if failed else "")
            except subprocess.TimeoutExpired as e:
                failed, hung = True, True
                text = f"timed out after {self.a.launch_timeout} s\n{e.stdout or ''}"
            if not failed:
                break
            with open(path + ".failed", "a") as f:
                f.write(f"=== attempt {attempt} of {tries} ===\n{text}\n")
            again = attempt < tries and not hung
            print(f"bench race: failed (attempt {attempt} of {tries}), output in {path}.failed"
                  + ("; again" if again else ""), flush=True)
            if not again:
                return None
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            f.write(text)
        os.replace(tmp, path)
        return last_json_line(path)


def _peaks_at(tuned, batch) -> dict:
    """The activation peaks per rank of the tuning run at micro-batch `batch`."""
    return (tuned.get(batch) or {}).get("peak_activation_bytes", {})


def _why_not(name, candidates, tuned) -> str:
    for record in tuned.values():
        for c in candidates:
            if c in (record or {}).get("skipped", {}):
                return record["skipped"][c]
    return f"{name}: no tuning run finished it"


def _measure_ours(work, batch):
    from ...core.blockcost import measure_net_costs
    return measure_net_costs(work.net(work.arch), batch, time_kept=True)


def _write_json(path, obj):
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1)
    os.replace(tmp, path)
