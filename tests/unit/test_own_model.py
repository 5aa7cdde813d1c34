"""A network of one's own (model.arch an import path, models/own.py): built from a package written
for the test, its errors in one line, PETRA's gradient against autograd's on its blocks
(invariant 1, float64), kept blocks, the block-cost estimate, the dry run, model files that name
it, and python -m petra_mpi.check_model on the built-in nets and on every fault of
examples/broken.py."""
import contextlib
import io
import re
import sys

import pytest
import torch
from torch import nn

from petra_mpi import check_model
from petra_mpi.config import ConfigError, load_config, validate
from petra_mpi.core.blockcheck import check_blocks
from petra_mpi.core.partition import block_costs
from petra_mpi.core.planner import plan_layout
from petra_mpi.engines.build import build_workers
from petra_mpi.engines.local import LocalEngine
from petra_mpi.core.optim import LRSchedule
from petra_mpi.models import NetSpec, OwnModelError, build_blocks, build_network
from tests.support.nets import (applied_gradients, end_to_end_gradients, in_flight, make_batches,
                                max_relative_error, stages_of)
from tests.support.own_nets import LANGUAGE, PACKAGE, PICTURES, forget_package, write_package
from tests.support.paths import ROOT

EXAMPLES = ROOT / "examples"


pytestmark = pytest.mark.usefixtures("one_thread")  # nets this small: more threads only wait


