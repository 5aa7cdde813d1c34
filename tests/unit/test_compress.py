"""Compressed messages and buffers (petra_mpi/comm/compress.py): the codecs' error bounds, the wire
format of the MPI transport, and PETRA's lr = 0 gradient with bf16 messages."""
import pytest
import torch
import torch.nn.functional as F

from tests.support.nets import applied_gradients, make_batches, max_relative_error, stages_of
from petra_mpi.comm.compress import Codec, Compression, NonFiniteError, Packed
from petra_mpi.config import ConfigError, load_config
from petra_mpi.comm.transport import CHANNELS_LAST, CONTIGUOUS, from_wire, to_wire
from petra_mpi.core.schedule import updates_after

# Unit roundoff of rounding to the nearest: half the gap between neighbours relative to the
# value, 2^-p for p significand bits (the implicit one included): bf16 has 8, fp16 11.
UNIT_ROUNDOFF = {"bf16": 2.0 ** -8, "fp16": 2.0 ** -11}


def activation(seed=0, shape=(8, 6, 5, 5)):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g)
    x[:, 2] *= 1e-3  # a channel of small values: per-channel scales keep its resolution
    return x


@pytest.mark.parametrize("fmt", ["bf16", "fp16"])
def test_float16_formats_round_to_nearest_within_unit_roundoff(fmt):
    x = activation()  # values in fp16's normal range (|x| > 6e-5): no subnormals
    x = x[x.abs() > 1e-4]
    err = (Codec(fmt).roundtrip(x) - x).abs()
    assert (err <= UNIT_ROUNDOFF[fmt] * x.abs()).all()
    assert (err > 0).any()


@pytest.mark.parametrize("fmt", ["int8", "int8_channel"])
@pytest.mark.parametrize("stochastic", [False, True])
def test_int8_round_trip_error_is_bounded_by_the_scale(fmt, stochastic):
    """Nearest: at most half a step (scale / 2) off; stochastic: less than one step. The step is
    max|x| / 127 over the tensor, or over each channel."""
    x = activation()
    codec = Codec(fmt, stochastic, seed=1)
    packed = codec.pack(x)
    assert packed.codes.dtype == torch.int8 and packed.codes.abs().max() == 127
    dims = (0, 1, 2, 3) if fmt == "int8" else (0, 2, 3)
    step = x.abs().amax(dim=dims, keepdim=True) / 127
    assert torch.allclose(packed.scale, step)
    err = (codec.unpack(packed) - x).abs()
    bound = step * (1.0 if stochastic else 0.5) * (1 + 1e-6)  # float32 division and product
    assert (err <= bound).all()
    if fmt == "int8_channel":  # the small channel keeps its relative precision
        assert err[:, 2].max() / x[:, 2].abs().max() <= 1 / 127


def test_int8_of_zeros_is_zeros():
    for fmt in ("int8", "int8_channel"):
        z = torch.zeros(2, 3, 4, 4)
        assert torch.equal(Codec(fmt).roundtrip(z), z)


@pytest.mark.parametrize("fmt", ["bf16", "fp16", "int8"])
def test_stochastic_rounding_is_unbiased(fmt):
    """The mean of many stochastic roundings of one value approaches the value: within 5 standard
    errors (the rounding error of one draw is at most one gap g, so its std is at most g / 2),
    while rounding to the nearest is off by a fixed amount."""
    v = torch.full((200_000,), 1.0 + 2.0 ** -11 if fmt != "int8" else 0.3)
    if fmt == "int8":
        v[0] = 1.0  # scale 1/127: 0.3 sits between two codes
        gap = 1 / 127
    else:
        gap = 2.0 ** (-7 if fmt == "bf16" else -10)
    got = Codec(fmt, stochastic=True, seed=3).roundtrip(v)[1:]
    nearest = Codec(fmt).roundtrip(v)[1:]
    tol = 5 * (gap / 2) / got.numel() ** 0.5
    assert abs(got.double().mean().item() - v[1].item()) < tol
    assert abs(nearest[0].item() - v[1].item()) > 10 * tol
    # and the draws repeat with the seed (both engines must draw the same ones)
    assert torch.equal(got, Codec(fmt, stochastic=True, seed=3).roundtrip(v)[1:])
    assert not torch.equal(got, Codec(fmt, stochastic=True, seed=4).roundtrip(v)[1:])


