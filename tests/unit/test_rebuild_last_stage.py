"""model.rebuild_last_stage (core/last_stage.py): off, the last stage runs forward, loss and
backward over its graph as before; on, it holds no graph (a forward as the other stages', the
backward through Stage.backward), gives the graph's gradients and batch-norm statistics up to the
rounding of its rebuilt inputs, holds less, and --dry-run predicts both (under mpirun:
tests/mpi/test_mpi.py, run petra:1:irevnet:rebuild_last)."""
import pytest
import torch
import torch.nn.functional as F

from petra_mpi.config import ConfigError, load_config
from tests.support.nets import stages_of
from petra_mpi.perf.bench.meter import ActivationMeter
from petra_mpi.core.planner import Layout
from petra_mpi.run.dryrun import stage_table
from petra_mpi.run.layout import layout_changes
from tests.support.paths import ROOT

QUICKSTART = ROOT / "configs" / "quickstart.yaml"
SIDE, BATCH = 8, 4
# revnet18: the last of 2 stages alternates reversible and buffered (downsampling) blocks before
# the head; irevnet18: its last stage is reversible blocks one after another, then the head.
ARCHS = ["revnet18", "irevnet18"]


def last_stage(arch, rebuild, J=2):
    stage = stages_of(arch, 4, 10, J, seed=0, dtype=torch.float64, image_size=SIDE,
                         rebuild_last_stage=rebuild)[-1]
    stage.arch = arch  # for microbatches
    return stage


def microbatches(stage, n=2):
    """n (input, labels) of the last stage's input shape (the earlier stages' output)."""
    with torch.no_grad():
        x = torch.zeros(1, 3, SIDE, SIDE, dtype=torch.float64)
        for earlier in stages_of(stage.arch, 4, 10, stage.num_stages, seed=0,
                                    dtype=torch.float64, image_size=SIDE)[:-1]:
            x = earlier.eval().evaluate(x)
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(BATCH, *x.shape[1:], generator=g, dtype=torch.float64),
             torch.randint(0, 10, (BATCH,), generator=g)) for _ in range(n)]


def test_off_by_default_is_the_graph_bitwise():
    """Default: no rebuild (config and stage), and the stage's action is one forward under
    autograd, the loss and one backward, bit for bit."""
    assert load_config(QUICKSTART).model.rebuild_last_stage is False
    stage, plain = last_stage("revnet18", False), last_stage("revnet18", False)
    assert stage.rebuild_last is False
    x, labels = microbatches(stage, 1)[0]
    loss, logits, grad_x = stage.forward_backward_loss(x, labels)
    x_leaf = x.clone().requires_grad_()
    out = x_leaf
    for block in plain.blocks:
        out = block(out)
    F.cross_entropy(out, labels).backward()
    assert torch.equal(logits, out.detach()) and torch.equal(grad_x, x_leaf.grad)
    for p, q in zip(stage.parameters(), plain.parameters()):
        assert torch.equal(p.grad, q.grad)
    for p, q in zip(stage.buffers(), plain.buffers()):
        assert torch.equal(p, q)
    assert stage.peak_fifo_bytes == 0


@pytest.mark.parametrize("arch", ARCHS)
def test_rebuilt_gradients_and_statistics_are_the_graphs(arch):
    """Two micro-batches in float64. Loss and logits bitwise (the same forward); gradients and
    batch-norm running statistics to 1e-11 of the largest gradient (statistic): a reversible block's
    rebuilt input x2 = y1 - F(y2) carries float64 rounding (eps 2.2e-16) through a few
    consecutive blocks (measured: 4e-15 on irevnet18, exactly 0 on revnet18, whose reversible
    blocks each rebuild from a buffered block's exact input); a wrong rule (a block skipped,
    statistics updated twice or not at all) is off by 1e-3 or more. Each batch norm counts
    exactly one update per micro-batch."""
    graph, rebuilt = last_stage(arch, False), last_stage(arch, True)
    assert rebuilt.rebuild_last and not all(rebuilt.buffered[:-1])
    for x, labels in microbatches(graph):
        want, got = graph.forward_backward_loss(x, labels), rebuilt.forward_backward_loss(x, labels)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        close([got[2]], [want[2]])
    close([p.grad for p in rebuilt.parameters()], [p.grad for p in graph.parameters()])
    tracked = [b for n, b in rebuilt.named_buffers() if n.endswith("num_batches_tracked")]
    assert tracked and all(int(t) == 2 for t in tracked)
    close(list(rebuilt.buffers()), list(graph.buffers()))
    # the forward buffered its blocks' inputs (the head's at least) and the backward took them
    assert rebuilt.peak_fifo_bytes > 0 and not any(rebuilt.fifos)


def close(got, want):
    """Each of `got` within 1e-11 of the largest entry of all `want` (a conv bias before a batch
    norm has a gradient of 0 but for rounding, so no tensor is its own scale)."""
    scale = max(w.abs().max().item() for w in want)
    for g, w in zip(got, want, strict=True):
        assert (g - w).abs().max().item() <= 1e-11 * scale