@pytest.fixture
def package(tmp_path, monkeypatch):
    """The network package, written into tmp_path, on the Python path for the test."""
    write_package(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path / PACKAGE
    forget_package()


def quiet(fn, *args):
    """(fn's result, its stdout, its stderr)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        result = fn(*args)
    return result, out.getvalue(), err.getvalue()


# ---- building from the import path -------------------------------------------------------------

def test_the_import_path_builds_the_users_blocks(package):
    blocks = build_blocks(PICTURES, 4, 10)
    assert [type(b).__name__ for b in blocks] == ["Sequential", "AdditiveCoupling", "ChannelScale",
                                                  "ReversibleBlock", "Sequential", "Head"]
    # an ordinary block that does not say is marked so; the reversible ones said it themselves
    assert [b.reversible for b in blocks] == [False, True, True, True, False, False]
    net = NetSpec(PICTURES, 4, 10, image_size=8)
    assert (net.num_blocks, net.takes_tokens, net.input_shape) == (6, False, (3, 8, 8))
    lm = NetSpec(LANGUAGE, 8, 11, model_kw={"depth": 2, "heads": 2, "context": 5})
    assert (lm.num_blocks, lm.takes_tokens, lm.zeros(3).shape) == (4, True, (3, 5))
    x = torch.randn(2, 3, 8, 8)
    for block in blocks:
        x = block(x)
    assert x.shape == (2, 10)


FAULTY = '''
from torch import nn
def raises(model):
    return [nn.Linear(2, 2)] * int("two")
def not_modules(model):
    return [nn.Linear(2, 2), "a head"]
class NoInverse(nn.Linear):
    reversible = True
def no_inverse(model):
    return [NoInverse(2, 2)]
'''


@pytest.mark.parametrize("arch,message", [
    ("no_such_pkg.net:build", "no module no_such_pkg (on the Python path"),
    (f"{PACKAGE}.net:nothing", f"{PACKAGE}.net has no function nothing"),
    (f"{PACKAGE}.broken:build", "importing own_net_pkg.broken raised SyntaxError"),
    (f"{PACKAGE}.faulty:raises", "building the blocks raised ValueError: invalid literal"),
    (f"{PACKAGE}.faulty:not_modules", "block 1 is a str, not a torch.nn.Module"),
    (f"{PACKAGE}.faulty:no_inverse", "block 0 (NoInverse) is declared reversible but has no "
                                     "inverse(y)"),
])
def test_a_network_that_cannot_be_built_is_one_line(package, arch, message):
    (package / "broken.py").write_text("def build(model):\n    return [\n")
    (package / "faulty.py").write_text(FAULTY)
    with pytest.raises(OwnModelError) as e:
        build_blocks(arch, 4, 10)
    assert str(e.value).startswith(f"model.arch {arch}: ") and message in str(e.value)
    assert "\n" not in str(e.value)
    if arch.endswith(":raises"):  # where the user's code raised
        assert f"(at {package / 'faulty.py'}:4)" in str(e.value)


def test_the_config_takes_an_import_path_and_its_options():
    quick = ROOT / "configs" / "quickstart.yaml"
    cfg = load_config(quick, [f"model.arch={PICTURES}", "model.options={levels: 3}",
                              "model.stages=20"])
    assert cfg.model.arch == PICTURES and cfg.model.options == {"levels": 3}
    with pytest.raises(ConfigError, match="has 6 blocks: use 1 to 6 stages"):
        validate(cfg, blocks=6)  # the count known once built (the start of a run checks it)
    for arch in ("pkg.module:", "pkg module:build", "pkg.module:build:x"):
        with pytest.raises(ConfigError, match=r"model.arch: must be one of resnet18, .*, got "
                                              r".*, or a network of your own: an import path "
                                              r"package.module:function"):
            load_config(quick, [f"model.arch={arch}"])
    with pytest.raises(ConfigError, match="model.options: belongs to a network of your own"):
        load_config(quick, ["model.options={levels: 3}"])


# ---- what PETRA computes on its blocks ---------------------------------------------------------

@pytest.mark.parametrize("J", [2, 6])
def test_petras_gradient_is_reversible_backprops_float64(package, J):
    """Invariant 1 on the network of one's own: at lr = 0 PETRA's accumulated gradient equals
    the end-to-end gradient to float64 rounding; J = 6 puts every block on a stage of its own,
    the channel scale (an inverse alone) rebuilt by the stage's generic path."""
    batches = make_batches(5)
    got, stages = applied_gradients(PICTURES, J, 2, batches)
    assert [b.reversible for s in stages for b in s.blocks][1:4] == [True] * 3
    want = end_to_end_gradients(PICTURES, 2, batches)
    assert max_relative_error(got, want) < 1e-10
    assert all(in_flight(s) == 0 for s in stages)


def test_kept_blocks_on_its_blocks_are_delayed_with_buffers_and_stash(package):
    """Every block before the last stage keeping every micro-batch trains as `delayed` with
    buffer_inputs and stash_weights (invariant 7), and a budget plans its blocks."""
    def trained(method="petra", **kw):
        stages = stages_of(PICTURES, 4, 10, 3, partition=[2, 2, 2], image_size=8,
                           dtype=torch.float64, method=method, **kw)
        workers = build_workers(stages, LRSchedule(0.2, 10**6), 2, momentum=0.9)
        LocalEngine(workers, method).train_segment(iter(make_batches(7)), 7)
        return [t for s in stages for t in (*s.parameters(), *s.buffers())]
    kept = trained(kept=[[4, 4], [2, 2], [0, 0]])
    delayed = trained("delayed", buffer_inputs=True, stash_weights=True)
    for a, b in zip(kept, delayed):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-13)
    assert max((a - b).abs().max() for a, b in zip(kept, trained()) if a.is_floating_point()) \
        > 1e-4  # PETRA differs: the test has teeth
    layout = plan_layout(NetSpec(PICTURES, 4, 10, image_size=8), 3, budget="auto", batch_size=4)
    assert [len(k) for k in layout.kept] == layout.split and any(map(any, layout.kept))