@pytest.mark.parametrize("fmt,dtype", [("bf16", torch.bfloat16), ("fp16", torch.float16)])
def test_stochastic_16_bit_rounding_lands_on_a_neighbour(fmt, dtype):
    """Each value goes to one of the two 16-bit values around it, over many magnitudes, signs,
    zeros and subnormals."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(50_000, generator=g) * torch.exp(3 * torch.randn(50_000, generator=g))
    x[:8] = torch.tensor([0.0, -0.0, 1e-30, -1e-30, 1e-6, -1e-6, 1.0, -1.0])
    x = x[torch.isfinite(x.to(dtype))]  # fp16 overflows past 65504, whatever the rounding
    y = Codec(fmt, stochastic=True, seed=2).roundtrip(x)
    nearest = x.to(dtype)
    up = torch.nextafter(nearest, torch.full_like(nearest, float("inf"))).float()
    down = torch.nextafter(nearest, torch.full_like(nearest, -float("inf"))).float()
    below = torch.where(nearest.float() <= x, nearest.float(), down)
    above = torch.where(nearest.float() >= x, nearest.float(), up)
    assert ((y == below) | (y == above)).all()
    assert (y != nearest.float()).any()  # some values went to the farther neighbour


def test_evaluation_rounds_to_the_nearest():
    x = activation()
    assert torch.equal(Codec("int8", stochastic=True).roundtrip(x, evaluation=True),
                       Codec("int8").roundtrip(x))


@pytest.mark.parametrize("fmt", ["bf16", "fp16", "int8", "int8_channel"])
@pytest.mark.parametrize("layout", [CONTIGUOUS, CHANNELS_LAST])
def test_wire_format_round_trip(fmt, layout):
    """What the MPI transport sends and decodes is exactly the local engine's round trip, in
    both layouts, and a receiver that gets fewer samples (a short last batch) decodes them."""
    x = activation()
    if layout == CHANNELS_LAST:
        x = x.contiguous(memory_format=torch.channels_last)
    codec = Codec(fmt)
    wire = to_wire(codec.pack(x), layout)
    assert wire.dtype == torch.uint8 and wire.dim() == 1
    code_bytes = 1 if fmt.startswith("int8") else 2
    scales = {"int8": 1, "int8_channel": x.shape[1]}.get(fmt, 0)
    assert wire.numel() == x.numel() * code_bytes + 4 * scales
    got = codec.unpack(from_wire(wire, codec, x.shape, x.dtype, layout))
    assert torch.equal(got, codec.roundtrip(x))
    short = x[:3]
    wire = to_wire(codec.pack(short), layout)
    assert torch.equal(codec.unpack(from_wire(wire, codec, short.shape, x.dtype, layout)),
                       codec.roundtrip(short))


def test_compressed_fifo_keeps_fewer_bytes():
    """Buffered blocks keep their inputs packed: ResNet18's FIFOs hold a quarter of the bytes
    with int8 (plus the scales) and the stage still trains."""
    batches = make_batches(6, dtype=torch.float32)
    peaks = {}
    for fmt in ("none", "int8"):
        _, stages = applied_gradients("resnet18", 2, 1, batches, dtype=torch.float32,
                                      compression=Compression(buffers=fmt))
        peaks[fmt] = stages[0].peak_fifo_bytes
    assert peaks["int8"] < peaks["none"] / 3.9


def test_dry_run_counts_packed_fifo_entries():
    from petra_mpi.core.planner import plan_layout
    from petra_mpi.models import NetSpec
    from petra_mpi.run.dryrun import stage_table
    fifo = {}
    for fmt in ("none", "bf16", "int8"):
        cfg = load_config("configs/quickstart.yaml", [f"comm.buffers={fmt}"])
        layout = plan_layout(NetSpec.of_config(cfg, 32), 4)
        fifo[fmt] = [row["input_fifo_bytes"] for row in stage_table(cfg, layout)]
    assert any(fifo["none"])
    assert fifo["bf16"] == [b // 2 for b in fifo["none"]]
    assert fifo["int8"] == [b // 4 for b in fifo["none"]]


def test_config_comm_section():
    cfg = load_config("configs/quickstart.yaml", ["comm.forward=int8_channel",
                                                  "comm.stochastic=true"])
    c = Compression.from_config(cfg.comm, cfg.run.seed)
    assert c.forward == "int8_channel" and c.gradient == "none" and c.stochastic
    assert "forward int8_channel" in c.describe()
    with pytest.raises(ConfigError, match="comm.gradient"):
        load_config("configs/quickstart.yaml", ["comm.gradient=int4"])


# --- PETRA's gradient at lr = 0 with bf16 messages -------------------------------------------


class _Boundary(torch.autograd.Function):
    """A stage boundary as the messages see it: the forward value rounded as the activation
    message is, the gradient rounded as the gradient message is (the rounding is the same
    function of the same tensor, so it is reproduced exactly). Each rounding moves each value by
    at most bf16's unit roundoff, checked here."""

    @staticmethod
    def forward(ctx, h, forward, gradient):
        ctx.gradient = gradient
        out = Codec(forward).roundtrip(h)
        if forward != "none":
            assert ((out - h).abs() <= UNIT_ROUNDOFF[forward] * h.abs()).all()
        return out

    @staticmethod
    def backward(ctx, g):
        return Codec(ctx.gradient).roundtrip(g), None, None