@pytest.mark.parametrize("arch", ARCHS)
def test_the_last_stage_holds_less_and_the_dry_run_says_how_much(arch):
    """Peak bytes held for the backward (ActivationMeter: what autograd saves and the FIFOs
    hold, sampled at every save and between blocks): rebuilding holds the buffered inputs and
    at most one block's graph, under half the graph of the whole part. --dry-run's rows predict
    both: the graph's bytes (from the meter's peak to 10 % above: it counts whole storages where
    the meter counts the bytes the saved views reach) and, rebuilding, the FIFO's exactly."""
    peaks, stages = {}, {}
    for rebuild in (False, True):
        stage = stages[rebuild] = last_stage(arch, rebuild)
        meter = ActivationMeter(stage, lambda s=stage: (t for f in s.fifos for t in f))
        x, labels = microbatches(stage, 1)[0]
        with meter.hooks(), stage.calling_between_blocks(meter.sample):
            stage.forward_backward_loss(x, labels)
        peaks[rebuild] = meter.peak
    assert 0 < peaks[True] < peaks[False] / 2, peaks
    rows = {}
    for rebuild in (False, True):
        cfg = load_config(QUICKSTART, [f"model.arch={arch}", "model.width=4",
                                       f"data.batch_size={BATCH}",
                                       f"model.rebuild_last_stage={str(rebuild).lower()}"])
        layout = Layout(stages[rebuild].partition)
        rows[rebuild] = stage_table(cfg, layout, torch.float64, SIDE)[-1]
    assert rows[True]["graph_bytes"] == 0 and rows[False]["input_fifo_bytes"] == 0
    assert rows[True]["input_fifo_bytes"] == stages[True].peak_fifo_bytes
    assert peaks[False] <= rows[False]["graph_bytes"] <= 1.1 * peaks[False]
    for row in rows.values():
        assert row["last_stage"]["graph_bytes"] == rows[False]["graph_bytes"]
        assert row["last_stage"]["rebuilt_bytes"] == rows[True]["input_fifo_bytes"]


def test_switching_a_built_stage():
    """set_rebuild_last: on the last stage only, with nothing in flight (a benchmark switches
    the stage it reuses)."""
    stages = stages_of("revnet18", 4, 10, 2, seed=0, image_size=SIDE)
    assert [s.rebuild_last for s in stages] == [False, False]
    stages[1].set_rebuild_last(True)
    assert stages[1].rebuild_last
    with pytest.raises(ValueError, match="only the last stage"):
        stages[0].set_rebuild_last(True)
    stages[1].fifos[1].append(torch.zeros(1))
    with pytest.raises(ValueError, match="nothing in flight"):
        stages[1].set_rebuild_last(False)


def test_it_belongs_to_petra():
    for method in ("backprop", "delayed"):
        with pytest.raises(ConfigError) as e:
            load_config(QUICKSTART, ["model.rebuild_last_stage=true", f"train.method={method}"])
        assert str(e.value).endswith(f"model.rebuild_last_stage: belongs to method petra (the "
                                     f"paper's baselines keep the last stage's graph), not "
                                     f"{method}: set it to false")
    assert load_config(QUICKSTART, ["model.rebuild_last_stage=true"]).model.rebuild_last_stage


def test_a_changed_option_is_a_layout_change():
    """A checkpoint of an earlier version records no option: it did not rebuild."""
    old = {"stages": 2, "partition": [2, 8], "kept": None, "memory_budget": 0, "replicas": 1,
           "microbatches_per_epoch": 8, "steps_per_epoch": 8, "peak_lr": 0.1, "device": "cpu",
           "dtype": "float32", "precision": "fp32"}
    new = {**old, "rebuild_last_stage": True}
    assert layout_changes(new, dict(new)) == []
    assert layout_changes(old, {**old, "rebuild_last_stage": False}) == []
    (change,) = layout_changes(old, new)
    assert change.startswith("model.rebuild_last_stage false -> true (the last stage's memory")
    (change,) = layout_changes(new, old)
    assert change.startswith("model.rebuild_last_stage true -> false")


def test_the_measured_split_counts_a_rebuilding_last_stage_in_full():
    from petra_mpi.core.blockcost import BlockCosts
    from petra_mpi.core.planner import plan_layout
    from petra_mpi.models import NetSpec
    # a middle stage costs 4 per block, the last 3 with its graph: [4, 6] (16 against 18); a
    # last stage that rebuilds costs 4 per block too, so the balance is [5, 5]
    costs = BlockCosts(forward=[1.0] * 10, backward=[3.0] * 10, last=[3.0] * 10,
                       step=[0.0] * 10, output_bytes=[1] * 10)
    net = NetSpec("revnet18", 4, 10)
    assert plan_layout(net, 2, costs=costs).split == [4, 6]
    rebuilt = costs.with_rebuilt_last()
    assert rebuilt.last == [4.0] * 10 and rebuilt.forward == costs.forward
    assert plan_layout(net, 2, costs=costs, rebuild_last=True).split == [5, 5]
