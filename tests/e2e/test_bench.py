"""The benchmarks (petra_mpi.bench) with tiny settings, under real mpirun where they need ranks:
each runs and reports its figures in its last line (no timed assertion), and says so clearly when
asked for a GPU that is not there."""
import json
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
                      "--microbatches", "6", "--accumulation", "2", "--rounds", "1",
                      "--threads", "1", "--partition", "3,7", "--pt-partition", "2,8",
                      "--waterfall", str(figure)], timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    record = json.loads(proc.stdout.strip().splitlines()[-1])
    assert f"waterfall: {figure}" in proc.stdout.splitlines()
    assert figure.stat().st_size > 10_000
    # where the time goes: the model at isolated block costs, then what the run added, on the
    # rank that computes most; the steps add up to that rank's measured time, for ours and for
    # every pipeline the model runs (not zero bubble)
    falls = record["waterfall"]
    assert set(falls) == {n for n in record["images_per_s"] if not n.startswith("zero_bubble")}
    for name, w in falls.items():
        assert w["model_s"] > 0 and w["microbatches"] == 6, name
        assert sum(w["steps_s"].values()) == pytest.approx(w["wall_s"]), name
        busiest = max(w["per_rank"], key=lambda r: r["compute_s"])
        assert w["per_rank"][w["rank"]] == busiest and busiest["wall_s"] == w["wall_s"], name
        for r in w["per_rank"]:
            assert 0 < r["compute_s"] < r["wall_s"] and 0 <= r["wait_s"] < r["wall_s"], name
    assert record["bench"] == "peers" and record["ranks"] == 2
    assert record["transport"] == {"ours": "mpi", "pipelining": "gloo"}
    # one update per K micro-batches for every contender: a pipelining step runs max(K, J)
    assert record["accumulation"] == 2 and record["pt_microbatches"] == 2
    # the pipelines on PETRA's own net take its split when the splits are given
    assert record["partition"] == [3, 7] and record["pt_partition"] == [2, 8]
    assert record["pt_partition_rev"] == [3, 7]
    ours = {"petra", "backprop", "petra_budget_1f1b", "petra_unlimited", "petra_rebuild_last",
            "petra_budget_1f1b_checkpointed"}
    pipelines = {"gpipe", "1f1b", "1f1b_checkpointed"}
    names = ours | pipelines | {p + "_rev" for p in pipelines}
    ran = set(record["images_per_s"])
    assert names <= ran
    assert ran - names <= {"zero_bubble", "zero_bubble_rev"}
    for zb in ("zero_bubble", "zero_bubble_rev"):
        assert (zb in ran) != (zb in record.get("skipped", {}))
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
    for rival in ("1f1b", "1f1b_checkpointed", "1f1b_rev", "1f1b_checkpointed_rev"):
        for key in (f"petra_vs_{rival}", f"steady_petra_vs_{rival}"):
            assert record[key] > 0, key
    assert record["steady_petra_vs_1f1b_rev"] == pytest.approx(
        record["steady_images_per_s"]["petra"] / record["images_per_s"]["1f1b_rev"])
    # the table gives each contender's fullest rank first (what a cluster sizes its GPUs for)
    for name in ran:
        row = next(ln.split() for ln in proc.stdout.splitlines() if ln.split()[:1] == [name])
        assert float(row[-3]) == pytest.approx(
            max(record["peak_activation_bytes"][name]) / 2**20, abs=0.006), row
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
