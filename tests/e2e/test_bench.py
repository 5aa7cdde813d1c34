"""The benchmarks (petra_mpi.bench) with tiny settings, under real mpirun where they need ranks:
each runs and reports its figures in its last line (no timed assertion), and says so clearly when
asked for a GPU that is not there."""
import json
import os
import re
import subprocess
import sys

import pytest
import torch

from tests.support.launch import mpirun
from tests.support.outputs import check_png
from tests.support.paths import ROOT

# Each bench costs a launch or two; the engine they time is tested in unit/ and mpi/.
pytestmark = pytest.mark.extended


def last_json(proc):
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_a_benchmark_rank_that_fails_ends_every_rank():
    """Rank 1 of a benchmark raises while rank 0 waits for it in a collective: the job ends
    with rank 1's traceback instead of running until the test's timeout."""
    proc = mpirun(2, [ROOT / "tests/programs/faulty_bench.py"], timeout=60)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out[-2000:]
    assert "rank 1 failed" in out and "injected benchmark failure" in out, out[-2000:]


def test_bench_scaling_under_mpirun_2(tmp_path):
    # the frameworks' own costs, as the last line of a `bench emulate` run gives them
    emulated = tmp_path / "emulate.txt"
    emulated.write_text("table\n" + json.dumps({"framework": {
        "ours": {"per_message_s": 0.001, "per_step_s": 0.002, "per_op_s": 0.005},
        "pipelining": {"per_message_s": 0.003, "per_step_s": 0.004}}}) + "\n")
    proc = mpirun(2, ["-m", "petra_mpi.bench", "scaling", "--width", "4", "--batch", "4",
                      "--microbatches", "4", "--rounds", "1", "--png", "",
                      "--framework", emulated], timeout=600)
    out = last_json(proc)
    # a record from before the per-operation cost was fitted reads as 0 for it
    assert out["framework"] == {
        "ours": {"per_message": 0.001, "per_step": 0.002, "per_op": 0.005},
        "pipelining": {"per_message": 0.003, "per_step": 0.004, "per_op": 0.0}}
    assert out["bench"] == "scaling" and out["ranks"] == 2
    assert [p["ranks"] for p in out["predictions"]] == list(range(1, 11))
    assert {(v["ranks"], v["method"]) for v in out["validation"]} == {
        (1, "petra"), (1, "backprop"), (2, "petra"), (2, "backprop")}
    assert all(v["measured"] > 0 and v["predicted"] > 0 for v in out["validation"])


@pytest.mark.parametrize("precision,allocator", [("fp32", "glibc-keep"), ("bf16", None)])
def test_bench_pipeline_reports_compute_time_per_rank(precision, allocator):
    """(fp32: under `--allocator glibc-keep`, each rank started again before MPI with glibc's
    thresholds raised; bf16: none chosen, training's default, the same thresholds set in the
    process (run.keep_freed_memory); the JSON says which allocator ran.)"""
    chosen = ["--allocator", allocator] if allocator else []
    proc = mpirun(2, ["-m", "petra_mpi.bench", "pipeline", "--width", "4", "--batch", "4",
                      "--microbatches", "6", "--rounds", "1", "--precision", precision, *chosen],
                  timeout=600)
    out = last_json(proc)
    assert (out["device"], out["transport"], out["precision"]) == ("cpu", "cpu", precision)
    assert out["allocator"] == "glibc-keep"
    for method in ("petra", "backprop"):
        compute = out[f"{method}_compute_ms_per_tick"]
        assert len(compute) == 2 and all(0 < c <= out[f"{method}_wall_ms_per_tick"] for c in compute)
    # the measured speed-up beside what its split allows (fill and drain of 6 included)
    assert 1 < out["speedup_bound"] < out["speedup_bound_steady"] <= 2
    assert out["of_bound"] == pytest.approx(out["speedup"] / out["speedup_bound"])