def rounded_end_to_end_gradients(arch, J, k, batches, forward, gradient, width=4):
    """Plain autograd through the whole net, one micro-batch at a time, with the messages'
    roundings at J's stage boundaries; summed per optimizer step as PETRA applies them."""
    sizes = [len(s.blocks) for s in stages_of(arch, width, 10, J, seed=0)]
    ends = {sum(sizes[:s + 1]) - 1 for s in range(J - 1)}  # last block of each stage but one
    (net,) = stages_of(arch, width, 10, 1, seed=0, dtype=torch.float64)
    params = list(net.parameters())
    total = [torch.zeros_like(p) for p in params]
    group, count = [torch.zeros_like(p) for p in params], 0
    for b, (x, y) in enumerate(batches):
        h = x
        for i, block in enumerate(net.blocks):
            h = block(h)
            if i in ends:
                h = _Boundary.apply(h, forward, gradient)
        grads = torch.autograd.grad(F.cross_entropy(h, y), params)
        group, count = [a + g for a, g in zip(group, grads)], count + 1
        if updates_after(b, len(batches), k):
            total = [t + a / count for t, a in zip(total, group)]
            group, count = [torch.zeros_like(p) for p in params], 0
    return total


@pytest.mark.parametrize("arch,forward", [("resnet18", "bf16"), ("revnet18", "none")])
def test_lr0_gradient_with_bf16_messages(arch, forward):
    """With bf16 messages PETRA's lr = 0 gradient is the end-to-end gradient of the net whose
    stage boundaries round as the messages do: the roundings (each within bf16's unit roundoff
    2^-8, checked in _Boundary) are the only difference from the exact gradient, so what is left
    is float64 arithmetic, judged as invariant 1 is (1e-10).

    ResNet18 (every block buffered): activations and gradients in bf16. RevNet18: gradients in
    bf16 (an activation message would also move the point each reversible stage rebuilds its
    input from, which no plain-autograd net reproduces: docs/benchmarks.md measures that error).
    """
    J, k = 4, 2
    batches = make_batches(6)
    compression = Compression(forward=forward, gradient="bf16")
    got, _ = applied_gradients(arch, J, k, batches, compression=compression)
    want = rounded_end_to_end_gradients(arch, J, k, batches, forward, "bf16")
    assert max_relative_error(got, want) < 1e-10
    # and the messages' rounding moved the gradient by far more than that (the test has teeth)
    exact = rounded_end_to_end_gradients(arch, J, k, batches, "none", "none")
    assert max_relative_error(got, exact) > 1e-4


def test_packed_fifo_entry_counts_its_bytes():
    from petra_mpi.comm.compress import nbytes
    p = Codec("int8_channel").pack(activation())
    assert isinstance(p, Packed) and nbytes(p) == 8 * 6 * 5 * 5 + 6 * 4


