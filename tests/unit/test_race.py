"""The race's arithmetic (bench race, bench peers' fixed layouts) on records made here: ratios of
the same round, the targets at a rival's real memory, the Pareto front, the time to accuracy
from metrics files, and the layout file's checks. The launches themselves: e2e/test_bench.py."""
import json
import os

import pytest

from petra_mpi.perf.bench import peers_layout, race, race_table
from petra_mpi.perf.bench.peers import Workload, halved, keeps_all, parse_args

MIB = 2 ** 20


def launch(name, speed, peak_mib):
    """The record of a round's launch of one contender."""
    return {"images_per_s": {name: speed}, "steady_images_per_s": {},
            "peak_rss_bytes": {name: [peak_mib * MIB, peak_mib * MIB // 2]}}


def test_ratios_are_taken_within_each_round():
    # round 2 of 1f1b failed: the ratio is over rounds 1 and 3 only
    rounds = {"petra": [launch("petra", 100, 1), launch("petra", 200, 1), launch("petra", 300, 1)],
              "1f1b": [launch("1f1b", 100, 1), None, launch("1f1b", 150, 1)],
              "zbv": [launch("zbv_rev", 50, 1), launch("zbv_rev", 400, 1),
                      launch("zbv_rev", 150, 1)]}
    r = race_table.ratios(rounds)
    assert r["petra / 1f1b"]["values"] == [1.0, 2.0] and r["petra / 1f1b"]["of"] == 2
    # per round 2.0, 0.5, 2.0: the median of the ratios, not the ratio of the medians (200/150)
    assert r["petra / zbv"]["median"] == 2.0 and r["petra / zbv"]["ahead"] == 2
    assert (r["petra / zbv"]["min"], r["petra / zbv"]["max"]) == (0.5, 2.0)
    assert not any(k.startswith("1f1b /") for k in r)  # ours are named first


def contender(speed, peak_mib):
    return {"images_per_s": {"median": speed}, "real_peak_fullest_bytes": peak_mib * MIB}


def test_targets_take_the_fastest_petra_that_fits_in_the_rivals_memory():
    contenders = {"petra": contender(90, 100), "petra_unlimited": contender(130, 400),
                  "petra_budget_1f1b": contender(110, 290), "1f1b": contender(100, 300),
                  "zero_bubble": contender(120, 350), "1f1b_checkpointed": contender(70, 120),
                  "pipedream": contender(125, 500)}
    pairs = {f"{o} / {r}": {"median": contenders[o]["images_per_s"]["median"]
                            / contenders[r]["images_per_s"]["median"],
                            "values": [0.9, 1.2, 1.3], "of": 3}
             for o in ("petra", "petra_unlimited", "petra_budget_1f1b")
             for r in ("1f1b", "zero_bubble", "1f1b_checkpointed")}
    t = {x["rival"]: x for x in race_table.targets(contenders, pairs)}
    # the unlimited plan is faster but holds more than 1F1B: the budget variant is the figure
    assert t["1f1b"]["ours"] == "petra_budget_1f1b" and t["1f1b"]["met"] == 2
    # the fastest schedule (PipeDream is ours, not a schedule) at its memory
    assert t["zero_bubble"]["ours"] == "petra_budget_1f1b"
    assert t["1f1b_checkpointed"]["ours"] == "petra" and t["1f1b_checkpointed"]["goal"] == 1.15
    assert t["1f1b_checkpointed"]["met"] == 2  # 1.2 and 1.3 of the rounds reach 1.15
    # nothing of ours fits under 50 MiB
    contenders["1f1b"] = contender(100, 50)
    (first, *_) = race_table.targets(contenders, pairs)
    assert first["rival"] == "1f1b" and "ours" not in first


def test_the_pareto_front_is_what_no_other_beats_on_both():
    contenders = {"a": contender(100, 100), "b": contender(120, 200), "c": contender(110, 250),
                  "d": contender(90, 100), "e": contender(150, 400)}
    assert race_table.pareto(contenders) == ["e", "b", "a"]


def write_run(root, name, accuracies, junk=False):
    run = root / name
    run.mkdir(parents=True)
    lines = [json.dumps({"event": "train", "step": 1, "loss": 1.0})]
    lines += [json.dumps({"event": "eval", "epoch": e, "val_acc": acc})
              for e, acc in enumerate(accuracies)]
    if junk:  # a run being written may end mid-line
        lines.append('{"event": "eval", "epo')
    (run / "metrics.jsonl").write_text("\n".join(lines) + "\n")


def test_time_to_accuracy_reads_the_accuracy_runs(tmp_path):
    write_run(tmp_path, "petra_J2_s0", [0.80, 0.91, 0.93], junk=True)
    write_run(tmp_path, "petra_J2_s1", [0.80, 0.85, 0.90])
    write_run(tmp_path, "petra_J2_mb16_s0", [0.90])
    write_run(tmp_path, "backprop_J10_s0", [0.85, 0.92])
    write_run(tmp_path, "backprop_J10_mb64_s1", [0.91])  # the same micro-batch, named
    write_run(tmp_path, "petra_J10_s0", [0.70, 0.80])  # not reached
    write_run(tmp_path, "notes", [0.99])  # not a study's name: passed over
    copies = tmp_path / "copies"  # runs copied elsewhere as well are read once
    write_run(copies, "petra_J2_s1", [0.80, 0.85, 0.90])
    write_run(copies, "petra_J4_s0", [0.91])
    groups = race_table.accuracy_runs([tmp_path, copies], 0.9)
    assert [r["seed"] for r in groups[("petra", 2, "mb64")]].count(1) == 1
    assert [r["seed"] for r in groups.pop(("petra", 4, "mb64"))] == [0]
    # a name without _mb<B> is a run at micro-batch 64
    assert set(groups) == {("petra", 2, "mb64"), ("petra", 2, "mb16"), ("backprop", 10, "mb64"),
                           ("petra", 10, "mb64")}
    assert sorted(r["reached"] for r in groups[("petra", 2, "mb64")]) == [2, 3]
    assert sorted(r["seed"] for r in groups[("backprop", 10, "mb64")]) == [0, 1]
    speeds = {(2, 64): {"petra": (100.0, "race"), "1f1b": (120.0, "race"),
                        "pipedream": (130.0, "race")},
              (2, 16): {"petra": (80.0, "tuning run")},
              (10, 16): {"petra": (50.0, "emulated")}}
    rows = {(r["J"], r["batch"], r["contender"]): r
            for r in race_table.time_to_accuracy(groups, speeds, 0.9)["rows"]}
    petra = rows[(2, 64, "petra")]
    assert petra["epochs"] == 2.5 and petra["minutes"] == pytest.approx(2.5 * 60000 / 100 / 60)
    # a synchronous schedule trains as backprop, whatever J (invariant 2)
    assert rows[(2, 64, "1f1b")]["accuracy_of"] == "backprop"
    assert rows[(2, 64, "1f1b")]["epochs"] == 1.5  # median of 2 and 1
    # the micro-batch of the accuracy runs matches the speed's
    assert rows[(2, 16, "petra")]["epochs"] == 1
    assert "seeds" not in rows[(10, 16, "petra")]  # no mb16 run at J = 10
    assert "seeds" not in rows[(2, 64, "pipedream")]  # no exact delayed-gradient run at J = 2


def test_a_layout_is_refused_in_one_line_naming_the_file(tmp_path):
    work = Workload("revnet18", "resnet18", 8, 10, {})
    bad = tmp_path / "bad.json"
    bad.write_text("not json")
    with pytest.raises(peers_layout.LayoutError, match=f"^{bad}: not a layout"):
        peers_layout.read(bad, work, 2)
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"bench": "peers", "ranks": 2}))
    with pytest.raises(peers_layout.LayoutError, match="not a layout of bench peers"):
        peers_layout.read(other, work, 2)
    made = tmp_path / "layout.json"
    peers_layout.write(made, peers_layout.make(work, 2, [3, 7], [4, 6], {"resnet18": {2: [4, 6]}},
                                               None, 64, {}))
    assert peers_layout.splits_of(peers_layout.read(made, work, 2)) == (
        [3, 7], [4, 6], {"resnet18": {2: [4, 6]}})
    with pytest.raises(peers_layout.LayoutError, match="made for ranks 2, this run has 4"):
        peers_layout.read(made, work, 4)
    with pytest.raises(peers_layout.LayoutError, match="made for width 8, this run has 16"):
        peers_layout.read(made, Workload("revnet18", "resnet18", 16, 10, {}), 2)
    with pytest.raises(FileExistsError):  # never written over
        peers_layout.write(made, {})


