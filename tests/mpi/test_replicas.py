"""Data-parallel replicas of the pipeline (issue 11): the layout and its config errors, the
sampler's shares, and under real mpirun the invariants: with lr = 0 the applied gradient is the
end-to-end gradient over every replica's micro-batches; R x J ranks equal the single-process
reference of R replicas (bitwise for R = 2); R = 2, J = 1 on a net without batch norm is plain
SGD on the concatenated batch; stop, checkpoint and resume equal running on. Also the summary's
fields, resuming with another R, and `bench replicas`."""
import json

import pytest
import torch
import torch.nn.functional as F

from petra_mpi.config import ConfigError, load_config, num_replicas, num_stages, validate
from petra_mpi.engines.build import build_workers
from petra_mpi.engines.local import LocalEngine
from petra_mpi.core.optim import StageOptimizer
from tests.support.nets import end_to_end_gradients, max_relative_error
from tests.support.launch import mpirun
from tests.support.paths import PROGRAMS, QUICK, ROOT

from equivalence import eval_batches, optimizer_settings
from replica_run import build, global_batches, schedule, share

SCRIPT = PROGRAMS / "replica_run.py"


# ---------------------------------------------------------------- layout, config, sampler

@pytest.mark.parametrize("size,sets,layout", [
    (4, [], (4, 1)),                                   # no replicas: one stage per rank
    (4, ["model.stages=2"], (2, 2)),
    (4, ["train.replicas=2"], (2, 2)),
    (4, ["model.stages=2", "train.replicas=2"], (2, 2)),
    (4, ["model.stages=1"], (1, 4)),
    (6, ["model.partition=[4, 6]"], (2, 3)),
    (1, ["model.stages=3", "train.replicas=2"], (3, 2)),  # one process: R simulated replicas
])
def test_layout(size, sets, layout):
    cfg = load_config(ROOT / "configs/quickstart.yaml", ["model.stages=0", *sets])
    validate(cfg, size)
    assert (num_stages(cfg, size), num_replicas(cfg, size)) == layout


@pytest.mark.parametrize("size,sets,message", [
    (3, ["model.stages=2"], "not a multiple of 2"),
    (4, ["model.stages=0", "train.replicas=3"], "3 replicas cannot share 4 ranks"),
    (6, ["model.stages=2", "train.replicas=2"], "need 4 ranks"),
    (22, ["model.stages=0", "train.replicas=2"], "run 1 to 10 ranks"),
    (4, ["model.stages=2", "train.diag_every=1"], "without mpirun"),
    (1, ["train.replicas=2", "train.diag_every=1"], "a single replica"),
    (1, ["train.replicas=-1"], "must be >= 0"),
])
def test_layout_errors(size, sets, message):
    with pytest.raises(ConfigError, match=message):
        validate(load_config(ROOT / "configs/quickstart.yaml", sets), size)


def test_sampler_shares_are_disjoint_and_cover_the_epoch():
    from petra_mpi.data import BatchLoader, open_split
    src = open_split("synthetic", "train", synthetic_sizes=(70, 10), seed=0)
    whole = BatchLoader(src, 4, train=True, seed=3, prefetch=0)
    parts = [BatchLoader(src, 4, train=True, seed=3, prefetch=0, shard=(r, 3)) for r in range(3)]
    assert len(whole) == 17 and all(len(p) == 5 for p in parts)  # 17 = 3 * 5 + 2 dropped
    for epoch in (0, 1):
        for r, part in enumerate(parts):
            for i in range(len(part)):
                assert (part.batch_indices(i, epoch) == whole.batch_indices(3 * i + r, epoch)).all()
        seen = [j for p in parts for i in range(len(p)) for j in p.batch_indices(i, epoch)]
        assert len(seen) == len(set(seen)) == 15 * 4
    # the same images and augmentation as the whole epoch's batch, and an exact resume
    for p in parts + [whole]:
        p.load_state_dict({"epoch": 1, "position": 0})
    full = list(whole)
    part = parts[1]
    got = list(part)
    for i, (x, y) in enumerate(got):
        assert torch.equal(x, full[3 * i + 1][0]) and torch.equal(y, full[3 * i + 1][1])
    part.load_state_dict({"epoch": 1, "position": 2})
    assert part.state_dict() == {"epoch": 1, "position": 2}
    assert all(torch.equal(a[0], b[0]) for a, b in zip(part, got[2:]))
    assert part.state_dict() == {"epoch": 2, "position": 0}
    with pytest.raises(ValueError, match="shard"):
        BatchLoader(src, 4, train=False, seed=3, shard=(0, 2))


