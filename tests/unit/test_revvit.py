"""The reversible vision transformer (issue 13) on the same engine: docs/design.md §1 invariants 1, 2, 3
and 4 for revvit, AdamW/cosine checkpoint resume, the partition cost of attention, the configs."""
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tests.support.paths import ROOT
from tests.support.nets import (applied_gradients, end_to_end_gradients, flat_params, in_flight,
                                make_batches, max_relative_error, stages_of)
from petra_mpi.config import ConfigError, load_config, num_stages
from petra_mpi.engines.build import build_workers
from petra_mpi.engines.local import LocalEngine
from petra_mpi.models import build_blocks, num_blocks
from petra_mpi.core.optim import LRSchedule, StageOptimizer
from petra_mpi.core.partition import block_costs
from petra_mpi.core.stages import Stage

# A tiny revvit on 8x8 images: 4 tokens of 2x2 patches, width 8 per stream, 2 heads, 4 blocks
# (6 blocks with the patch embedding and the head).
TINY = dict(image_size=8, model_kw=dict(depth=4, heads=2, patch=4))
ARCHS = ["revvit", "vit"]


def tiny_stages(arch, J, dtype=torch.float64, **kw):
    return stages_of(arch, 8, 10, J, seed=0, dtype=dtype, **TINY, **kw)


def test_block_list_and_rebuild_float64():
    """Invariant 4: with unchanged weights the rebuild is exact to rounding, and the input
    gradient equals autograd's through the forward."""
    torch.manual_seed(0)
    blocks = [b.double() for b in build_blocks("revvit", 16, 10, image_size=16, depth=3,
                                               heads=2, patch=4)]
    assert len(blocks) == num_blocks("revvit", 3) == 5
    assert [b.reversible for b in blocks] == [False, True, True, True, False]
    x = blocks[0](torch.randn(3, 3, 16, 16, dtype=torch.float64)).detach()
    assert x.shape == (3, 16, 32)  # (B, tokens, 2 streams x width)
    stage = Stage(blocks[1:4], 1, 3)
    y = stage(x)
    grad_y = torch.randn_like(y)
    rebuilt, grad_x = stage.backward(y, grad_y)
    assert ((rebuilt - x).norm() / x.norm()).item() < 1e-10
    grads = [p.grad.clone() for p in stage.parameters()]
    stage.zero_grad(set_to_none=True)
    x_leaf = x.clone().requires_grad_(True)
    out = x_leaf
    for b in blocks[1:4]:
        out = b(out)
    out.backward(grad_y)
    assert max_relative_error([grad_x], [x_leaf.grad]) < 1e-10
    assert max_relative_error(grads, [p.grad for p in stage.parameters()]) < 1e-10


def test_rebuild_runs_each_branch_once():
    """The ViT coupling's backward does one forward of Attn and one of MLP, not two."""
    torch.manual_seed(0)
    block = build_blocks("revvit", 8, 10, image_size=8, depth=1, heads=2, patch=4)[1]
    calls = {"attn": 0, "mlp": 0}
    block.attn.register_forward_hook(lambda *a: calls.__setitem__("attn", calls["attn"] + 1))
    block.mlp.register_forward_hook(lambda *a: calls.__setitem__("mlp", calls["mlp"] + 1))
    stage = Stage([block], 1, 3)
    y = stage(torch.randn(2, 4, 16))
    calls.update(attn=0, mlp=0)
    stage.backward(y, torch.randn_like(y))
    assert calls == {"attn": 1, "mlp": 1}


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("J,k", [(1, 1), (3, 2), (6, 1)])
def test_invariant1_lr0_gradient_equals_end_to_end_float64(arch, J, k):
    batches = make_batches(6)
    got, stages = applied_gradients(arch, J, k, batches, width=8, **TINY)
    want = end_to_end_gradients(arch, k, batches, width=8, **TINY)
    assert len(got) == len(want)
    assert max_relative_error(got, want) < 1e-10
    assert all(in_flight(s) == 0 for s in stages)