def test_bad_arguments_exit_2(tmp_path, capsys):
    existing = tmp_path / "layout.json"
    existing.write_text("{}")
    for args, says in ((["--save-layout", str(existing)], "exists"),
                       (["--contenders", "petra,nope"], "no contender nope"),
                       (["--layout", str(existing), "--partition", "3,7"], "--layout gives")):
        with pytest.raises(SystemExit) as e:
            parse_args(args)
        assert e.value.code == 2 and says in capsys.readouterr().err
    for args, says in ((["--batches", "48"], "does not divide"),
                       (["--contenders", "petra,gpipe_rev"], "no contender gpipe_rev")):
        with pytest.raises(SystemExit) as e:
            race.parse_args(args)
        assert e.value.code == 2 and says in capsys.readouterr().err


def test_given_splits_halved_and_pipedreams_plan():
    assert halved([3, 7]) == [1, 2, 3, 4] and halved([1, 9]) == [0, 1, 4, 5]
    # stage 0 of 2 holds d_0 = 2 micro-batches in flight, the last stage none
    assert keeps_all([3, 7]) == [[2, 2, 2], [0] * 7]
    assert keeps_all([1, 1, 1]) == [[4], [2], [0]]


def fake_mpirun(tmp_path, body):
    """A directory with an `mpirun` that runs the shell `body` and logs each call in
    tmp_path/calls. gloo's rare abort as a process ends cannot be caused on demand, so the
    launches' retry is tested on a stand-in that fails the way it does."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    script = bin_dir / "mpirun"
    script.write_text(f"#!/bin/sh\necho call >> {tmp_path / 'calls'}\n{body}\n")
    script.chmod(0o755)
    return bin_dir


def test_a_launch_that_aborts_is_run_again_and_one_that_hangs_is_not(tmp_path, monkeypatch):
    calls = tmp_path / "calls"
    aborts_once = (f'if [ "$(wc -l < {calls})" -eq 1 ]; then '
                   'echo "terminate called without an active exception" >&2; exit 134; fi\n'
                   'echo \'{"bench": "peers"}\'')
    monkeypatch.setenv("PATH", f"{fake_mpirun(tmp_path, aborts_once)}:{os.environ['PATH']}")
    out = tmp_path / "race"
    r = race.Race(race.parse_args(["--out", str(out), "--launch-timeout", "5"]))
    assert r.launch(r.path("rounds", "round1_petra.txt"), []) == {"bench": "peers"}
    assert calls.read_text().count("call") == 2
    failed = (out / "rounds" / "round1_petra.txt.failed").read_text()
    assert "attempt 1 of 2" in failed and "terminate called" in failed
    # the table says which launch needed a second try
    assert race_table.failed_launches(str(out)) == {os.path.join("rounds", "round1_petra.txt"):
                                                    True}

    # with one try the abort is final: no record, and the table says so
    calls.unlink()
    r.a.launch_tries = 1
    assert r.launch(r.path("rounds", "round1_zbv.txt"), []) is None
    assert calls.read_text().count("call") == 1
    assert race_table.failed_launches(str(out))[os.path.join("rounds", "round1_zbv.txt")] is False

    # a launch that hangs is not started again, whatever the tries
    calls.unlink()
    fake_mpirun(tmp_path, "exec sleep 60")
    r.a.launch_tries, r.a.launch_timeout = 3, 1
    assert r.launch(r.path("rounds", "round1_1f1b.txt"), []) is None
    assert calls.read_text().count("call") == 1
    assert "timed out after 1 s" in (out / "rounds" / "round1_1f1b.txt.failed").read_text()
