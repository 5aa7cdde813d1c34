"""The MPI engine under real mpirun: invariant 3 (same parameters as the single-process engine,
bitwise on CPU: RevNet18 with each method, the reversible ViT, bf16; over MPI and over
torch.distributed), faults that must end every rank, bad world sizes, and the transport's real
messages."""
import json
import os
import sys

import pytest
import torch

from petra_mpi.comm.compress import NO_COMPRESSION
from petra_mpi.engines.build import build_workers
from tests.support.nets import stages_of
from petra_mpi.engines.local import LocalEngine
from petra_mpi.core.optim import LRSchedule

from tests.support.launch import mpirun
from tests.support.outputs import check_run_outputs
from tests.support.paths import PROGRAMS, QUICK, ROOT
from tests.support.own_nets import forget_package, write_package
from equivalence import (COMPRESSED, REVVIT, accumulation_of, arch_of, batches, eval_batches,
                         optimizer_settings)


def flat(params):
    return torch.cat([p.detach().reshape(-1) for p in params])


def local_reference(J, method, k, n, short_eval=False, arch="revnet18",
                    compression=NO_COMPRESSION, run_flags=(), **flags):
    """run_flags: the run's flags, for its optimizer (equivalence.optimizer_settings)."""
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    try:
        stages = stages_of(arch, 4, 10, J, seed=0, compression=compression, **flags)
        workers = build_workers(stages, LRSchedule(0.3, 4, warmup_epochs=1, milestones=(2,)), k,
                                weight_decay=5e-4, **optimizer_settings(method, run_flags))
        engine = LocalEngine(workers, method, compression=compression)
        engine.train_segment(batches(n), n)
        engine.train_segment(batches(n, seed=2), n)
        totals = engine.evaluate(eval_batches(short_eval), 3 + short_eval)
    finally:
        torch.use_deterministic_algorithms(False)
    return stages, totals.result()


N = 6  # micro-batches per segment in every run of equivalence.py
EXTENDED = pytest.mark.extended
# The runs of equivalence.py, by world size: one launch per size trains them all in turn.
RUNS = {
    2: ["petra:1", "backprop:1", "delayed:2:buffer",
        "petra:1:irevnet:rebuild_last",  # its last stage: reversible blocks one after another
        "petra:2:own",  # a network of one's own, imported from a package written for the test
        "petra:2:torch:short_eval"],  # over torch.distributed (gloo): a header per message
    3: ["petra:2", "backprop:2", "delayed:1:buffer:stash",
        "petra:1:short_eval",  # evaluation's last batch has 2 samples, not 4
        "petra:2:revvit", "petra:2:bf16",
        "petra:2:irevnet",  # the fully invertible net: every stage but the stem's rebuilds
        "petra:2:compress:short_eval",  # every compression format, stochastic rounding on
        "petra:2:compensate",  # every delay compensation at once
        "petra:u16"],  # k from train.update_batch: 16 images per update in micro-batches of 4
    4: ["petra:1", "petra:2", "backprop:1", "delayed:2:stash", "delayed:1:buffer:compress",
        "petra:1:compensate:adamw", "delayed:2:buffer:stash:compensate",
        "petra:2:torch:compress:short_eval", "backprop:1:torch"],
}


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    """launched(J, run): the folder of that run's rank{r}.pt, from one mpirun -n J of all
    RUNS[J] (launched the first time a test asks for J). The package of the network of one's
    own is written into a temporary folder on the ranks' Python path (with the repository's,
    where the program finds its name) and this process's."""
    outs = {}
    root = tmp_path_factory.mktemp("own_package")
    write_package(root)
    sys.path.insert(0, str(root))
    path = os.pathsep.join([str(root), str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])

    def folder(J, run):
        if J not in outs:  # a failed launch is kept too: every test of that size reports it
            out = tmp_path_factory.mktemp(f"equivalence{J}")
            outs[J] = out, mpirun(J, [PROGRAMS / "equivalence.py", out, N, *RUNS[J]], timeout=300,
                                  env={"PYTHONPATH": path})
        out, proc = outs[J]
        assert proc.returncode == 0, proc.stderr[-3000:]
        return out / run
    yield folder
    sys.path.remove(str(root))
    forget_package()


def revnet_runs(J, marks=()):
    return [pytest.param(J, run, marks=marks, id=f"{J}-{run}") for run in RUNS[J]
            if "revvit" not in run and "bf16" not in run]