def plain_training(arch, k, batches, schedule, optimizer):
    (net,) = tiny_stages(arch, 1)
    model = torch.nn.Sequential(*net.blocks)
    opt = StageOptimizer(model, schedule, weight_decay=0.05, name=optimizer)
    for b, (x, y) in enumerate(batches):
        F.cross_entropy(model(x), y).backward()
        opt.accumulated()
        if (b + 1) % k == 0 or b == len(batches) - 1:
            opt.step()
    return list(model.parameters())


@pytest.mark.parametrize("J,method,optimizer", [(1, "petra", "adamw"), (1, "petra", "sgd"),
                                                (4, "backprop", "adamw")])
def test_invariant2_follows_plain_autograd(J, method, optimizer):
    batches = make_batches(8)
    schedule = LRSchedule(0.01 if optimizer == "adamw" else 0.2, 3, warmup_epochs=1,
                          kind="cosine", total_steps=4)
    stages = tiny_stages("revvit", J)
    workers = build_workers(stages, schedule, 2, weight_decay=0.05, optimizer=optimizer)
    LocalEngine(workers, method).train_segment(iter(batches), len(batches))
    got = flat_params(stages)
    want = plain_training("revvit", 2, batches, schedule, optimizer)
    initial = flat_params(tiny_stages("revvit", 1))
    assert max((w - w0).abs().max().item() for w, w0 in zip(want, initial)) > 1e-3
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-9, atol=1e-11)


def test_cosine_schedule_and_adamw_groups():
    s = LRSchedule(1.0, 10, warmup_epochs=1, kind="cosine", total_steps=50)
    assert s(0) == pytest.approx(0.1) and s(9) == pytest.approx(1.0)
    assert s(30) == pytest.approx(0.5 * (1 + math.cos(math.pi * 0.5)))
    assert s(50) == pytest.approx(0.0, abs=1e-12) and s(49) > 0
    (stage,) = tiny_stages("revvit", 1)
    opt = StageOptimizer(stage, s, weight_decay=0.05, name="adamw")
    assert isinstance(opt.torch_optimizer, torch.optim.AdamW)
    names = {id(p): n for n, p in stage.named_parameters()}
    decayed = {names[id(p)] for g in opt.torch_optimizer.param_groups if g["weight_decay"] > 0
               for p in g["params"]}
    assert decayed and all(n.endswith("weight") and "norm" not in n for n in decayed)
    assert not any("pos_embed" in n or n.endswith("bias") for n in decayed)


