"""GPU paths: device tensors through the MPI transport, pinned host staging, and CUDA-aware MPI
when the library supports it; the torch.distributed transport over NCCL. These need CUDA and
skip without it (this project's CI machines have no GPU; they run on the GPU machine, see the
README)."""
import os
import subprocess
import sys

import pytest
import torch

from tests.support.launch import mpirun, torchrun
from tests.support.outputs import check_run_outputs
from tests.support.paths import PROGRAMS, QUICK, ROOT

pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
              pytest.mark.extended]


def test_stage_backward_on_gpu_matches_cpu():
    from tests.support.nets import stages_of
    from tests.support.nets import make_batches, run_engine
    batches = make_batches(5, dtype=torch.float64)
    cpu = run_engine("revnet18", 4, 2, batches, lr=0.1)
    gpu_batches = [(x.cuda(), y.cuda()) for x, y in batches]
    stages = stages_of("revnet18", 4, 10, 4, seed=0, dtype=torch.float64, device="cuda")
    from petra_mpi.engines.build import build_workers
    from petra_mpi.engines.local import LocalEngine
    from petra_mpi.core.optim import LRSchedule
    workers = build_workers(stages, LRSchedule(0.1, 10**6), 2, weight_decay=0.0)
    LocalEngine(workers, "petra").train_segment(iter(gpu_batches), len(gpu_batches))
    # every stage's parameters and BN buffers (float64: only kernel rounding differs)
    assert_states_close([s.state_dict() for s in cpu], [s.state_dict() for s in stages],
                        rtol=1e-7, atol=1e-9)


def assert_states_close(want, got, rtol, atol):
    """Stage state dicts (parameters and buffers) equal within tolerance, key by key; integer
    buffers (num_batches_tracked) exactly."""
    assert len(want) == len(got)
    for s, (w, g) in enumerate(zip(want, got)):
        assert w.keys() == g.keys(), f"stage {s}"
        for key in w:
            torch.testing.assert_close(g[key].cpu(), w[key].cpu(), rtol=rtol, atol=atol,
                                       msg=lambda m: f"stage {s} {key}: {m}")


# Two runs compared stage by stage must cut the net alike: a split balanced by measured cost may
# differ between them.
PINNED_SPLIT = "model.partition=[5, 5]"