@pytest.mark.parametrize("J,run", revnet_runs(2) + revnet_runs(3) + revnet_runs(4, EXTENDED))
def test_invariant3_mpi_equals_local_bitwise(launched, J, run):
    method, k, *flags = run.split(":")
    k = accumulation_of(k)
    if run == "petra:u16":
        assert k == 4  # the config's k: 16 images per update, 4 a micro-batch
    out = launched(J, run)
    arch = arch_of(flags)
    stages, ref_eval = local_reference(J, method, k, N, short_eval="short_eval" in flags,
                                       arch=arch, buffer_inputs="buffer" in flags,
                                       stash_weights="stash" in flags,
                                       compression=COMPRESSED if "compress" in flags else
                                       NO_COMPRESSION, run_flags=flags,
                                       rebuild_last_stage="rebuild_last" in flags)
    initial = stages_of(arch, 4, 10, J, seed=0)
    moved = 0.0
    for r in range(J):
        got = torch.load(out / f"rank{r}.pt")
        want_p = [p.detach() for p in stages[r].parameters()]
        want_b = list(stages[r].buffers())
        assert len(got["params"]) == len(want_p) and len(got["buffers"]) == len(want_b)
        for g, w in zip(got["params"] + got["buffers"], want_p + want_b):
            assert torch.equal(g, w), f"rank {r} differs from the local engine"
        assert got["peak_fifo_bytes"] == stages[r].peak_fifo_bytes
        moved = max(moved, max((p - q).abs().max().item() for p, q in
                               zip(want_p, initial[r].parameters())))
    assert moved > 1e-3  # it trained
    if "rebuild_last" in flags:  # the last stage buffered its inputs: it rebuilt
        assert stages[-1].peak_fifo_bytes > 0
    if {"compress", "compensate", "rebuild_last"} & set(flags):  # and it changed what was
        # learnt (the test has teeth; rebuilding: by the rounding of the rebuilt inputs)
        plain, _ = local_reference(J, method, k, N, arch=arch, buffer_inputs="buffer" in flags,
                                   stash_weights="stash" in flags,
                                   run_flags=[f for f in flags if f != "compensate"])
        assert not torch.equal(flat(plain[0].parameters()), flat(stages[0].parameters()))
    last = torch.load(out / f"rank{J - 1}.pt")["eval"]
    assert last == ref_eval
    assert last["val_count"] == (14 if "short_eval" in flags else 12)


def test_invariant3_revvit_mpi_equals_local_bitwise(launched):
    J, method, k = 3, "petra", 2
    out = launched(J, "petra:2:revvit")
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    try:
        stages = stages_of("revvit", REVVIT["width"], 10, J, seed=0,
                              image_size=REVVIT["image_size"], model_kw=REVVIT["model_kw"])
        workers = build_workers(stages, LRSchedule(0.3, 4, warmup_epochs=1, milestones=(2,)), k,
                                weight_decay=5e-4)
        engine = LocalEngine(workers, method)
        engine.train_segment(batches(N), N)
        engine.train_segment(batches(N, seed=2), N)
        ref_eval = engine.evaluate(batches(3, seed=3), 3).result()
    finally:
        torch.use_deterministic_algorithms(False)
    for r in range(J):
        got = torch.load(out / f"rank{r}.pt")
        want = [p.detach() for p in stages[r].parameters()]
        assert len(got["params"]) == len(want)
        for g, w in zip(got["params"], want):
            assert torch.equal(g, w), f"rank {r} differs from the local engine"
    assert torch.load(out / f"rank{J - 1}.pt")["eval"] == ref_eval


def bf16_reference(J, method, k, n, precision):
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    try:
        stages = stages_of("revnet18", 4, 10, J, seed=0, precision=precision)
        workers = build_workers(stages, LRSchedule(0.3, 4, warmup_epochs=1, milestones=(2,)), k,
                                weight_decay=5e-4)
        engine = LocalEngine(workers, method)
        engine.train_segment(batches(n), n)
        engine.train_segment(batches(n, seed=2), n)
        totals = engine.evaluate(batches(3, seed=3), 3)
    finally:
        torch.use_deterministic_algorithms(False)
    return stages, totals.result()


def test_invariant3_mpi_equals_local_bitwise_in_bf16(launched):
    J, method, k = 3, "petra", 2
    out = launched(J, "petra:2:bf16")
    stages, ref_eval = bf16_reference(J, method, k, N, "bf16")
    fp32, _ = bf16_reference(J, method, k, N, "fp32")
    for r in range(J):
        got = torch.load(out / f"rank{r}.pt")
        want = [p.detach() for p in stages[r].parameters()] + list(stages[r].buffers())
        for g, w in zip(got["params"] + got["buffers"], want):
            assert torch.equal(g, w), f"rank {r} differs from the local engine in bf16"
    assert torch.load(out / f"rank{J - 1}.pt")["eval"] == ref_eval
    # and bf16 is a different computation from fp32 (the test has teeth)
    assert any(not torch.equal(a, b) for a, b in zip(stages[0].parameters(), fp32[0].parameters()))


@pytest.mark.extended  # 4 ranks
def test_rank_failure_ends_every_rank(tmp_path):
    proc = mpirun(4, [PROGRAMS / "faulty_train.py", "fail", 1, 5, "configs/quickstart.yaml",
                      "--set", f"run.out_dir={tmp_path}", *QUICK], timeout=60)
    assert proc.returncode != 0
    out = proc.stdout + proc.stderr
    assert out.count("injected failure at micro-batch 5") >= 1
    assert out.count("rank 1 failed") == 1  # the failing rank's traceback, once
    assert "Traceback" in out