class FunctionalConv(nn.Module):
    """A convolution in the forward's own code, which no module of it holds."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(16, 16, 3, 3))

    def forward(self, x):
        return torch.nn.functional.conv2d(x, self.weight, padding=1)


def test_the_estimate_counts_every_operation_of_blocks_it_does_not_know():
    """every_op (a network of one's own): the products of any operation count, a functional
    convolution or a transposed one, which the module list leaves at their output's size; on the
    blocks the list knows, both count the same."""
    x = torch.zeros(1, 16, 8, 8)
    blocks = [FunctionalConv(), nn.ConvTranspose2d(16, 16, 2, stride=2)]
    listed, every = block_costs(blocks, 8, x), block_costs(blocks, 8, x, every_op=True)
    assert every[0] - listed[0] == 16 * 16 * 9 * 64  # its multiply-accumulates
    assert every[1] - listed[1] == 16 * 16 * 4 * 64  # each input pixel to a 2 x 2 patch
    revnet = build_blocks("revnet18", 4, 10)
    assert block_costs(revnet, 16, every_op=True) == block_costs(revnet, 16)


def test_the_dry_run_names_its_blocks(package, capsys):
    from petra_mpi.run.dryrun import report
    cfg = load_config(ROOT / "configs" / "quickstart.yaml",
                      [f"model.arch={PICTURES}", "model.partition=[2, 2, 2]",
                       "model.stages=3", "data.batch_size=4"])
    assert report(cfg, 3) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"{PICTURES} width 8, 3 stages")
    listed = out.split("blocks per stage (rev: rebuilds its input, buf: keeps it):\n")[1]
    assert listed.startswith("    0  Sequential (buf), AdditiveCoupling (rev)\n"
                             "    1  ChannelScale (rev), ReversibleBlock (rev)\n"
                             "    2  Sequential (buf), Head (buf)\n")


# ---- model files that name it ------------------------------------------------------------------

def model_file(path, network):
    from petra_mpi.export import MODEL_FORMAT
    torch.manual_seed(0)
    torch.save({"format": MODEL_FORMAT, "network": network,
                "state_dict": build_network(**network).state_dict(),
                "data": {"path": "synthetic", "batch_size": 4, "synthetic_train": 8,
                         "synthetic_val": 8, "synthetic_seed": 0, "crop": None}}, path)
    return str(path)


def test_a_model_file_imports_its_network_only_when_the_command_names_it(package, tmp_path):
    """A file names a network of one's own, and so code: evaluate, predict and generate import it
    only with --arch naming the same import path (one line otherwise, before anything runs)."""
    from petra_mpi import evaluate, generate
    network = dict(arch=PICTURES, width=4, num_classes=10, image_size=32, depth=8, heads=0,
                   patch=4, context=64, tie_weights=False, options={})
    path = model_file(tmp_path / "model.pt", network)
    forget_package()  # a new process: nothing imported yet
    status, _, err = quiet(evaluate.main, [path])
    assert status == 2 and err.count("\n") == 1
    assert f"its network is {PICTURES}, a network of your own: name it with --arch" in err
    assert not any(name.startswith(PACKAGE) for name in __import__("sys").modules)
    status, out, err = quiet(evaluate.main, [path, "--arch", PICTURES, "--data", "synthetic"])
    assert status == 0 and out.startswith(f"{PICTURES} on synthetic (val, 8 images)"), err
    # a causal language model of one's own generates text
    lm = dict(arch=LANGUAGE, width=8, num_classes=256, image_size=16, depth=1, heads=2,
              patch=4, context=16, tie_weights=False, options={})
    path = model_file(tmp_path / "lm.pt", lm)
    status, _, err = quiet(generate.main, [path, "--prompt", "ab", "--tokens", "3"])
    assert status == 2 and "name it with --arch" in err
    status, out, err = quiet(generate.main, [path, "--prompt", "ab", "--tokens", "3", "--arch",
                                             LANGUAGE, "--seed", "1"])
    assert status == 0 and out.startswith("ab"), err


# ---- check_model -------------------------------------------------------------------------------

def checked(net: NetSpec):
    def make_input(n, dtype):
        if net.takes_tokens:
            return torch.randint(0, net.num_classes, (n, *net.input_shape))
        return torch.randn(n, *net.input_shape, dtype=dtype)
    return check_blocks(lambda dtype: [b.to(dtype) for b in net.blocks()], make_input)


@pytest.mark.parametrize("net", [
    NetSpec("revnet18", 2, 10, image_size=8),
    NetSpec("irevnet18", 2, 10, image_size=8),
    NetSpec("revlm", 8, 11, model_kw=dict(depth=2, heads=2, context=6, tie_weights=False)),
], ids=lambda net: net.arch)
def test_the_built_in_nets_pass_the_check(net):
    report = checked(net)
    assert report.problem is None, report.problem
    assert len(report.blocks) == net.num_blocks and report.gradient < 1e-12
    rebuilt = [b.rebuilt64 for b in report.blocks if b.reversible]
    assert rebuilt and max(rebuilt) < 1e-12 and max(b.gradient for b in report.blocks) < 1e-12


@pytest.mark.parametrize("fault,block,message", [
    ("dropout", "AdditiveCoupling", "its forward gives another output for the same input"),
    ("batchnorm", "AdditiveCoupling", "its forward changes its buffer 'f.1.running_mean'"),
    ("inverse", "WrongInverse", "its inverse is wrong: inverse(forward(x)) is"),
    ("not_invertible", "DropsHalf", "declared reversible, but its forward is not invertible: it "
                                    "maps two inputs"),
    ("gradient", "ForgetfulBackward", "PETRA's gradient differs from autograd's by"),
])
def test_check_model_names_the_faulty_block(fault, block, message, monkeypatch):
    monkeypatch.chdir(ROOT)
    status, out, err = quiet(check_model.main, [str(EXAMPLES / "broken.yaml"), "--set",
                                                f"model.options={{fault: {fault}}}"])
    assert status == 2 and err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith(f"error: model.arch examples.broken:build: block 2 ({block}): "
                          f"{message}"), err
    assert " 1  AdditiveCoupling         rev" in out  # the sound blocks before it, in the table


@pytest.mark.parametrize("arch,message", [
    ("examples.nowhere:build", "no module examples.nowhere"),
    ("examples.broken:not_a_network", "returned dict, not a non-empty list of blocks"),
])
def test_check_model_refuses_what_is_not_a_network(arch, message, monkeypatch):
    monkeypatch.chdir(ROOT)
    status, out, err = quiet(check_model.main, [str(EXAMPLES / "broken.yaml"), "--set",
                                                f"model.arch={arch}"])
    assert (status, out) == (2, "") and err == f"error: model.arch {arch}: {message}" + \
        err.split(message, 1)[1] and err.count("\n") == 1


def test_check_model_passes_the_example_network(monkeypatch):
    monkeypatch.chdir(ROOT)
    status, out, err = quiet(check_model.main, [str(EXAMPLES / "revunet.yaml"), "--set",
                                                "model.width=2", "--set",
                                                "model.options={coupling: affine}"])
    assert status == 0, err
    assert "    3  Squeeze                  rev      0.0e+00     0.0e+00      0.0e+00" in out
    assert out.splitlines()[-1].startswith("ok: examples.revunet:build, 7 blocks (5 reversible)")


def test_the_documented_network_passes_the_check(tmp_path, monkeypatch):
    """The whole network that docs/own_model.md writes out, as a user would copy it."""
    page = (ROOT / "docs" / "own_model.md").read_text()
    (code,) = re.findall(r"^```python\n(.*?)^```", page, re.S | re.M)
    (tmp_path / "doc_net.py").write_text(code)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "doc_net", raising=False)
    report = checked(NetSpec("doc_net:build", 4, 10, image_size=8, model_kw={"depth": 2}))
    assert report.problem is None and [b.name for b in report.blocks] == \
        ["Sequential", "AdditiveCoupling", "AdditiveCoupling", "Sequential"]
    monkeypatch.delitem(sys.modules, "doc_net")


SHORT = ["--set", "train.limit_batches=2", "--set", "train.limit_eval_batches=1"]  # should it run


@pytest.mark.parametrize("sets,message", [
    (["--set", "model.options={fault: inverse}"],
     "error: model.arch examples.broken:build: block 2 (WrongInverse): its inverse is wrong"),
    (["--set", "model.options={fault: dropout}", "--set", "model.stages=5"],
     "error: model.arch examples.broken:build: block 2 (AdditiveCoupling): its forward gives"),
    (["--set", "model.arch=examples.revunet:build", "--set", "model.width=2", "--set",
      "model.depth=2", "--set", "model.stages=9"],
     "model.stages: examples.revunet:build has 7 blocks: use 1 to 7 stages"),
])
def test_a_run_checks_its_network_and_block_count_first(sets, message, tmp_path, monkeypatch):
    """The train command, before anything else starts: one line, exit status 2, no output."""
    from petra_mpi import train
    monkeypatch.chdir(ROOT)
    status, _, err = quiet(train.main, [str(EXAMPLES / "broken.yaml"), "--set",
                                        f"run.out_dir={tmp_path / 'run'}", *SHORT, *sets])
    assert status == 2 and message in err and err.count("\n") == 1, err
    assert not (tmp_path / "run").exists()