def assert_trains_as_one_gpu_process(tmp_path, args, ranks_dir):
    """The training `args` (train's arguments) in one GPU process ends where the ranks' run in
    ranks_dir ended: same device and kernels, so only non-deterministic reductions (atomics in
    cuDNN's weight gradients) may differ, and every parameter and BN buffer of both stages must
    agree closely."""
    local = subprocess.run([sys.executable, *args, "--set", f"run.out_dir={tmp_path / 'local'}"],
                           capture_output=True, text=True, timeout=300, cwd=ROOT,
                           env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert local.returncode == 0, local.stderr[-3000:]
    assert_states_close(final_stage_states(tmp_path / "local", 2),
                        final_stage_states(ranks_dir, 2), rtol=1e-4, atol=1e-6)


def final_stage_states(out_dir, stages):
    """Every stage's parameters and buffers from the run's last checkpoint (end of epoch 1)."""
    from petra_mpi.run.checkpoint import complete_checkpoints
    path = complete_checkpoints(str(out_dir))[-1]
    assert path.endswith("ckpt-e00001-b00000000"), path
    return [torch.load(os.path.join(path, f"stage{s}.pt"), map_location="cpu",
                       weights_only=False)["stage"] for s in range(stages)]


@pytest.mark.parametrize("aware", ["0", "1"])
def test_mpi_training_on_gpu(tmp_path, aware):
    from petra_mpi.comm.mpi import cuda_aware_mpi
    if aware == "1" and not cuda_aware_mpi()[0]:
        pytest.skip("the MPI library is not CUDA-aware")
    proc = mpirun(2, ["-m", "petra_mpi.train", "configs/quickstart.yaml", "--set",
                      f"run.out_dir={tmp_path}", *QUICK, "--set", "run.device=cuda"],
                  timeout=300, env={"PETRA_MPI_CUDA_AWARE": aware})
    assert proc.returncode == 0, proc.stderr[-3000:]
    mode = "cuda-aware" if aware == "1" else "pinned-host-staging"
    assert f"transport {mode}" in proc.stderr
    check_run_outputs(tmp_path, epochs=1, stages=2)


def test_mpi_equivalence_cpu_vs_gpu_staging(tmp_path):
    """The same training on GPU ranks (staged through pinned memory) and in one GPU process ends
    with the same parameters and buffers on every stage."""
    args = ["-m", "petra_mpi.train", "configs/quickstart.yaml", *QUICK, "--set",
            "run.device=cuda", "--set", PINNED_SPLIT]
    proc = mpirun(2, [*args, "--set", f"run.out_dir={tmp_path / 'mpi'}"], timeout=300,
                  env={"PETRA_MPI_CUDA_AWARE": "0"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert_trains_as_one_gpu_process(tmp_path, args, tmp_path / "mpi")


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL wants one GPU per rank")
def test_nccl_training_equals_one_gpu_process(tmp_path):
    """comm.transport torch on GPUs (NCCL, started by torchrun): the training of one GPU process,
    every stage's parameters and buffers."""
    args = ["-m", "petra_mpi.train", "configs/quickstart.yaml", *QUICK, "--set",
            "run.device=cuda", "--set", PINNED_SPLIT]
    proc = torchrun(2, [*args, "--set", "comm.transport=torch",
                        "--set", f"run.out_dir={tmp_path / 'nccl'}"], timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "transport torch.distributed nccl" in proc.stderr
    assert_trains_as_one_gpu_process(tmp_path, args, tmp_path / "nccl")


def test_gpu_jpeg_decode_is_stream_safe(tmp_path):
    """pytorch/vision#9606: nvJPEG decode on the compute stream can overwrite memory queued
    kernels still read. The side-stream decode must train stage 0 bitwise as a run that
    synchronises the whole device before every decode."""
    pytest.importorskip("torchvision.io")
    script = PROGRAMS / "decode_training.py"
    for sync in ("0", "1"):
        proc = subprocess.run([sys.executable, str(script), str(tmp_path / f"sync{sync}.pt"), sync],
                              capture_output=True, text=True, timeout=300, cwd=ROOT,
                              env={**os.environ, "OMP_NUM_THREADS": "1"})
        assert proc.returncode == 0, proc.stderr[-3000:]
    free, synced = (torch.load(tmp_path / f"sync{s}.pt") for s in ("0", "1"))
    assert len(free) == len(synced) > 0
    for a, b in zip(free, synced):
        assert torch.equal(a, b), "stage-0 parameters differ with a synchronised decode"


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_bench_pipeline_on_gpu(precision):
    """Both ranks on the GPU(s), the staged transport, a figure for each method."""
    import json
    proc = mpirun(2, ["-m", "petra_mpi.bench", "pipeline", "--device", "cuda", "--precision",
                      precision, "--width", "8", "--batch", "16", "--microbatches", "6",
                      "--rounds", "1"], timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "rank map" in proc.stdout
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["device"].startswith("cuda") and out["precision"] == precision
    assert out["transport"] in ("pinned-host-staging", "cuda-aware")
    assert out["petra_images_per_s"] > 0 and out["backprop_images_per_s"] > 0


def test_bench_data_decodes_jpeg_on_the_gpu():
    pytest.importorskip("torchvision.io")
    import json
    proc = subprocess.run([sys.executable, "-m", "petra_mpi.bench", "data", "synthetic",
                           "--device", "cuda", "--seconds", "0.5", "--synthetic-n", "512",
                           "--jpeg-demo", "--decode-pool", "thread"], capture_output=True,
                          text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["device"].startswith("cuda") and out["jpeg_gpu_decode"] is True
    assert out["jpeg_images_per_s"] > 0


# ---------------------------------------------------------------- transport (comm/transport.py)

@pytest.mark.parametrize("aware", ["0", "1"])
def test_channels_last_messages_keep_their_layout_on_gpu(aware):
    """Sent from the producer's memory (or its pinned copy in the same layout), received with
    channels-last strides, a short batch into the full-size buffer."""
    from petra_mpi.comm.mpi import cuda_aware_mpi
    if aware == "1" and not cuda_aware_mpi()[0]:
        pytest.skip("the MPI library is not CUDA-aware")
    proc = mpirun(2, [PROGRAMS / "layout.py", "cuda"], timeout=300,
                  env={"PETRA_MPI_CUDA_AWARE": aware})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "layout ok" in proc.stdout


def test_stages_on_cuda_produce_channels_last_messages():
    """What the engine agrees at start-up: a CUDA stage's output is channels-last, so its links
    carry channels-last messages (on the CPU they stay NCHW)."""
    from petra_mpi.comm.transport import CHANNELS_LAST, CONTIGUOUS, layout_of
    from tests.support.nets import stages_of
    for device, want in (("cuda", CHANNELS_LAST), ("cpu", CONTIGUOUS)):
        stages = stages_of("revnet18", 4, 10, 3, seed=0, device=device)
        x = torch.zeros(2, 3, 32, 32, device=device)
        with torch.no_grad():
            for stage in stages[:-1]:
                stage.eval()
                x = stage.evaluate(x)
                assert layout_of(x) == want, f"{device}: stage {stage.index} sends {layout_of(x)}"


class CountingBox:
    def __init__(self):
        self.polls = 0

    def poll(self):
        self.polls += 1


def test_waiting_for_gpu_data_polls_mpi():
    """Transport.wait_for on a real event behind a long kernel: the host polls the transport
    until the GPU passes the event, and returns only then: the data the kernels before the event
    wrote is there when it returns."""
    from petra_mpi.comm.transport import Transport
    transport = Transport(torch.device("cuda"), False)
    box = CountingBox()
    transport.boxes.append(box)
    written = torch.ones(1, device="cuda")
    landed = torch.zeros(1).pin_memory()  # host memory: reading it does not wait for the GPU
    cycles = 10**8
    while True:
        landed.zero_()
        torch.cuda._sleep(cycles)
        landed.copy_(written, non_blocking=True)  # lands only after the sleep
        ready = torch.cuda.Event()
        ready.record()
        if not ready.query():  # still running: the wait below has something to wait for
            break
        cycles *= 4
    transport.wait_for(ready)
    assert landed.item() == 1.0, "wait_for returned before the GPU passed the event"
    assert box.polls > 0


def test_received_gpu_buffer_stays_reserved_while_the_compute_stream_reads_it():
    """CUDA-aware receive buffers come from the transport's receive stream and are handed over
    with record_stream: freed while a queued kernel still reads them, their memory must not go to
    the next receive (which MPI would write at once) until the compute stream has passed."""
    from petra_mpi.comm.transport import Transport
    transport = Transport(torch.device("cuda"), True)
    shape = (64, 1024)
    cycles = 10**8
    while True:
        t, _ = transport.recv_buffer(shape, torch.float32)
        t = transport.hand_over(t.fill_(1.0))
        address = t.data_ptr()
        torch.cuda._sleep(cycles)
        out = t * 2  # queued behind the sleep: still to read t
        done = torch.cuda.Event()
        done.record()
        del t
        again, _ = transport.recv_buffer(shape, torch.float32)
        if not done.query():  # the read was still queued when the buffer was asked for again
            break
        cycles *= 4
    assert again.data_ptr() != address, "memory a queued kernel reads went to a new receive"
    torch.cuda.synchronize()
    assert (out == 2).all()


@pytest.mark.parametrize("aware,collectives,path", [
    ("0", "0", "pinned-host-staging"),
    ("1", "0", "pinned-host-staging"),  # CUDA-aware point-to-point: the average is still staged
    ("1", "1", "cuda-aware"),
])
def test_replica_average_on_gpu(tmp_path, aware, collectives, path):
    """2 replicas x 2 stages on the GPU: the average takes the path the library is trusted with,
    and training ends where one GPU process simulating both replicas ends (the same average)."""
    from petra_mpi.comm.mpi import cuda_aware_mpi
    if aware == "1" and not cuda_aware_mpi()[0]:
        pytest.skip("the MPI library is not CUDA-aware")
    args = ["-m", "petra_mpi.train", "configs/quickstart.yaml", *QUICK, "--set",
            "run.device=cuda", "--set", "train.replicas=2", "--set", PINNED_SPLIT]
    proc = mpirun(4, [*args, "--set", f"run.out_dir={tmp_path / 'mpi'}"], timeout=300,
                  env={"PETRA_MPI_CUDA_AWARE": aware, "PETRA_MPI_DEVICE_COLLECTIVES": collectives})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"replica average {path}" in proc.stderr
    check_run_outputs(tmp_path / "mpi", epochs=1, stages=2)
    assert_trains_as_one_gpu_process(tmp_path, args, tmp_path / "mpi")


@pytest.mark.parametrize("fmt", ["bf16", "fp16", "int8", "int8_channel"])
def test_compression_on_gpu_needs_no_host_synchronisation(fmt):
    """Packing, the wire format and unpacking (stochastic rounding included) run on the device
    without a synchronising call (sync debug mode makes one an error)."""
    from petra_mpi.comm.compress import Codec
    from petra_mpi.comm.transport import CHANNELS_LAST, from_wire, to_wire
    x = torch.randn(8, 6, 5, 5, device="cuda").contiguous(memory_format=torch.channels_last)
    codec = Codec(fmt, stochastic=True, seed=1)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        wire = to_wire(codec.pack(x), CHANNELS_LAST)
        got = codec.unpack(from_wire(wire, codec, x.shape, x.dtype, CHANNELS_LAST))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert got.device.type == "cuda"
    assert (got - x).abs().max().item() <= x.abs().max().item() / 127 * 1.01  # within a step


@pytest.mark.parametrize("fmt,bad", [("int8", float("inf")), ("fp16", 1e5)])
def test_a_non_finite_buffer_on_gpu_stops_its_backward(fmt, bad):
    """A buffer pushed on a GPU whose values would decode to inf or NaN: the push packs it and
    copies its guard to the host without a synchronising call (sync debug mode makes one an
    error); the backward's unpack raises the clear non-finite error."""
    from petra_mpi.comm.compress import Codec, NonFiniteError
    x = torch.randn(8, 6, 5, 5, device="cuda")
    x[1, 2, 3, 4] = bad
    codec = Codec(fmt, what="the input stage 0 keeps for its backward")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        packed = codec.pack(x, defer_check=True)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    with pytest.raises(NonFiniteError, match="the input stage 0 keeps"):
        codec.unpack_checked(packed)


def test_mpi_training_on_gpu_with_compression(tmp_path):
    proc = mpirun(2, ["-m", "petra_mpi.train", "configs/quickstart.yaml", *QUICK, "--set",
                      f"run.out_dir={tmp_path}", "--set", "run.device=cuda", "--set",
                      "comm.forward=int8_channel", "--set", "comm.rebuilt=bf16", "--set",
                      "comm.gradient=int8", "--set", "comm.buffers=fp16", "--set",
                      "comm.stochastic=true"], timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "compression forward int8_channel" in proc.stderr
    check_run_outputs(tmp_path, epochs=1, stages=2)