def test_attention_is_in_the_partition_cost(monkeypatch):
    blocks = build_blocks("revvit", 64, 10, image_size=32, depth=2, heads=2, patch=2)
    costs = block_costs(blocks, 32)
    dim, tokens = 64, 256
    linear = tokens * 12 * dim * dim  # qkv, proj and the 4x MLP, per token
    attention = 2 * 2 * tokens * tokens * (dim // 2)  # q kᵀ and (·) v over 2 heads
    assert costs[1] > linear + attention
    from petra_mpi.models.vit import AttentionCore
    monkeypatch.setattr(AttentionCore, "macs", staticmethod(lambda inputs, output: 0.0))
    without = block_costs(blocks, 32)
    monkeypatch.undo()
    assert costs[1] - without[1] >= attention  # the weightless products are counted
    # balanced: a 4-stage split of 6 blocks keeps the transformer blocks apart
    from petra_mpi.core.partition import balanced_partition
    assert max(balanced_partition(costs, 3)) <= 2


def test_configs_and_validation(tmp_path):
    for name, J in (("quickstart_revvit.yaml", 4), ("revvit/cifar10_petra.yaml", 10),
                    ("revvit/cifar10_backprop.yaml", 10)):
        cfg = load_config(ROOT / "configs" / name)
        assert cfg.model.arch == "revvit" and num_stages(cfg) == J
        assert cfg.optim.name == "adamw" and cfg.optim.schedule == "cosine"
    q = ROOT / "configs" / "quickstart_revvit.yaml"
    for override, message in (("model.heads=3", "model.heads"), ("model.depth=0", "model.depth"),
                              ("optim.name=adam", "optim.name"),
                              ("optim.schedule=linear", "optim.schedule"),
                              ("model.stages=7", "model.stages"),
                              ("optim.betas=[0.9]", "optim.betas")):
        with pytest.raises(ConfigError, match=message):
            load_config(q, [override])


def train_cli(*args, timeout=300):
    import os
    return subprocess.run([sys.executable, "-m", "petra_mpi.train", "configs/quickstart_revvit.yaml",
                           *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})


SMALL = ["--set", "model.width=16", "--set", "model.depth=2", "--set", "model.stages=0",
         "--set", "data.synthetic_train=256", "--set", "data.synthetic_val=64",
         "--set", "data.batch_size=16", "--set", "train.epochs=2", "--set", "run.progress=false",
         "--set", "run.keep_checkpoints=10", "--set", "run.threads=1"]


# extended: the default selection resumes AdamW checkpoints in tests/mpi/test_portable_checkpoint.py
@pytest.mark.extended
def test_adamw_cosine_checkpoint_resume_equals_running_on(tmp_path):
    """Invariant 6 for AdamW and the cosine schedule, in one process: a run resumed from its
    mid-epoch checkpoint (a stop simulated by deleting the later checkpoints) ends with the same
    weights and AdamW moments as the straight run; resuming with another optimizer is refused."""
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    proc = train_cli("--set", f"run.out_dir={straight}", *SMALL,
                     "--set", "run.checkpoint_every_microbatches=8")
    assert proc.returncode == 0, proc.stderr[-3000:]
    import shutil
    shutil.copytree(straight, resumed)  # the same run, stopped after its first checkpoint:
    from petra_mpi.run.checkpoint import complete_checkpoints
    ckpts = complete_checkpoints(str(resumed))
    assert [Path(c).name for c in ckpts][:2] == ["ckpt-e00000-b00000008", "ckpt-e00001-b00000000"]
    for c in ckpts[1:]:  # keep the mid-epoch checkpoint of epoch 1 only: resume from there
        shutil.rmtree(c)
    proc = train_cli("--set", f"run.out_dir={resumed}", *SMALL,
                     "--set", "run.checkpoint_every_microbatches=8")
    assert proc.returncode == 0 and "resumed from" in proc.stderr, proc.stderr[-3000:]
    final = "checkpoints/ckpt-e00002-b00000000"
    for s in range(4):
        a = torch.load(straight / final / f"stage{s}.pt", weights_only=True)
        b = torch.load(resumed / final / f"stage{s}.pt", weights_only=True)
        for key, value in a["stage"].items():
            assert torch.equal(value, b["stage"][key]), (s, key)
        sa, sb = a["optimizer"]["adamw"]["state"], b["optimizer"]["adamw"]["state"]
        assert sa.keys() == sb.keys() and sa
        for i in sa:
            for name in ("exp_avg", "exp_avg_sq", "step"):
                assert torch.equal(sa[i][name], sb[i][name]), (s, i, name)
        assert a["optimizer"]["steps"] == b["optimizer"]["steps"] > 0
    other = train_cli("--set", f"run.out_dir={resumed}", *SMALL, "--set", "optim.name=sgd",
                      "--set", "train.epochs=3", timeout=60)
    assert other.returncode == 1 and "optimizer" in other.stderr


@pytest.mark.extended  # two trainer subprocesses
def test_transformers_are_built_for_the_image_side_the_data_has(tmp_path):
    """The ViT's patch grid follows the images training feeds it, not the stem's usual size: the
    ImageNet stem on the 32-pixel synthetic set, and 64-pixel array data in a dry run (timed by
    --profile at that size) and in training."""
    from test_data_loader import write_h5
    proc = train_cli("--set", "model.stem=imagenet", "--set", "data.crop=192", "--dry-run")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "images 32x32 (synthetic set)" in proc.stdout
    data = tmp_path / "px64.h5"
    write_h5(data, n_train=64, n_val=16, size=64, chunk=16)
    on_64 = [*SMALL, "--set", f"data.path={data}", "--set", "model.num_classes=7",
             "--set", "train.epochs=1", "--set", "train.limit_batches=2",
             "--set", "train.limit_eval_batches=1", "--set", f"run.out_dir={tmp_path / 'run'}"]
    proc = train_cli(*on_64, "--dry-run", "--profile")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "batch 16 of 64x64 images" in proc.stdout and "(3, 64, 64)" in proc.stdout
    proc = train_cli(*on_64)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["epochs"] == 1