@pytest.mark.parametrize("fmt", ["int8", "int8_channel"])
@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
def test_a_nonfinite_value_stops_an_int8_message(fmt, bad):
    """One inf or NaN would make the scale non-finite and every value (of the message, or of
    its channel) decode to NaN: packing it is the clear non-finite error, naming what was sent."""
    x = activation()
    x[1, 3, 2, 2] = bad
    codec = Compression(gradient=fmt).codec("gradient", stage=2)
    with pytest.raises(RuntimeError, match=r"non-finite values \(inf or NaN\) in the gradient "
                                           r"stage 2 sends"):
        codec.roundtrip(x)
    buffers = Compression(buffers=fmt).codec("buffers", stage=1, replica=1)
    with pytest.raises(RuntimeError, match="the input stage 1 of replica 1 keeps"):
        buffers.pack(x)


def test_an_fp16_overflow_stops_a_message():
    """fp16 ends at 65504: a larger value would arrive as inf. Packing it is the clear
    non-finite error, naming what was sent and fp16's range; bf16, which has float32's range,
    carries it."""
    x = activation()
    x[0, 1, 2, 3] = 1e5
    codec = Compression(forward="fp16").codec("forward", stage=1)
    with pytest.raises(NonFiniteError, match="in the activations stage 1 sends in fp16, whose "
                                             "largest value is 65504"):
        codec.roundtrip(x)
    assert torch.isfinite(Codec("bf16").roundtrip(x)).all()


@pytest.mark.parametrize("fmt,bad", [("fp16", 1e5), ("int8", float("inf")),
                                     ("int8_channel", float("nan"))])
def test_a_buffer_that_would_decode_non_finite_stops_the_backward_that_takes_it(fmt, bad):
    """Stage 0 of RevNet18 keeps its (non-reversible) stem's input for the backward, packed in
    `fmt`: one value that would decode to inf or NaN (an fp16 overflow, an inf or NaN under an
    int8 scale). The buffer is checked when the backward takes it (on a GPU from a host copy
    made at the push: no wait there): the backward raises the clear error before it uses it."""
    (stage, _) = stages_of("revnet18", 4, 10, 2, compression=Compression(buffers=fmt))
    x = torch.randn(2, 3, 32, 32)
    x[1, 2, 3, 4] = bad
    y = stage.forward(x, b=0)
    with pytest.raises(NonFiniteError, match="in the input stage 0 keeps for its backward"):
        stage.backward(y, torch.randn_like(y), b=0)


def test_a_nonfinite_gradient_stops_the_run_before_any_stage_uses_it(tmp_path, monkeypatch,
                                                                      capsys):
    """A real run in one process with int8 gradients, where the last stage's input gradient of
    micro-batch 3 holds one inf: the run ends with the one-line non-finite error, and no
    stage's weights have changed since that gradient was made."""
    from tests.support.paths import QUICK, ROOT
    from petra_mpi.core.worker import StageWorker
    from petra_mpi.train import main

    workers, at_injection = [], []
    begin, forward_backward = StageWorker.begin_segment, StageWorker.forward_backward

    def begin_segment(self):
        if self not in workers:
            workers.append(self)
        begin(self)

    def poisoned(self, b, x, labels):
        loss, logits, grad_x = forward_backward(self, b, x, labels)
        if b == 3:
            grad_x = grad_x.clone()
            grad_x.view(-1)[0] = float("inf")
            at_injection.extend([p.detach().clone() for w in workers
                                 for p in w.stage.parameters()])
        return loss, logits, grad_x

    monkeypatch.setattr(StageWorker, "begin_segment", begin_segment)
    monkeypatch.setattr(StageWorker, "forward_backward", poisoned)
    monkeypatch.chdir(ROOT)
    capsys.readouterr()
    status = main(["configs/quickstart.yaml", "--set", f"run.out_dir={tmp_path}", *QUICK,
                   "--set", "comm.gradient=int8"])
    err = capsys.readouterr().err
    assert status == 1, err[-3000:]
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in err, err[-3000:]
    assert "non-finite values (inf or NaN) in the gradient stage" in errors[0], errors
    now = [p.detach() for w in workers for p in w.stage.parameters()]
    assert at_injection and len(now) == len(at_injection)
    assert all(torch.equal(a, b) for a, b in zip(now, at_injection)), "a stage used the gradient"