def test_bench_pipeline_reports_bytes_per_tick_compressed():
    """int8 messages both ways send at least 3.9x fewer bytes per tick on every rank (one byte per
    value instead of four, plus a 4-byte scale per message). Both runs on one fixed split: a
    measured one moves with the machine's load, and the bytes with it."""
    sent = {}
    for compress in ("", "forward=int8,rebuilt=int8,gradient=int8"):
        proc = mpirun(2, ["-m", "petra_mpi.bench", "pipeline", "--width", "4", "--batch", "4",
                          "--microbatches", "6", "--rounds", "1", "--partition", "3,7",
                          "--compress", compress], timeout=600)
        out = last_json(proc)
        assert out["compression"]["forward"] == ("int8" if compress else "none")
        sent[compress] = out["petra_sent_bytes_per_tick"]
    plain, int8 = sent[""], sent["forward=int8,rebuilt=int8,gradient=int8"]
    assert len(plain) == len(int8) == 2 and all(p > 0 for p in plain)
    assert all(0 < c <= p / 3.9 for c, p in zip(int8, plain))


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_bench_overhead_times_a_tick_and_a_plain_step(precision):
    proc = subprocess.run([sys.executable, "-m", "petra_mpi.bench", "overhead", "--width", "4",
                           "--batch", "4", "--repeats", "1", "--threads", "1", "--precision",
                           precision], capture_output=True, text=True, timeout=300, cwd=ROOT)
    out = last_json(proc)
    assert out["bench"] == "overhead" and out["precision"] == precision and out["stages"] == 10
    assert out["petra_tick_s"] > 0 and out["plain_step_s"] > 0
    assert out["ratio"] == pytest.approx(out["petra_tick_s"] / out["plain_step_s"])


