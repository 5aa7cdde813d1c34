"""bench peers under real mpirun with tiny settings: every contender runs and reports (no timed
assertions: the figures depend on the machine)."""
import json

from conftest import mpirun


def test_bench_peers_runs_every_contender():
    proc = mpirun(2, ["-m", "petra_mpi.bench", "peers", "--width", "4", "--batch", "8",
                      "--microbatches", "6", "--accumulation", "2", "--rounds", "1",
                      "--threads", "1"], timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    record = json.loads(proc.stdout.strip().splitlines()[-1])
    assert record["bench"] == "peers" and record["ranks"] == 2
    # one update per K micro-batches for every contender: a pipelining step runs max(K, J)
    assert record["accumulation"] == 2 and record["pt_microbatches"] == 2
    for split in (record["partition"], record["pt_partition"]):  # each net's own balance
        assert len(split) == 2 and sum(split) == 10 and min(split) >= 1
    names = {"petra", "backprop", "gpipe", "1f1b", "1f1b_checkpointed"}
    ran = set(record["images_per_s"])
    assert names <= ran
    assert ran - names <= {"zero_bubble"}
    assert ("zero_bubble" in ran) != ("zero_bubble" in record.get("skipped", {}))
    for name in ran:
        assert record["images_per_s"][name] > 0, name
        peaks = record["peak_activation_bytes"][name]
        assert len(peaks) == 2 and min(peaks) >= 0, name
    assert record["peak_activation_bytes"]["petra"][0] > 0
    # every contender holds something for backward on every rank but the checkpointed one
    # still keeps its block inputs
    assert min(record["peak_activation_bytes"]["1f1b_checkpointed"]) > 0
    assert record["petra_vs_1f1b"] > 0 and record["petra_vs_1f1b_checkpointed"] > 0