@pytest.mark.extended
def test_nonfinite_loss_stops_with_the_step(tmp_path):
    proc = mpirun(3, ["-m", "petra_mpi.train", "configs/quickstart.yaml", "--set",
                      f"run.out_dir={tmp_path}", "--set", "optim.lr=1e12",
                      "--set", "optim.warmup_epochs=0", *QUICK], timeout=60)
    assert proc.returncode != 0
    shown = proc.stdout[-1000:] + proc.stderr[-2000:]
    assert "non-finite loss" in proc.stderr and "at step" in proc.stderr, shown
    assert "Traceback" not in proc.stderr
    events = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert events[0]["event"] == "start"  # what was written is kept, and why it stopped
    assert events[-1]["event"] == "error" and "non-finite loss" in events[-1]["message"]


@pytest.mark.parametrize("n,sets,expect", [
    pytest.param(11, [], "run 1 to 10 ranks", marks=pytest.mark.extended),  # 11 ranks on 2 cores
    (3, ["--set", "model.stages=4"], "run mpirun -n 4"),
    (2, ["--set", "train.diag_every=2"], "run them without mpirun"),
])
def test_wrong_world_size_is_an_error_before_training(tmp_path, n, sets, expect):
    proc = mpirun(n, ["-m", "petra_mpi.train", "configs/quickstart.yaml", "--set",
                      f"run.out_dir={tmp_path}", *QUICK, *sets], timeout=60)
    assert proc.returncode != 0
    assert expect in proc.stderr
    assert not (tmp_path / "metrics.jsonl").exists()


def test_wrong_world_size_is_reported_before_torch_loads(tmp_path):
    """Each rank checks the config against the launcher's world size before importing torch
    (the trainer and the GPU binding load it): the wrong -n costs no torch import per rank."""
    code = ("import sys\n"
            "from petra_mpi.train import main\n"
            "status = main(sys.argv[1:])\n"
            # one write per rank: the ranks share the pipe, and print's pieces could interleave
            "sys.stdout.write(f\"torch loaded: {'torch' in sys.modules}\\n\")\n"
            "sys.exit(status)\n")
    proc = mpirun(3, ["-c", code, "configs/quickstart.yaml", "--set", f"run.out_dir={tmp_path}",
                      *QUICK, "--set", "model.stages=4"], timeout=60)
    assert proc.returncode != 0
    assert "asks for 4 stages but 3 ranks are running" in proc.stderr
    assert "run mpirun -n 4" in proc.stderr
    assert proc.stdout.count("torch loaded: False") == 3, proc.stdout
    assert not (tmp_path / "metrics.jsonl").exists()


@pytest.mark.extended  # the trainer under mpirun: test_resume.py runs it in the default selection
def test_quickstart_under_mpirun_4(tmp_path):
    proc = mpirun(4, ["-m", "petra_mpi.train", "configs/quickstart.yaml", "--set",
                      f"run.out_dir={tmp_path}", *QUICK, "--set", "train.epochs=2"], timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    check_run_outputs(tmp_path, epochs=2, stages=4)


# ---------------------------------------------------------------- transport
def test_polling_keeps_the_message_size(tmp_path):
    """A 3-row message into a receive buffer sized for 4 rows, with polls between its arrival
    and its receive: the receiver gets the 3 rows sent, not the buffer."""
    proc = mpirun(2, [PROGRAMS / "transport.py", tmp_path / "received.pt"], timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    got = torch.load(tmp_path / "received.pt")
    assert got.shape == (3, 2) and torch.equal(got, torch.arange(6.0).reshape(3, 2)), got


@pytest.mark.extended  # the layouts are tested in one process in unit/test_transport.py
def test_channels_last_through_mpi():
    """Real MPI, 2 ranks: channels-last and NCHW messages, a short one into a full-size buffer;
    the sender hands MPI the producer's memory and the receiver gets channels-last strides."""
    proc = mpirun(2, [PROGRAMS / "layout.py", "cpu"], timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "layout ok" in proc.stdout


@pytest.mark.extended  # invariant 3 is the launches above
def test_sleeping_waits_train_bitwise_alike(tmp_path):
    """PETRA_MPI_POLL_SLEEP (the waits of `bench emulate`: test the request and sleep, instead of
    MPI's Wait) changes who holds the core, nothing else: the same parameters as the local
    engine, and the short last evaluation batch, whose size comes from the completed request's
    status, counted right."""
    run = "petra:1:short_eval"
    proc = mpirun(3, [PROGRAMS / "equivalence.py", tmp_path, N, run], timeout=300,
                  env={"PETRA_MPI_POLL_SLEEP": "0.0005"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    stages, ref_eval = local_reference(3, "petra", 1, N, short_eval=True)
    for r in range(3):
        got = torch.load(tmp_path / run / f"rank{r}.pt")
        want = [p.detach() for p in stages[r].parameters()] + list(stages[r].buffers())
        assert all(torch.equal(g, w) for g, w in zip(got["params"] + got["buffers"], want))
    last = torch.load(tmp_path / run / "rank2.pt")["eval"]
    assert last == ref_eval and last["val_count"] == 14