# ---------------------------------------------------------------- under mpirun

def launch(tmp_path, R, J, method, k, n, *flags):
    proc = mpirun(R * J, [SCRIPT, tmp_path, method, k, n, R, *flags], timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [torch.load(tmp_path / f"rank{r}.pt") for r in range(R * J)]


def local_reference(R, J, method, k, n, dtype=torch.float32, flags=()):
    """The same R replicas in one process (LocalEngine with replicas=R)."""
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    try:
        stages = [s for _ in range(R) for s in build((), J, dtype)]
        engine = LocalEngine(build_workers(stages, schedule(False), k, weight_decay=5e-4,
                                           **optimizer_settings(method, flags)),
                             method, R)
        for seed in (1, 2):
            data = global_batches(R * n, seed, dtype)
            engine.train_segment([iter(share(data, r, R)) for r in range(R)], n)
        evals = [(x.to(dtype), y) for x, y in eval_batches()]
        totals = engine.evaluate(iter(evals), len(evals))
    finally:
        torch.use_deterministic_algorithms(False)
    return stages, totals.result()


def params(state):
    return state["params"]


@pytest.mark.parametrize("R,J,method,k,flags", [
    (2, 2, "petra", 2, ()),
    pytest.param(2, 2, "petra", 1, (), marks=pytest.mark.extended),
    pytest.param(2, 1, "petra", 1, (), marks=pytest.mark.extended),
    pytest.param(2, 2, "backprop", 2, (), marks=pytest.mark.extended),
    # every delay compensation acts after the replicas' average, the same on each replica
    pytest.param(2, 3, "petra", 2, ("compensate",), marks=pytest.mark.extended),
    # over torch.distributed: gloo's sum of two gradients is a + b too
    pytest.param(2, 2, "petra", 2, ("torch",), marks=pytest.mark.extended),
])
def test_replicas_equal_the_local_reference_bitwise(tmp_path, R, J, method, k, flags):
    """R = 2: the transport's sum of two gradients is a + b in either order, as the reference's
    is."""
    n = 5  # with k = 2 the last step of each segment averages one micro-batch per replica
    got = launch(tmp_path, R, J, method, k, n, *flags)
    stages, ref_eval = local_reference(R, J, method, k, n, flags=flags)
    for rank, (state, stage) in enumerate(zip(got, stages)):  # both in rank order
        want = [p.detach() for p in stage.parameters()] + list(stage.buffers())
        assert all(torch.equal(g, w) for g, w in zip(state["params"] + state["buffers"], want)), \
            f"rank {rank} differs from the local reference"
    for s in range(J):
        a, b = got[s], got[J + s]
        assert all(torch.equal(x, y) for x, y in zip(params(a), params(b)))  # identical weights
        # batch norm stays per replica: the running statistics saw different micro-batches
        assert any(not torch.equal(x, y) for x, y in zip(a["buffers"], b["buffers"]))
    initial = build((), J, torch.float32)
    moved = max((p - q).abs().max().item() for s in range(J)
                for p, q in zip(params(got[s]), initial[s].parameters()))
    assert moved > 1e-3
    assert got[J - 1]["eval"] == ref_eval and got[2 * J - 1]["eval"] is None  # replica 0 evaluates


@pytest.mark.extended
def test_without_the_average_replicas_drift_apart(tmp_path):
    """Negative control: the same run with the averaging switched off on every rank."""
    got = launch(tmp_path, 2, 2, "petra", 1, 5, "noreduce")
    stages, _ = local_reference(2, 2, "petra", 1, 5)
    assert not all(torch.equal(g, p.detach()) for g, p in zip(params(got[0]), stages[0].parameters()))
    assert not all(torch.equal(x, y) for x, y in zip(params(got[0]), params(got[2])))


@pytest.mark.extended
def test_four_replicas_agree_with_the_reference_to_rounding(tmp_path):
    """R = 4: MPI associates the sum its own way, so the reference agrees to rounding only; the
    replicas still hold bitwise identical weights (every rank gets the same all-reduce result)."""
    got = launch(tmp_path, 4, 1, "petra", 2, 3, "float64")
    stages, _ = local_reference(4, 1, "petra", 2, 3, torch.float64)
    for state, stage in zip(got, stages):
        for g, w in zip(params(state), stage.parameters()):
            assert torch.allclose(g, w.detach(), rtol=1e-10, atol=1e-12)
    for state in got[1:]:
        assert all(torch.equal(x, y) for x, y in zip(params(state), params(got[0])))


@pytest.mark.extended
def test_lr0_gradient_is_the_end_to_end_gradient_over_all_replicas(tmp_path):
    """Invariant 1 with replicas: every step's gradient, summed over the run, equals the exact
    end-to-end gradient of the groups of R · k micro-batches the replicas shared."""
    R, J, k, n = 2, 2, 2, 5
    got = launch(tmp_path, R, J, "petra", k, n, "lr0", "float64")
    applied = got[0]["applied"] + got[1]["applied"]  # replica 0: stage 0 then stage 1
    want = None
    for seed in (1, 2):
        # replica r's micro-batch i is global micro-batch i·R + r: a group of k per replica is
        # R·k consecutive global ones
        part = end_to_end_gradients("revnet18", R * k, global_batches(R * n, seed, torch.float64))
        want = part if want is None else [a + b for a, b in zip(want, part)]
    assert max_relative_error(applied, want) < 1e-9
    assert all(torch.equal(a, b) for a, b in zip(got[0]["applied"], got[2]["applied"]))
    # negative control: replica 0's micro-batches alone give another gradient
    alone = end_to_end_gradients("revnet18", k, share(global_batches(R * n, 1, torch.float64), 0, R))
    assert max_relative_error(applied, alone) > 1e-3


def sgd_on_concatenated_batches(arch_flags, R, k, n):
    """Plain SGD (the stage optimizer on the whole net) where each step takes one backward of the
    mean loss over the R · k micro-batches the replicas share, concatenated."""
    (net,) = build(arch_flags, 1, torch.float64)
    opt = StageOptimizer(net, schedule(False), 0.9, True, 5e-4)
    for seed in (1, 2):
        data = global_batches(R * n, seed, torch.float64)
        for start in range(0, R * n, R * k):
            x = torch.cat([x for x, _ in data[start:start + R * k]])
            y = torch.cat([y for _, y in data[start:start + R * k]])
            for block in net.blocks:
                x = block(x)
            F.cross_entropy(x, y).backward()
            opt.accumulated()
            opt.step()
    return list(net.parameters())


@pytest.mark.extended
@pytest.mark.parametrize("arch", ["revvit", "revnet18"])
def test_two_replicas_without_batch_norm_are_sgd_on_the_concatenated_batch(tmp_path, arch):
    """The reversible ViT has no batch norm, so averaging two replicas' gradients is SGD on their
    concatenated micro-batches. RevNet18 is the control: its batch norm normalises each
    replica's micro-batch on its own, so there it is not."""
    R, k, n = 2, 2, 5
    got = launch(tmp_path, R, 1, "petra", k, n, "float64", *(("revvit",) if arch == "revvit" else ()))
    want = sgd_on_concatenated_batches((arch,), R, k, n)
    error = max_relative_error(params(got[0]), [p.detach() for p in want])
    if arch == "revvit":
        assert error < 1e-9
    else:
        assert error > 1e-4


# ---------------------------------------------------------------- the trainer

@pytest.mark.extended
def test_trainer_stop_resume_with_two_replicas_equals_running_on(tmp_path):
    """mpirun -n 4 as 2 replicas x 2 stages: SIGUSR1 mid-epoch, resume, and the final checkpoint
    equals an uninterrupted run's (resumed on fewer replicas: test_portable_checkpoint.py)."""
    from test_resume import assert_same_states, events, final_state, finish, launch as train
    from test_resume import stop_mid_epoch
    two = ["--set", "model.stages=2", "--set", "run.checkpoint_every_microbatches=4",
           "--set", "data.synthetic_train=2048"]  # 16 micro-batches of 64 per replica and epoch
    stopped, straight = tmp_path / "stopped", tmp_path / "straight"
    stop_mid_epoch(4, stopped, *two)

    code, log = finish(train(4, stopped, *two, "--set", "run.resume=auto"))
    assert code == 0 and "resumed from" in log, log[-3000:]
    code, log = finish(train(4, straight, *two))
    assert code == 0, log[-3000:]
    assert_same_states(final_state(stopped, 2), final_state(straight, 2))
    summary = json.loads((straight / "summary.json").read_text())
    assert summary["replicas"] == 2 and summary["stages"] == 2
    assert summary["microbatches_per_epoch"] == 16  # per replica: 2048 / 64 / 2
    assert len(summary["memory"]) == 2  # replica 0's stages
    assert summary["history"][0]["images"] == 2 * 16 * 64  # every replica's images
    start = events(straight)[0]
    assert start["event"] == "start" and start["replicas"] == 2


@pytest.mark.extended
def test_one_rank_writes_every_output_with_replicas(tmp_path):
    """2 replicas x 2 stages: metrics.jsonl, summary.json and trace.json (every rank's events)
    all come from one rank, replica 0's last stage, so node-local output directories keep them
    together."""
    proc = mpirun(4, ["-m", "petra_mpi.train", "configs/quickstart.yaml", "--set",
                      f"run.out_dir={tmp_path}", *QUICK, "--set", "model.stages=2",
                      "--set", "run.trace=true"], timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    start = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0])
    trace = json.loads((tmp_path / "trace.json").read_text())
    assert summary["replicas"] == 2 and start["event"] == "start"
    assert summary["writer_rank"] == start["writer_rank"] == trace["otherData"]["writer_rank"] == 1
    processes = {e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "process_name"}
    assert processes == {f"rank {r}" for r in range(4)}