def test_bench_overhead_times_the_language_model_on_token_windows():
    proc = subprocess.run([sys.executable, "-m", "petra_mpi.bench", "overhead", "--arch", "revlm",
                           "--width", "16", "--depth", "2", "--heads", "2", "--context", "8",
                           "--batch", "2", "--repeats", "1", "--threads", "1"],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    out = last_json(proc)
    assert out["arch"] == "revlm" and out["stages"] == 4 and out["context"] == 8  # 2 blocks + 2
    assert out["tokens_per_s"] == pytest.approx(2 * 8 / out["petra_tick_s"])
    assert out["ratio"] == pytest.approx(out["petra_tick_s"] / out["plain_step_s"])


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message without CUDA")
@pytest.mark.parametrize("bench", [["overhead"], ["pipeline"], ["data", "synthetic"]])
def test_bench_on_cuda_without_a_gpu_says_so(bench):
    proc = subprocess.run([sys.executable, "-m", "petra_mpi.bench", *bench, "--device", "cuda"],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode != 0 and "no CUDA device" in proc.stderr


def test_bench_data_times_every_loader_and_the_jpeg_path():
    proc = subprocess.run([sys.executable, "-m", "petra_mpi.bench", "data", "synthetic",
                           "--seconds", "0.2", "--synthetic-n", "512", "--batch", "16",
                           "--jpeg-demo", "--crop", "64", "--decode-pool", "thread",
                           "--pipeline", "revnet18", "--pipeline-width", "4"],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    out = last_json(proc)
    assert out["bench"] == "data" and out["device"] == "cpu" and out["jpeg_gpu_decode"] is False
    for key in ("images_per_s", "memory_images_per_s", "eval_images_per_s",
                "jpeg_decode_images_per_s", "jpeg_images_per_s", "jpeg_eval_images_per_s",
                "pipeline_images_per_s"):
        assert out[key] > 0, key
    # what the pipeline consumes next to what the JPEG loader delivers: one stage per block
    assert out["pipeline_split"] == [1] * 10
    assert out["loader_over_pipeline"] == pytest.approx(
        out["jpeg_images_per_s"] / out["pipeline_images_per_s"])


@pytest.mark.extended
def test_bench_peers_on_the_language_model_over_one_transport():
    """--model revlm: PETRA on the reversible LM against the pipelines on the plain LM, fed
    windows of token ids with a label per token; speeds also in tokens per second. With
    --transport torch PETRA's messages go over gloo, as the pipelines' do (the test below
    races over MPI)."""
    proc = mpirun(2, ["-m", "petra_mpi.bench", "peers", "--model", "revlm", "--width", "16",
                      "--depth", "2", "--heads", "2", "--context", "8", "--batch", "4",
                      "--microbatches", "4", "--accumulation", "1", "--rounds", "1",
                      "--threads", "1", "--no-zero-bubble", "--transport", "torch"], timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    record = json.loads(proc.stdout.strip().splitlines()[-1])
    assert record["transport"] == {"ours": "gloo", "pipelining": "gloo"}
    assert "messages: ours over gloo, pipelining over gloo" in proc.stdout
    assert "transport torch.distributed gloo" in proc.stderr
    assert (record["model"], record["plain_model"], record["context"]) == ("revlm", "lm", 8)
    # embedding + 2 decoder blocks + head, on 2 ranks each
    assert sum(record["partition"]) == sum(record["pt_partition"]) == 4
    assert {"petra", "backprop", "gpipe", "1f1b", "1f1b_checkpointed"} <= set(
        record["images_per_s"])
    for name, windows in record["images_per_s"].items():
        assert windows > 0 and record["tokens_per_s"][name] == pytest.approx(8 * windows)
        assert min(record["peak_activation_bytes"][name]) > 0, name
    assert "tokens/s" in proc.stdout
    # the kept variants' splits were the planner's to choose (measured, no --partition)
    for name, kept in record["kept"].items():
        assert sum(kept["partition"]) == 4 and len(kept["plan"]) == 2, name
        assert [len(k) for k in kept["plan"]] == kept["partition"], name


def test_bench_peers_runs_every_contender(tmp_path):
    # the splits given, not measured: what each contender holds, and so PETRA's kept budget,
    # depends on them
    figure = tmp_path / "waterfall.png"
    proc = mpirun(2, ["-m", "petra_mpi.bench", "peers", "--width", "4", "--batch", "8",
                      "--microbatches", "6", "--accumulation", "2", "--rounds", "2",
                      "--threads", "1", "--partition", "3,7", "--pt-partition", "2,8",
                      "--waterfall", str(figure)], timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    record = json.loads(proc.stdout.strip().splitlines()[-1])
    assert f"waterfall: {figure}" in proc.stdout.splitlines()
    assert figure.stat().st_size > 10_000
    # where the time goes: the model at isolated block costs, then what the run added, on the
    # rank that computes most; the steps add up to that rank's measured time, for ours and for
    # every pipeline the model runs (not zero bubble)
    falls = record["waterfall"]
    one_stage_per_rank = {n for n in record["images_per_s"] if not n.startswith(
        ("zero_bubble", "interleaved_1f1b", "zbv", "dualpipev"))}
    assert set(falls) == one_stage_per_rank
    for name, w in falls.items():
        assert w["model_s"] > 0 and w["microbatches"] == 6, name
        assert sum(w["steps_s"].values()) == pytest.approx(w["wall_s"]), name
        busiest = max(w["per_rank"], key=lambda r: r["compute_s"])
        assert w["per_rank"][w["rank"]] == busiest and busiest["wall_s"] == w["wall_s"], name
        for r in w["per_rank"]:
            assert 0 < r["compute_s"] < r["wall_s"] and 0 <= r["wait_s"] < r["wall_s"], name
    assert record["bench"] == "peers" and record["ranks"] == 2
    assert record["transport"] == {"ours": "mpi", "pipelining": "gloo"}
    # the machine and the allocator it ran on
    assert record["machine"]["cores"] >= 1 and record["allocator"] == "glibc-keep"
    # one update per K micro-batches for every contender: a pipelining step runs max(K, J)
    assert record["accumulation"] == 2 and record["pt_microbatches"] == 2
    # the pipelines on PETRA's own net take its split when the splits are given
    assert record["partition"] == [3, 7] and record["pt_partition"] == [2, 8]
    assert record["pt_partition_rev"] == [3, 7]
    # two stages per rank: each given stage's blocks in two
    assert record["pt_partition_two_per_rank"] == {"resnet18": [1, 1, 4, 4],
                                                   "revnet18": [1, 2, 3, 4]}
    ours = {"petra", "backprop", "delayed", "pipedream", "petra_budget_1f1b", "petra_unlimited",
            "petra_rebuild_last", "petra_budget_1f1b_checkpointed"}
    pipelines = {"gpipe", "1f1b", "1f1b_checkpointed", "interleaved_1f1b", "zbv"}
    names = ours | pipelines | {p + "_rev" for p in pipelines}
    ran = set(record["images_per_s"])
    assert names <= ran
    assert ran - names <= {"zero_bubble", "zero_bubble_rev"}
    for zb in ("zero_bubble", "zero_bubble_rev"):
        assert (zb in ran) != (zb in record.get("skipped", {}))
    # DualPipeV needs as many micro-batches per step (2) as pipeline stages (4): it says so
    for name in ("dualpipev", "dualpipev_rev"):
        assert "at least as many microbatches as stages" in record["skipped"][name]
        assert any(ln.split()[:1] == [name] and "did not run: ValueError: DualPipeV requires"
                   in ln for ln in proc.stdout.splitlines()), name
    # two rounds, each contender once in each, in an order shuffled per round
    assert len(record["orders"]) == 2 and record["orders"][0] != record["orders"][1]
    assert all(sorted(order) == sorted(ran) for order in record["orders"])
    for name in ran:
        assert len(record["images_per_s_rounds"][name]) == 2, name
        assert record["images_per_s"][name] == pytest.approx(
            sum(record["images_per_s_rounds"][name]) / 2)
    # which net each contender trains: ours and the *_rev pipelines the reversible one
    assert {n for n in ran if record["net"][n] == "revnet18"} == ours | {
        n for n in ran if n.endswith("_rev")}
    assert {n for n in ran if record["net"][n] == "resnet18"} == {
        n for n in ran if n not in ours and not n.endswith("_rev")}
    # FLOPs per micro-batch: PETRA does more than autograd on the same net (stage 0 rebuilds
    # its reversible blocks and recomputes its stem)
    flops = record["flops_per_microbatch"]
    autograd = flops["revnet18"]["forward"] + flops["revnet18"]["backward"]
    assert flops["revnet18"]["forward"] > 0 and flops["resnet18"]["forward"] > 0
    assert autograd < flops["petra"] < 2 * autograd
    # every contender holds something for backward on every rank (the checkpointed one still
    # keeps its block inputs)
    for name in ran:
        assert record["images_per_s"][name] > 0, name
        peaks = record["peak_activation_bytes"][name]
        assert len(peaks) == 2 and min(peaks) > 0, (name, peaks)
    # ours also in steady state (6 micro-batches, k = 2: stage 0's forwards 2 to 4)
    assert set(record["steady_images_per_s"]) == ours
    for rival in ("1f1b", "1f1b_checkpointed", "1f1b_rev", "1f1b_checkpointed_rev", "zbv_rev",
                  "interleaved_1f1b", "delayed", "pipedream"):
        for key in (f"petra_vs_{rival}", f"steady_petra_vs_{rival}"):
            assert record[key] > 0, key
    # every ratio is taken within a round: its median over the rounds, with the range
    per_round = [m / r for m, r in zip(record["steady_images_per_s_rounds"]["petra"],
                                       record["images_per_s_rounds"]["1f1b_rev"])]
    spread = record["ratios"]["steady_petra_vs_1f1b_rev"]
    assert record["steady_petra_vs_1f1b_rev"] == spread["median"] == pytest.approx(
        sum(per_round) / 2)
    assert (spread["min"], spread["max"]) == pytest.approx((min(per_round), max(per_round)))
    # the table: per contender its net, images/s with the range over the rounds, and its
    # fullest rank first (what a cluster sizes its GPUs for), then every rank
    rows = {}
    for ln in proc.stdout.splitlines():  # the first line of each name (the waterfall's follow)
        if ln.split()[:1] and ln.split()[0] in ran:
            rows.setdefault(ln.split()[0], ln.split())
    for name in ran:
        row, rounds = rows[name], record["images_per_s_rounds"][name]
        assert row[1] == record["net"][name]
        assert float(row[2]) == pytest.approx(record["images_per_s"][name], abs=0.06)
        assert row[3] == f"{min(rounds):.1f}-{max(rounds):.1f}"
        assert float(row[-3]) == pytest.approx(
            max(record["peak_activation_bytes"][name]) / 2**20, abs=0.006), row
    # and the ratios' lines: median (min-max) over the rounds
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("petra / 1f1b_rev "))
    plain = record["ratios"]["petra_vs_1f1b_rev"]
    assert line.split()[3:5] == [f"{plain['median']:.2f}",
                                 f"({plain['min']:.2f}-{plain['max']:.2f});"]
    # PETRA with kept blocks: at a budget of 1F1B's peak on the same net less its own, its kept
    # graphs (activations, stashed weights, inputs) stay within the budget, so it holds at most
    # what 1F1B holds where it keeps anything; only stage 0 has micro-batches in flight at
    # J = 2, and there the budget holds a kept micro-batch of block 1
    peaks, kept = record["peak_activation_bytes"], record["peak_kept_bytes"]
    assert record["kept"]["petra_budget_1f1b"]["budget_from"] == "1f1b_rev"
    budget = record["kept"]["petra_budget_1f1b"]["budget_bytes"]
    assert budget == [max(0, f - p) for f, p in zip(peaks["1f1b_rev"], peaks["petra"])]
    assert kept["petra_budget_1f1b"] == record["kept"]["petra_budget_1f1b"]["planned_kept_bytes"]
    assert kept["petra_budget_1f1b"][0] > 0 and kept["petra_budget_1f1b"][1] == 0
    for r in range(2):
        assert kept["petra_budget_1f1b"][r] <= budget[r]
        assert peaks["petra_budget_1f1b"][r] <= max(peaks["1f1b_rev"][r], peaks["petra"][r])
        assert peaks["petra_budget_1f1b"][r] <= peaks["petra"][r] + kept["petra_budget_1f1b"][r]
    assert peaks["petra_budget_1f1b"][0] <= peaks["1f1b_rev"][0]
    # the last stage rebuilding (model.rebuild_last_stage) holds less there, and the kept plan at
    # checkpointed 1F1B's memory adds to that: at most checkpointed 1F1B's on its fullest rank
    assert peaks["petra_rebuild_last"][1] < peaks["petra"][1]
    checkpointed = record["kept"]["petra_budget_1f1b_checkpointed"]
    assert checkpointed["budget_from"] == "1f1b_checkpointed_rev"
    assert checkpointed["budget_bytes"] == [max(0, f - p) for f, p in zip(
        peaks["1f1b_checkpointed_rev"], peaks["petra_rebuild_last"])]
    assert checkpointed["partition"] == [3, 7]
    assert max(peaks["petra_budget_1f1b_checkpointed"]) <= max(peaks["1f1b_checkpointed_rev"])
    # without a limit it keeps at least as much, and the planner's time is at most PETRA's
    unlimited = record["kept"]["petra_unlimited"]
    assert unlimited["budget_bytes"] is None and unlimited["planned_relative_time"] <= 1
    assert kept["petra_unlimited"] == unlimited["planned_kept_bytes"]
    assert kept["petra_unlimited"][0] >= kept["petra_budget_1f1b"][0]
    assert kept["petra"] == kept["backprop"] == [0, 0]
    # delayed stashes weights and buffers every block's input; PipeDream keeps every graph of
    # stage 0's two in-flight micro-batches: both hold more than PETRA there
    assert peaks["delayed"][0] > peaks["petra"][0]
    assert kept["pipedream"][0] > 0 and peaks["pipedream"][0] > peaks["petra"][0]
    assert kept["pipedream"][1] == 0  # the last stage holds nothing in flight


PEERS_TINY = ["-m", "petra_mpi.bench", "peers", "--width", "4", "--batch", "8",
              "--microbatches", "6", "--accumulation", "2", "--rounds", "1", "--threads", "1"]


def test_bench_peers_one_contender_on_a_saved_layout(tmp_path):
    """--save-layout writes the splits, the kept plans and the block costs; --layout runs on
    them without measuring or planning again, and a run of one contender gives each rank's real
    peak (its process's high-water mark). A layout made for another run is refused in one
    line, exit status 2."""
    layout = tmp_path / "layout.json"
    first = last_json(mpirun(2, [*PEERS_TINY, "--contenders", "petra,petra_budget_1f1b",
                                 "--save-layout", layout], timeout=600))
    saved = json.loads(layout.read_text())
    assert saved["kept"]["petra_budget_1f1b"] == first["kept"]["petra_budget_1f1b"]
    assert saved["splits"]["ours"] == first["partition"] and set(saved["costs"]) == {"8"}
    # the budget came from 1F1B on the same net, built and measured, not timed
    assert set(first["images_per_s"]) == {"petra", "petra_budget_1f1b"}
    proc = mpirun(2, [*PEERS_TINY, "--contenders", "petra_budget_1f1b", "--layout", layout,
                      "--timing-only"], timeout=600)
    again = last_json(proc)
    assert again["kept"]["petra_budget_1f1b"] == first["kept"]["petra_budget_1f1b"]
    assert list(again["images_per_s"]) == ["petra_budget_1f1b"] and again["layout"] == str(
        layout)
    rss = again["peak_rss_bytes"]["petra_budget_1f1b"]
    assert len(rss) == 2 and all(p >= b > 0 for p, b in zip(rss, again["base_rss_bytes"]))
    assert again["peak_activation_bytes"] == {} and "waterfall" not in again  # --timing-only
    line = next(ln for ln in proc.stdout.splitlines() if "real peak (VmHWM)" in ln)
    assert line.split(": ")[1].split()[:2] == [f"{b / 2**20:.1f}" for b in rss]
    other = tmp_path / "other.json"
    other.write_text(json.dumps({**saved, "width": 8}))
    proc = mpirun(2, [*PEERS_TINY, "--contenders", "petra", "--layout", other], timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert f"petra_mpi.bench peers: {other}: made for width 8, this run has 4" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_bench_peers_compiled():
    """--compile: every contender's blocks through torch.compile; the schedules that split the
    backward cannot take compiled stages and say so."""
    proc = mpirun(2, [*PEERS_TINY, "--contenders", "petra,1f1b,zero_bubble", "--compile",
                      "--timing-only", "--partition", "3,7", "--pt-partition", "2,8"],
                  timeout=1200)
    record = last_json(proc)
    assert record["compile"] and set(record["images_per_s"]) == {"petra", "1f1b"}
    assert "torch.compile" in record["skipped"]["zero_bubble"]
    assert "; compiled (torch.compile)" in proc.stdout.splitlines()[0]


def test_bench_race_tunes_plans_and_races_in_rounds(tmp_path):
    """bench race: tuning runs at two micro-batch sizes, each contender at its faster one (and
    net), the kept plan made once from the chosen 1F1B's memory, then rounds of one launch per
    contender; the table reads them. Run again on its output, it launches nothing."""
    out = tmp_path / "race"
    contenders = ["petra", "pipedream", "1f1b", "petra_budget_1f1b", "petra_rebuild_last"]
    argv = [sys.executable, "-m", "petra_mpi.bench", "race", "--rounds", "2", "--batches",
            "8,4", "--update", "16", "--width", "4", "--microbatches", "1",
            "--tune-microbatches", "1", "--threads", "1", "--contenders", ",".join(contenders),
            "--out", str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=1800, cwd=ROOT, env=env)
    record = last_json(proc)
    tuned = {b: json.loads((out / "tune" / f"batch{b}.txt").read_text().splitlines()[-1])
             for b in (8, 4)}
    settings = json.loads((out / "settings.json").read_text())
    # each contender at its faster micro-batch (PETRA's kept variant at PETRA's), 1F1B on its
    # faster net; every tuning run at the same images per update
    assert all(t["batch"] * t["accumulation"] == 16 for t in tuned.values())
    for name in ("petra", "pipedream", "1f1b", "petra_rebuild_last"):
        runs = settings[name]["contender"]
        assert runs in (name, name + "_rev")
        assert settings[name]["batch"] == max(
            tuned, key=lambda b: tuned[b]["images_per_s"].get(runs, 0)), name
    assert settings["petra_budget_1f1b"]["batch"] == settings["petra"]["batch"]
    # the kept plan, made once: 1F1B's activation bytes at its settings less PETRA's at its own
    kept = json.loads((out / "layout_kept.json").read_text())["kept"]["petra_budget_1f1b"]
    rival, b = settings["1f1b"]["contender"], settings["1f1b"]["batch"]
    petra = tuned[settings["petra"]["batch"]]["peak_activation_bytes"]["petra"]
    assert kept["budget_from"] == rival and kept["budget_bytes"] == [
        max(0, f - p) for f, p in zip(tuned[b]["peak_activation_bytes"][rival], petra)]
    # two rounds of one launch per contender, in shuffled orders, each on the fixed layout
    assert len(list((out / "rounds").glob("round*_*.txt"))) == 2 * len(contenders)
    launched = re.findall(r"^bench race: round \d of 2, \d of 5: (\S+) at", proc.stdout, re.M)
    assert sorted(launched[:5]) == sorted(launched[5:]) and launched[:5] != launched[5:]
    assert record["bench"] == "race" and record["rounds"] == 2
    for name in contenders:
        c = record["contenders"][name]
        assert c["runs"] == 2 and len(c["real_peak_bytes"]) == 2, name
        assert c["real_peak_fullest_bytes"] == max(c["real_peak_bytes"]) > 0, name
        assert len(c["peak_activation_bytes"]) == 2, name  # counted in the first round
    ratio = record["ratios"]["petra / 1f1b"]
    assert ratio["of"] == 2 and ratio["min"] <= ratio["median"] <= ratio["max"]
    # the table: a row per contender with its net, micro-batch, k and median images/s
    rows = {}
    for ln in proc.stdout.splitlines():  # the first line of each name (the ratios' follow)
        if ln.split()[:1] and ln.split()[0].lstrip("*") in contenders:
            rows.setdefault(ln.split()[0].lstrip("*"), ln.split())
    for name in contenders:
        c = record["contenders"][name]
        assert rows[name][1:4] == [c["net"], str(c["batch"]), str(c["accumulation"])], name
        assert float(rows[name][4]) == pytest.approx(c["images_per_s"]["median"], abs=0.06)
    assert (out / "race.png").stat().st_size > 10_000
    # the same race again: every launch is on disk, so nothing runs and the figures are the same
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    assert last_json(proc)["contenders"] == record["contenders"]
    assert "bench race: -m" not in proc.stdout


def test_race_script_passes_race_args_after_its_own(tmp_path):
    """scripts/race.sh hands RACE_ARGS to bench race after its own options, so they win: here
    --rounds 0 replaces the script's 5 and the race refuses it in one line, exit status 2,
    before anything is launched."""
    env = {**os.environ, "RACE_ARGS": "--rounds 0 --width 4"}
    proc = subprocess.run(["bash", os.path.join(ROOT, "scripts", "race.sh"), str(tmp_path / "r")],
                          capture_output=True, text=True, timeout=120, cwd=ROOT, env=env)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "--rounds must be at least 1" in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "r").exists()


def test_bench_emulate_under_mpirun_4(tmp_path):
    """The emulated pipeline runs PETRA, backprop and pipelining's schedules on the real engines
    and reports every run with the model beside it (the figures are not checked: no timing);
    PETRA also runs with kept blocks at each contender's memory and without a limit."""
    profile = tmp_path / "costs.json"
    n = 10  # revnet18's blocks
    # block 1 (reversible) does the most work: its stage, a middle one, is the slowest, so a
    # kept plan has something to win back
    forward = [1e-3] * n
    forward[1] = 6e-3
    profile.write_text(json.dumps({"arch": "revnet18", "forward": forward,
                                   "rebuild": forward[:-1] + [0.0],
                                   "backward": [2 * f for f in forward]}))
    proc = mpirun(4, ["-m", "petra_mpi.bench", "emulate", "--costs", profile, "--width", "4",
                      "--batch", "4", "--microbatches", "4,2J", "--segment", "10",
                      "--backprop-segment", "2", "--rounds", "1",
                      "--png", tmp_path / "emulate.png", "--pareto", tmp_path / "pareto.png"],
                  timeout=600)
    out = last_json(proc)
    assert out["bench"] == "emulate" and out["ranks"] == 4 and out["microbatches"] == [4, 8]
    assert out["costs"].startswith("file") and sum(out["split"]) == n
    contenders = [f"{method} m={m}" for method in ("gpipe", "1f1b", "zero_bubble",
                                                   "1f1b_checkpointed") for m in (4, 8)]
    names = {row["name"] for row in out["rows"]} | set(out.get("skipped", {}))
    ran = [c for c in contenders if c not in out.get("skipped", {})]
    assert names == {"petra m=4", "petra m=8", "backprop", *contenders, "petra unlimited",
                     *(f"petra @{c}" for c in ran)}
    for row in out["rows"]:
        assert row["images_per_s"] > 0 and row["predicted_images_per_s"] > 0
        assert len(row["busy_fraction"]) == 4 and all(0 <= b <= 1 for b in row["busy_fraction"])
        assert len(row["peak_held_bytes"]) == 4
    petra = next(row for row in out["rows"] if row["name"] == "petra m=4")
    assert petra["microbatches"] == 10 and petra["bound_images_per_s"] > 0
    # PETRA's first stage buffers the stem's input, its last stage nothing; a plain stage
    # holds what autograd saves
    assert petra["peak_held_bytes"][0] > 0 and petra["peak_held_bytes"][-1] == 0
    gpipe = next(row for row in out["rows"] if row["name"] == "gpipe m=8")
    assert all(b > 0 for b in gpipe["peak_held_bytes"])
    assert {v["name"] for v in out["validation"]} == {row["name"] for row in out["rows"]}
    assert out["overhead"]["ticks"] == 10 + 2 * 3
    # our engine's cost per operation comes from backprop (one rank at a time), and only that
    assert out["framework_from"] == {"ours": "fitted on backprop at zero compute",
                                     "pipelining": "fitted at zero compute"}
    ours = out["framework"]["ours"]
    assert ours["per_message_s"] == 0 and ours["per_step_s"] == 0
    # fitted on one run with one unknown, the cost per operation accounts for backprop's whole
    # zero-cost time beyond the link's: positive (no engine operation is free) and exact
    backprop = next(row for row in out["rows"] if row["name"] == "backprop")
    assert ours["per_op_s"] > 0
    assert backprop["zero_cost_model_s"] == pytest.approx(backprop["zero_cost_s"], rel=1e-3)
    check_png(tmp_path / "emulate.png")
    # kept blocks: each budget run holds PETRA's FIFOs and the kept graphs its plan predicts,
    # within the contender's peak on every rank
    rows = {row["name"]: row for row in out["rows"]}
    plain = rows["petra m=4"]
    for c in ran:
        row = rows[f"petra @{c}"]
        assert row["budget_of"] == c and row["budget_bytes"] == rows[c]["peak_held_bytes"]
        assert row["peak_held_bytes"] == [p + k for p, k in zip(plain["peak_held_bytes"],
                                                                row["planned_kept_bytes"])]
        assert all(p <= b for p, b in zip(row["peak_held_bytes"], row["budget_bytes"]))
        assert row["planned_relative_time"] <= 1
    assert any(any(any(k) for k in rows[f"petra @{c}"]["kept"]) for c in ran)
    # without a limit the slowest stage keeps, and in the model PETRA is then faster
    unlimited = rows["petra unlimited"]
    assert unlimited["budget_bytes"] is None and unlimited["m"] == 4
    assert unlimited["planned_relative_time"] < 1
    assert unlimited["bound_images_per_s"] > plain["bound_images_per_s"]
    assert unlimited["predicted_images_per_s"] >= plain["predicted_images_per_s"]
    # the Pareto front: runs that no other run beats on both memory and images/s
    assert out["pareto"] and set(out["pareto"]) <= set(rows)
    check_png(tmp_path / "pareto.png")
