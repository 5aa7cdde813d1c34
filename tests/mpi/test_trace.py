"""run.trace: the per-rank Chrome-trace timeline (petra_mpi/core/trace.py) from real runs, under
mpirun and in one process, its drawing by the plot command, and nothing when it is off."""
import json
import subprocess
import sys
from collections import Counter

import pytest

from tests.support.launch import mpirun, run_plot
from tests.support.outputs import check_png
from tests.support.paths import QUICK, ROOT

from petra_mpi.core import trace
from petra_mpi.core.schedule import Action, Kind

MICROBATCHES = 6
SHORT = QUICK + ["--set", f"train.limit_batches={MICROBATCHES}", "--set",
                 "train.limit_eval_batches=2"]


def train_args(out_dir, *extra):
    return ["-m", "petra_mpi.train", "configs/quickstart.yaml", *SHORT, "--set",
            f"run.out_dir={out_dir}", *extra]


def spans_of(out_dir):
    with open(out_dir / "trace.json") as f:
        data = json.load(f)  # it parses
    return [e for e in data["traceEvents"] if e["ph"] == "X"]


def check_spans(spans, pids):
    """Every rank's spans, each forward and backward at its tick of PETRA's schedule (one stage
    per pid) and measured within that tick's plan span."""
    assert {e["pid"] for e in spans} == set(pids)
    assert all(e["ts"] >= 0 for e in spans)
    kinds = Counter(e["cat"] for e in spans)
    for kind in ("forward", "backward", "step", "loss", "plan"):
        assert kinds[kind] > 0, kind
    forwards = Counter(e["pid"] for e in spans if e["cat"] == "forward")
    assert all(forwards[p] == MICROBATCHES for p in pids), forwards
    J = len(pids)
    plans = {(e["pid"], e["args"]["tick"]): e for e in spans if e["cat"] == "plan"}
    assert len(plans) == kinds["plan"]  # one segment: one plan span per rank and tick
    for e in spans:
        if e["cat"] not in ("forward", "backward"):
            continue
        s, b, tick = e["pid"], e["args"]["microbatch"], e["args"]["tick"]
        assert 0 <= b < MICROBATCHES, e
        # design.md: stage s forwards micro-batch b at tick b + s and backwards it at tick
        # b + 2(J - 1) - s (the last stage both at once)
        assert tick == (b + s if e["cat"] == "forward" else b + 2 * (J - 1) - s), e
        # the clock: a span takes time and lies within its tick's plan span (0.01 us: rounding)
        plan = plans[(s, tick)]
        assert e["dur"] > 0 and plan["ts"] <= e["ts"], (e, plan)
        assert e["ts"] + e["dur"] <= plan["ts"] + plan["dur"] + 0.01, (e, plan)


@pytest.mark.extended
def test_traced_mpi_run_has_every_rank_and_kind_and_plots(tmp_path):
    proc = mpirun(3, train_args(tmp_path, "--set", "run.trace=true"), timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    spans = spans_of(tmp_path)
    check_spans(spans, range(3))
    waits = [e for e in spans if e["cat"] == "wait"]
    assert {e["pid"] for e in waits} == {0, 1, 2}
    # every stream shows up, with message sizes
    assert {e["name"] for e in waits} >= {"activation in", "gradient in", "labels in",
                                          "activation out", "gradient out", "labels out"}
    assert all(e["args"]["bytes"] > 0 for e in waits if e["name"].endswith(" in"))
    # the loss is computed on the last rank only
    assert {e["pid"] for e in spans if e["cat"] == "loss"} == {2}
    proc = run_plot(tmp_path)
    assert proc.returncode == 0, proc.stderr
    check_png(tmp_path / "timeline.png")


@pytest.mark.extended  # the other traced runs are the default selection's
def test_traced_compressed_mpi_run_counts_the_bytes_sent(tmp_path):
    """With int8 activations and bf16 gradients the messages' sizes are the compressed ones, the
    plan spans carry the bytes each rank sent per tick, and the run log says what is in force."""
    proc = mpirun(2, train_args(tmp_path, "--set", "run.trace=true", "--set",
                                "comm.forward=int8", "--set", "comm.gradient=bf16"), timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "compression forward int8, rebuilt none, gradient bf16, buffers none" in proc.stderr
    spans = spans_of(tmp_path)
    waits = [e for e in spans if e["cat"] == "wait" and e["args"].get("microbatch", -1) >= 0]
    sizes = {(e["pid"], e["name"]): e["args"]["bytes"] for e in waits if "bytes" in e["args"]}
    activation, gradient = sizes[(1, "activation in")], sizes[(0, "gradient in")]
    # int8: one byte per value and a 4-byte scale; the gradient has the activation's shape and
    # two bytes per value in bf16
    assert gradient == 2 * (activation - 4) and sizes[(0, "activation out")] == activation
    assert sizes[(1, "gradient out")] == gradient
    # each tick's plan span holds what its rank sent in it: the forward ticks of rank 0 one
    # activation (and the labels), the backward ticks of rank 1 one gradient (and ỹ, float32),
    # the other ticks nothing
    sent_in_tick = Counter()
    for e in spans:
        if e["cat"] == "wait" and e["name"].endswith(" out") and "tick" in e["args"]:
            sent_in_tick[(e["pid"], e["args"]["tick"])] += e["args"]["bytes"]
    plans = [e for e in spans if e["cat"] == "plan"]
    assert {e["pid"] for e in plans} == {0, 1}
    for e in plans:
        sends = "F" in e["name"] if e["pid"] == 0 else "B" in e["name"]
        least = (activation if e["pid"] == 0 else gradient) if sends else 0
        assert e["args"]["bytes"] == sent_in_tick[(e["pid"], e["args"]["tick"])], e
        assert e["args"]["bytes"] >= least and (e["args"]["bytes"] > 0) == sends, e
    sent = sum(e["args"]["bytes"] for e in spans if e["cat"] == "plan" and e["pid"] == 0)
    assert sent == sum(e["args"]["bytes"] for e in waits if e["pid"] == 0
                       and e["name"].endswith(" out"))


@pytest.mark.extended
def test_traced_one_process_run_gives_each_stage_a_pid(tmp_path):
    cmd = [sys.executable, *train_args(tmp_path, "--set", "run.trace=true", "--set",
                                       "model.stages=3")]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    spans = spans_of(tmp_path)
    check_spans(spans, range(3))
    assert not [e for e in spans if e["cat"] == "wait"]  # no MPI in one process
    # one process, one clock: the stages' spans never overlap
    work = sorted((e["ts"], e["ts"] + e["dur"]) for e in spans
                  if e["cat"] in ("forward", "backward", "step", "loss"))
    assert all(a[1] <= b[0] + 1e-3 for a, b in zip(work, work[1:]))


@pytest.mark.extended
def test_no_trace_when_off(tmp_path):
    proc = mpirun(2, train_args(tmp_path), timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (tmp_path / "summary.json").is_file()
    assert not (tmp_path / "trace.json").exists()


def test_null_tracer_allocates_nothing():
    """Off costs a method call and a shared null context per operation: the same objects."""
    t = trace.NULL_TRACER
    assert t.span("forward", 3) is t.span("backward", 4)
    actions = [Action(Kind.FORWARD, 0, 0)]
    assert t.plan(0, actions) is actions
    fn = print
    assert t.wrap_callback("log", fn) is fn