@pytest.mark.extended
def test_world_that_fits_no_layout_fails_on_every_rank_before_work(tmp_path):
    proc = mpirun(3, ["-m", "petra_mpi.train", "configs/quickstart.yaml", "--set",
                      f"run.out_dir={tmp_path}", *QUICK, "--set", "model.stages=2"], timeout=60)
    assert proc.returncode != 0
    assert "not a multiple of 2" in proc.stderr
    assert not (tmp_path / "metrics.jsonl").exists()


def test_one_process_replicas_and_learning_rate_rule(tmp_path):
    """In one process train.replicas=2 runs two replicas; the peak lr uses R · k · batch."""
    from petra_mpi.train import main
    out = tmp_path / "run"
    code = main(["configs/quickstart.yaml", "--set", f"run.out_dir={out}", *QUICK,
                 "--set", "model.stages=2", "--set", "train.replicas=2", "--set", "run.threads=1",
                 "--set", "optim.warmup_epochs=0", "--set", "data.synthetic_train=512"])
    assert code == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["replicas"] == 2 and summary["microbatches_per_epoch"] == 4
    train = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()
             if '"event": "train"' in line]
    assert train[0]["lr"] == pytest.approx(0.1 * 64 * 2 * 2 / 256)  # base · batch · k · R / 256


