"""`python -m petra_mpi.bench link` for real: two ranks in network namespaces of their own, MPI
over TCP on their eth0, one point with no limit and one at 100 Mbit/s (tc). The messages
cross the interfaces, the limit slows PETRA to at most the link's pace, the model's bytes are
the bench's, and the namespaces are gone afterwards, also when the run fails."""
import json
import subprocess
import sys

import pytest

from petra_mpi.perf import netns
from petra_mpi.core.schedule import num_ticks
from tests.support.paths import ROOT

pytestmark = pytest.mark.extended  # three mpirun launches in namespaces: about 35 s

# RevNet18 at width 8, micro-batches of 16, split after block 2: each backward of stage 1 sends
# 2 x 1.05 MB (x̃ and δ), 168 ms at 100 Mbit/s, 5-10x the stages' compute per tick (10-30 ms
# here, the more the busier the machine)
SIZE = ["--width", "8", "--batch", "16", "--microbatches", "8", "--rounds", "1",
        "--partition", "2,8", "--threads", "1"]
RATE = 100e6


def ours() -> set:
    """The namespaces and links the bench makes (names start with its prefix, or the bridge's)."""
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
    return ({n for n in names if n.startswith("petralink")}
            | {line.split(":")[1].strip().split("@")[0] for line in links.splitlines()
               if line.split(":")[1].strip().startswith("pbr")})


@pytest.fixture
def namespaces_allowed():
    why = netns.missing()
    if why:
        pytest.skip(f"bench link needs network namespaces and tc: {why}")
    before = ours()
    yield
    assert ours() == before, "the bench left namespaces or links behind"


def bench_link(tmp_path, *args, timeout=120):
    return subprocess.run([sys.executable, "-m", "petra_mpi.bench", "link", "--out",
                           str(tmp_path), "--png", str(tmp_path / "sweep.png"), *args],
                          capture_output=True, text=True, timeout=timeout, cwd=ROOT)


def test_a_limited_link_slows_petra_to_its_pace_and_the_bytes_cross_it(namespaces_allowed,
                                                                     tmp_path):
    proc = bench_link(tmp_path, "--rates", "none,100mbit", "--compress", "", *SIZE)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    free, slow = sorted(out["points"], key=lambda p: p["rate"] != "none")
    assert (free["rate"], slow["rate"]) == ("none", "100mbit")
    for p in (free, slow):
        # every message crossed the veths (no shared memory), with little more than headers
        assert all(sent >= payload for sent, payload in zip(p["eth0_sent_bytes"],
                                                             p["payload_bytes"])), p
        assert sum(p["eth0_sent_bytes"]) <= 1.25 * sum(p["payload_bytes"]), p
        # the model's messages are the ones the bench sent
        assert p["model_sent_bytes_per_tick"] == pytest.approx(p["sent_bytes_per_tick"],
                                                               rel=0.01)
    # stage 1 sends x̃ and δ of every micro-batch: at 100 Mbit/s, this long per micro-batch
    J, n = 2, 8
    down = free["sent_bytes_per_tick"][1] * num_ticks("petra", J, n) / n
    link_s = down * 8 / RATE
    record = json.loads((tmp_path / "plain_none.json").read_text())["pipeline"]
    compute_s = max(record["petra_compute_ms_per_tick"]) / 1e3
    assert link_s >= 3 * compute_s, ("the size no longer makes the link the bottleneck",
                                     link_s, compute_s)
    # no faster than the wire allows (n messages in a row), and well below no limit
    assert slow["petra_images_per_s"] <= 1.05 * n * 16 / (n * link_s)
    assert free["petra_images_per_s"] >= 1.5 * slow["petra_images_per_s"], (free, slow)
    assert (tmp_path / "sweep.png").stat().st_size > 0


def test_a_failing_run_leaves_no_namespace(namespaces_allowed, tmp_path):
    proc = bench_link(tmp_path, "--rates", "none", "--compress", "", "--arch", "nosuchnet",
                      *SIZE)
    assert proc.returncode != 0
    assert "pipeline failed" in proc.stderr, proc.stderr[-3000:]
