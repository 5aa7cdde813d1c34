"""`bench project`: the performance model at cluster scale (perf/bench/project.py), its pieces in
perf/model.py (busy links, the ring all-reduce, zero bubble's order) checked by hand on tiny
cases, and its memory against the emulation's own counts on a real tiny network."""
import pytest

from petra_mpi.perf import model as perfmodel
from petra_mpi.perf.bench import project
from petra_mpi.models import build_blocks
from petra_mpi.perf.emulation import fifo_bytes

IDEAL = perfmodel.Link(0.0, float("inf"))


def petra_two_stages(grad_bytes=0):
    """Stage 0: forward 1 s, backward 3 s; stage 1 (last): forward, loss and backward 2 s."""
    stages = [perfmodel.StageCosts(1.0, 3.0, 4.0, 0.0, 10, 0),
              perfmodel.StageCosts(1.0, 1.0, 2.0, 0.0, 10, 20)]
    return project.Contender("petra", "petra", stages, [grad_bytes] * 2, [0, 0], [0, 0])


def test_ideal_link_matches_the_hand_computation():
    # PETRA's steady tick is its slowest stage's work: 4 s per micro-batch of 8, per replica
    rate, seconds = project.throughput(petra_two_stages(), 1, 2, IDEAL, 8, 2)
    assert rate == pytest.approx(8 / 4.0)
    assert seconds > project.EPOCH_IMAGES / rate  # plus one fill and drain
    assert project.throughput(petra_two_stages(), 3, 2, IDEAL, 8, 2)[0] == pytest.approx(6.0)
    # 1F1B and zero bubble: forward 1, backward 2 (weight part 1) on both stages, m = 4: 1F1B
    # takes (m + J - 1)(f + b) = 15 s per step, the bubble a fifth of it
    plain = [perfmodel.StageCosts(1.0, 2.0, 3.0, 0.0, 10, 10, weight=1.0)] * 2
    one_f = project.Contender("1f1b", "1f1b", plain, [0, 0], [0, 0], [0, 0])
    assert project.throughput(one_f, 1, 2, IDEAL, 8, 4)[0] == pytest.approx(4 * 8 / 15)
    # zero bubble: stage 1 runs its weight parts late, so stage 0 never waits but once, for
    # stage 1's first forward (1 s) before its first input gradient: 4 x 3 + 1 = 13 s
    zero = project.Contender("zb", "zero_bubble", plain, [0, 0], [0, 0], [0, 0])
    assert project.throughput(zero, 1, 2, IDEAL, 8, 4)[0] == pytest.approx(4 * 8 / 13)
    # data parallelism on the same 2 GPUs: each runs ceil(m / J) = 2 micro-batches of the
    # whole net (3 + 3 s each) per step
    whole = [perfmodel.StageCosts(2.0, 4.0, 6.0, 0.0, 0, 0)]
    dp = project.Contender("dp", "dp", whole, [0], [0], [0])
    assert project.throughput(dp, 1, 2, IDEAL, 8, 4)[0] == pytest.approx(2 * 2 * 8 / 12)


def test_the_all_reduce_makes_replicas_sublinear_on_a_slow_link_only():
    c = petra_two_stages(grad_bytes=1e9)
    fast, slow = perfmodel.Link(0.0, 1e15), perfmodel.Link(1e-3, 1e9)
    one = project.throughput(c, 1, 2, fast, 8, 2)[0]
    for r in (2, 4, 16):
        assert project.throughput(c, r, 2, fast, 8, 2)[0] == pytest.approx(r * one, rel=1e-4)
    # slow: each stage's step (every k = 2 micro-batches) waits for its ring all-reduce,
    # 2 (R - 1) (latency + bytes / R / bandwidth): stage 0's steady micro-batch takes 4 + that / 2
    for r in (2, 4):
        allreduce = 2 * (r - 1) * (1e-3 + 1e9 / r / 1e9)
        rate = project.throughput(c, r, 2, slow, 8, 2)[0]
        assert rate == pytest.approx(r * 8 / (4 + allreduce / 2))
        assert rate < 0.9 * r * project.throughput(c, 1, 2, slow, 8, 2)[0]


def test_busy_links_carry_one_message_at_a_time():
    # messages of 3 s on the wire against 1 s of compute: the link sets the pace
    stages = [perfmodel.StageCosts(1.0, 0.0, 0.0, 0.0, 3, 0), perfmodel.StageCosts(1.0, 0.0, 1.0,
                                                                                   0.0, 0, 0)]
    orders = [[("forward", b) for b in range(10)], [("forward", b) for b in range(10)]]
    link = perfmodel.Link(0.5, 1.0)
    # the last message leaves at 1 + 3 x 10 - 3 = 28 s, is off the wire at 31, arrives 31.5
    assert perfmodel.simulate(orders, stages, link, busy_links=True) == pytest.approx(32.5)
    # without: every message 3.5 s after its forward, the last at 10 + 3.5
    assert perfmodel.simulate(orders, stages, link) == pytest.approx(14.5)


def test_zero_bubble_order_is_torchs():
    schedules = pytest.importorskip("torch.distributed.pipelining.schedules")
    for J, m in ((4, 8), (5, 3), (18, 32)):
        for rank in range(J):
            warmup = schedules._get_warmup_ops(rank, 1, m // max(1, m // J), J, m,
                                               multiply_factor=1)
            ops = schedules._get_1f1b_rank_ops(1, J, warmup, m - warmup, warmup, rank,
                                               lambda _: rank, lambda _: rank, rank,
                                               enable_zero_bubble=True)
            theirs = [(str(a.computation_type).split(".")[-1].lower(), a.microbatch_index)
                      for a in ops if a is not None]
            assert perfmodel.zero_bubble_order(J, m)[rank] == theirs + [("step", m)]


def test_memory_per_gpu_on_a_tiny_revnet():
    a = project.parse_args(["--arch", "revnet18", "--stages", "10", "--width", "4",
                            "--batch", "4", "--image-size", "32", "--num-classes", "10",
                            "--costs", "balanced", "--microbatches", "8"])
    profile = project.cost_profile(a)
    net, shapes = project.describe(a, profile)
    by_name = {c.name: c for c in project.contenders(a, net, shapes, profile)}
    J, saved = len(net.sizes), project.per_stage(net, net.saved_bytes)
    # PETRA holds its FIFOs (as the emulation counts them); 1F1B J - s micro-batches' graphs
    assert by_name["petra"].held == fifo_bytes(shapes, net.sizes, a.batch)
    assert by_name["1f1b"].held == [(J - s) * saved[s] for s in range(J)]
    assert by_name["zero_bubble"].held == [J * saved[s] for s in range(J)]
    # the fullest rank: PETRA's below 1F1B's; kept graphs only add; dp holds the whole net
    assert max(by_name["petra"].memory) < max(by_name["1f1b"].memory)
    assert all(k >= p for k, p in zip(by_name["petra @unlimited"].held,
                                      by_name["petra"].held))
    assert max(by_name["petra @unlimited"].held) > max(by_name["petra"].held)
    assert by_name["dp"].memory == [3 * sum(net.param_bytes) + sum(net.saved_bytes)]
    # a kept plan under 1F1B's held bytes keeps within them on every rank
    assert all(k <= max(f, b) for k, f, b in zip(by_name["petra @1f1b"].held,
                                                 by_name["petra"].held, by_name["1f1b"].held))
    weights = sum(p.numel() for b in build_blocks("revnet18", 4, 10) for p in b.parameters())
    assert sum(net.param_bytes) == 4 * weights