@pytest.mark.extended
def test_bench_replicas_last_line(tmp_path):
    proc = mpirun(2, ["-m", "petra_mpi.bench", "replicas", "--width", "4", "--batch", "8",
                      "--microbatches", "4", "--rounds", "1"], timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    record = json.loads(proc.stdout.strip().splitlines()[-1])
    assert record["bench"] == "replicas" and (record["replicas"], record["stages"]) == (2, 1)
    assert record["images_per_s"] > 0 and record["single_images_per_s"] > 0
    assert record["efficiency"] == pytest.approx(
        record["images_per_s"] / (2 * record["single_images_per_s"]))
    assert record["independent_images_per_s"] > 0 and record["ceiling"] == pytest.approx(
        record["independent_images_per_s"] / (2 * record["single_images_per_s"]))


def test_replicas_config_is_table2_with_twice_the_batch():
    """configs/replicas: 2 x 18 ranks, Table 2's k (the staleness in optimizer steps), and the lr
    rule on the effective batch R · k · 64."""
    from petra_mpi.run.assemble import run_lr_schedule
    ours = load_config(ROOT / "configs/replicas/revnet50_imagenet_2x18.yaml")
    table2 = load_config(ROOT / "configs/table2/imagenet/revnet50_petra.yaml")
    validate(ours, 36)
    assert (num_stages(ours, 36), num_replicas(ours, 36)) == (18, 2)
    assert ours.train.accumulation == table2.train.accumulation == 32
    assert run_lr_schedule(ours, 100, 2).peak == 2 * run_lr_schedule(table2, 100).peak == 1.6
