"""Every shipped config under configs/ loads, passes `--dry-run`, and says what its experiment needs.

The dry runs are in-process (`petra_mpi.train.main`) to skip interpreter start-up; each builds the
full-width model and pushes one image through it.
"""
import dataclasses
import re
import subprocess
import sys
import typing
from pathlib import Path

import pytest

from tests.support.paths import ROOT
from petra_mpi.config import AtLeast, Config, ConfigError, load_config, num_stages
from petra_mpi.models import ARCHS, PRECISIONS, num_blocks
from petra_mpi.models.vit import VIT_ARCHS
from petra_mpi.models.lm import LM_ARCHS
from petra_mpi.models.invertible import INVERTIBLE_ARCHS
from petra_mpi.comm.compress import DIRECTIONS, FORMATS
from petra_mpi.core.optim import OPTIMIZERS
from petra_mpi.core.schedule import METHODS
from petra_mpi.core.optim import peak_lr
from petra_mpi.train import main

CONFIGS = ROOT / "configs"
BASES = sorted((CONFIGS / "base").glob("*.yaml"))
LEAVES = sorted(p for p in CONFIGS.rglob("*.yaml") if "base" not in p.relative_to(CONFIGS).parts)


def rel(path: Path) -> str:
    return path.relative_to(CONFIGS).as_posix()


def cfg_of(name: str, overrides=()):
    return load_config(CONFIGS / name, overrides)


def test_discovery():
    names = {rel(p) for p in LEAVES}
    assert "quickstart.yaml" in names
    counts = {d: sum(n.startswith(d + "/") for n in names)
              for d in ("table2", "fig4", "table3", "table4", "table5", "fig5")}
    assert counts == {"table2": 28, "fig4": 7, "table3": 4, "table4": 15, "table5": 6, "fig5": 1}


# The default selection dry-runs two configs; the others build full-size models for minutes.
DRY_RUN_BY_DEFAULT = {"quickstart.yaml", "cifar10.yaml"}


@pytest.mark.parametrize("path", [
    pytest.param(p, marks=() if rel(p) in DRY_RUN_BY_DEFAULT else pytest.mark.extended, id=rel(p))
    for p in LEAVES])
def test_dry_run(path, capsys):
    cfg = load_config(path)
    J = num_stages(cfg)
    named = re.search(r"_j(\d+)$", path.stem)  # a config for one J says so in its name
    if named:
        assert J == int(named.group(1)), "the stages the file name says"
    elif not path.name.startswith("quickstart"):  # the quickstarts use 4 stages to be quick
        assert J == num_blocks(cfg.model.arch, cfg.model.depth), "one stage per block"
    assert main([str(path), "--dry-run"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[0].startswith(f"{cfg.model.arch} width {cfg.model.width}, {J} stages, method "
                               f"{cfg.train.method}, batch {cfg.data.batch_size}")
    end = next(i for i, line in enumerate(lines) if "total estimated memory" in line)
    # then a budget's kept plan, then each stage's delay (for a method with delays)
    sections = [line.split()[0] for line in lines[end + 1:]
                if line.startswith(("kept blocks", "delays"))]
    assert sections == (["kept"] * bool(cfg.model.memory_budget)
                        + ["delays"] * (cfg.train.method != "backprop" and J > 1))
    rows = [line.split() for line in lines[2:end] if line.split() and line.split()[0].isdigit()]
    assert [int(r[0]) for r in rows] == list(range(J))
    assert rows[-1][-1] != "0.00"


@pytest.mark.parametrize("path", BASES, ids=rel)
def test_bases_load(path):
    cfg = load_config(path)
    assert cfg.optim.lr == 0.1 and cfg.optim.nesterov and cfg.optim.momentum == 0.9
    assert cfg.model.width == 64 and cfg.run.out_dir.endswith("/default")


def test_out_dirs_follow_file_names():
    """runs/<path under configs without .yaml>: unique, and easy to find from the config."""
    for path in LEAVES:
        assert load_config(path).run.out_dir == "runs/" + rel(path)[:-len(".yaml")], path


RECIPES = {  # dataset: (path, classes, stem, epochs, milestones, weight decay)
    "cifar10": ("data/cifar10.h5", 10, "cifar", 300, [150, 225], 5e-4),
    "imagenet32": ("data/imagenet32.h5", 1000, "cifar", 90, [30, 60, 80], 1e-4),
    "imagenet": ("data/imagenet.h5", 1000, "imagenet", 90, [30, 60, 80], 1e-4),
    "cifar100": ("data/cifar100.h5", 100, "cifar", 300, [150, 225], 5e-4),
}


def check_recipe(cfg, dataset):
    path, classes, stem, epochs, milestones, wd = RECIPES[dataset]
    assert (cfg.data.path, cfg.model.num_classes, cfg.model.stem) == (path, classes, stem)
    assert (cfg.train.epochs, cfg.optim.milestones, cfg.optim.weight_decay) == (epochs, milestones, wd)
    assert (cfg.optim.warmup_epochs, cfg.optim.gamma, cfg.optim.momentum) == (5, 0.1, 0.9)
    assert cfg.optim.nesterov and cfg.model.width == 64
    if stem == "imagenet":
        assert cfg.data.crop == 224


@pytest.mark.parametrize("dataset", ["cifar10", "imagenet32", "imagenet"])
def test_table2(dataset):
    petra_k = {"cifar10": 4, "imagenet32": 4, "imagenet": 32}[dataset]
    backprop_batch = {"cifar10": 128, "imagenet32": 128, "imagenet": 256}[dataset]
    for arch in ("resnet18", "resnet34", "resnet50", "revnet18", "revnet34", "revnet50"):
        for method in ("backprop", "petra") if arch.startswith("revnet") else ("backprop",):
            cfg = cfg_of(f"table2/{dataset}/{arch}_{method}.yaml")
            check_recipe(cfg, dataset)
            assert (cfg.model.arch, cfg.train.method) == (arch, method)
            k = cfg.train.accumulation
            peak = peak_lr(cfg.optim.lr, cfg.data.batch_size, k, cfg.optim.scale_lr)
            if method == "petra":
                assert (cfg.data.batch_size, k) == (64, petra_k)
                assert peak == pytest.approx(0.1 * 64 * petra_k / 256)
            else:
                assert (cfg.data.batch_size, k) == (backprop_batch, 1)
                assert peak == pytest.approx(0.1)


def test_fig4_lr_rule():
    for k in (1, 2, 4, 8, 16, 32):
        cfg = cfg_of(f"fig4/revnet18_imagenet_k{k}.yaml")
        check_recipe(cfg, "imagenet")
        assert (cfg.model.arch, cfg.train.method, cfg.train.accumulation) == ("revnet18", "petra", k)
        assert cfg.optim.lr == 0.1 and cfg.optim.scale_lr and cfg.data.batch_size == 64
        assert peak_lr(cfg.optim.lr, cfg.data.batch_size, k, cfg.optim.scale_lr) == \
            pytest.approx(0.1 * 64 * k / 256)
    ref = cfg_of("fig4/revnet18_imagenet_backprop.yaml")
    assert (ref.model.arch, ref.train.method, ref.train.accumulation) == ("revnet18", "backprop", 1)
    # --set overrides apply on top of the chain of bases
    cfg = cfg_of("fig4/revnet18_imagenet_k1.yaml", ["train.accumulation=16", "optim.lr=0.2"])
    assert (cfg.train.accumulation, cfg.optim.lr, cfg.optim.weight_decay) == (16, 0.2, 1e-4)


TABLE4_ROWS = {  # row: (method, buffer_inputs, stash_weights)
    "backprop": ("backprop", False, False),
    "delayed_both": ("delayed", True, True),
    "delayed_inputs": ("delayed", True, False),
    "delayed_params": ("delayed", False, True),
    "petra": ("petra", False, False),
}


@pytest.mark.parametrize("depth", [18, 34, 50])
def test_table4_inherits_cifar100_recipe(depth):
    for row, expected in TABLE4_ROWS.items():
        cfg = cfg_of(f"table4/revnet{depth}_{row}.yaml")
        check_recipe(cfg, "cifar100")
        assert cfg.model.arch == f"revnet{depth}"
        assert (cfg.train.method, cfg.train.buffer_inputs, cfg.train.stash_weights) == expected
        assert (cfg.train.accumulation, cfg.data.batch_size, cfg.optim.scale_lr) == (1, 64, True)


def test_table3_and_table5():
    for row in ("delayed_both", "delayed_inputs", "delayed_params", "petra"):
        cfg = cfg_of(f"table3/revnet50_imagenet_{row}.yaml")
        check_recipe(cfg, "imagenet")
        assert (cfg.train.method, cfg.train.buffer_inputs, cfg.train.stash_weights) == TABLE4_ROWS[row]
        assert (cfg.model.arch, cfg.data.batch_size) == ("revnet50", 64)
    for depth in (18, 34, 50):
        for method in ("petra", "backprop"):
            cfg = cfg_of(f"table5/revnet{depth}_{method}.yaml")
            assert (cfg.model.arch, cfg.train.method, cfg.data.path) == (f"revnet{depth}", method,
                                                                         "data/cifar10.h5")
            assert (cfg.data.batch_size, cfg.train.accumulation) == (256, 1)
            assert cfg.model.stages == (10 if depth == 18 else 18)
            assert cfg.train.epochs * 50000 // 256 >= 550  # 500 warm-up + 50 timed micro-batches


@pytest.mark.parametrize("name,table2", [("cifar10.yaml", "table2/cifar10/revnet18_petra.yaml"),
                                         ("imagenet.yaml", "table2/imagenet/revnet50_petra.yaml")])
def test_mission_configs_are_table2_runs(name, table2):
    """configs/cifar10.yaml and configs/imagenet.yaml are Table 2 PETRA runs under another run dir."""
    cfg, ref = cfg_of(name), cfg_of(table2)
    assert cfg.run.out_dir == "runs/" + name[:-len(".yaml")]
    same = cfg_of(table2, [f"run.out_dir={cfg.run.out_dir}"])
    for section in ("run", "model", "data", "train", "optim"):
        assert getattr(cfg, section) == getattr(same, section), section
    assert num_stages(cfg) == {"cifar10.yaml": 10, "imagenet.yaml": 18}[name] == num_stages(ref)


def python(code: str):
    """A fresh interpreter running `code` from the repository (its imports start afresh)."""
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60, cwd=ROOT)


def test_loading_and_validating_a_config_does_not_import_torch():
    """Every rank checks its config (and the world size) before torch loads: 24 ranks loading
    torch on a small node take minutes just to report a wrong world size."""
    proc = python("import sys\n"
                  "from petra_mpi.config import load_config, validate\n"
                  "from petra_mpi import train\n"
                  "validate(load_config('configs/quickstart.yaml'), 4)\n"
                  # a network of one's own: its import path is checked, its module not imported
                  "own = load_config('configs/quickstart.yaml', ['model.arch=examples.revunet:"
                  "build', 'model.options={levels: 2}'])\n"
                  "validate(own, 4)\n"
                  "assert own.model.arch == 'examples.revunet:build'\n"
                  "assert 'torch' not in sys.modules, 'torch was imported'\n"
                  "assert 'examples.revunet' not in sys.modules\n")
    assert proc.returncode == 0, proc.stderr[-2000:]


def literal_fields():
    for section in dataclasses.fields(Config):
        if section.name == "source":
            continue
        for name, hint in typing.get_type_hints(section.type).items():
            if typing.get_origin(hint) is typing.Literal:
                yield f"{section.name}.{name}", typing.get_args(hint)


def test_choices_are_literal_types_checked_by_the_loader():
    choices = dict(literal_fields())
    assert {"run.device", "run.dtype", "run.precision", "model.arch", "model.stem",
            "model.balance", "data.decode_pool", "train.method", "optim.name",
            "optim.schedule", "comm.forward", "comm.buffers"} <= choices.keys()
    for key, allowed in choices.items():
        cfg_of("quickstart.yaml", [f"{key}={allowed[-1]}"])  # each choice loads
        with pytest.raises(ConfigError, match=rf"{key}: must be one of {', '.join(allowed)}"):
            cfg_of("quickstart.yaml", [f"{key}=bogus"])


def test_literal_choices_are_what_the_code_implements():
    choices = dict(literal_fields())
    assert set(choices["model.arch"]) == (set(ARCHS) | set(INVERTIBLE_ARCHS) | set(VIT_ARCHS)
                                          | set(LM_ARCHS))
    for direction in DIRECTIONS:
        assert choices[f"comm.{direction}"] == FORMATS
    assert choices["train.method"] == METHODS
    assert choices["optim.name"] == OPTIMIZERS
    assert set(choices["run.precision"]) == set(PRECISIONS)


def test_a_schedule_added_to_the_table_is_a_method_the_config_takes():
    """train.method's choices are the names of core/schedule.py's SCHEDULES: a schedule
    registered there before the config is read is a method a config may name."""
    toy = "type('Toy', (schedule.PetraSchedule,), {'method': 'toy'})"
    proc = python(f"from petra_mpi.core import schedule\nschedule.SCHEDULES['toy'] = {toy}\n"
                  "from petra_mpi.config import load_config as load\n"
                  "print(load('configs/quickstart.yaml', ['train.method=toy']).train.method)")
    assert proc.returncode == 0 and proc.stdout.split() == ["toy"], proc.stderr[-2000:]


def test_update_batch_derives_k_and_keeps_the_recipe_per_update():
    """train.update_batch: 128 images per update in micro-batches of 16 is k = 8, and the peak
    learning rate and the steps are those of k = 8 set directly."""
    from petra_mpi.run.assemble import run_lr_schedule
    stated = cfg_of("quickstart.yaml", ["train.update_batch=128", "data.batch_size=16"])
    direct = cfg_of("quickstart.yaml", ["train.accumulation=8", "data.batch_size=16"])
    assert stated.train.accumulation == direct.train.accumulation == 8
    assert run_lr_schedule(stated, 25).peak == run_lr_schedule(direct, 25).peak
    # 0 (the default): k is train.accumulation, the file's 2 here
    assert cfg_of("quickstart.yaml", ["train.update_batch=0"]).train.accumulation == 2


@pytest.mark.parametrize("sets,expect", [
    (["train.update_batch=100", "data.batch_size=16"],
     "train.update_batch: 100 images per update is not a whole number of micro-batches of "
     "data.batch_size 16"),
    (["train.update_batch=8", "data.batch_size=16"], "not a whole number of micro-batches"),
    (["train.update_batch=128", "data.batch_size=16", "train.accumulation=2"],
     "train.update_batch: 128 images per update in micro-batches of 16 is k = 8, but "
     "train.accumulation is 2"),
])
def test_update_batch_errors_are_one_line(sets, expect):
    with pytest.raises(ConfigError) as e:
        cfg_of("quickstart.yaml", sets)
    assert expect in str(e.value) and "\n" not in str(e.value)


def test_update_batch_and_accumulation_in_layers(tmp_path):
    """Set in one file the two keys must agree; a later layer's (a file based on another, the
    --set's) replaces the other key an earlier one set, either way."""
    both = tmp_path / "both.yaml"
    both.write_text(f"base: {CONFIGS / 'quickstart.yaml'}\n"
                    "data: {batch_size: 16}\ntrain: {update_batch: 128, accumulation: 4}\n")
    with pytest.raises(ConfigError, match=f"{both}: train.update_batch: .* is k = 8, but "
                                          "train.accumulation is 4"):
        load_config(both)
    based = tmp_path / "based.yaml"  # quickstart's accumulation 2 gives way
    based.write_text(f"base: {CONFIGS / 'quickstart.yaml'}\n"
                     "data: {batch_size: 16}\ntrain: {update_batch: 128}\n")
    assert load_config(based).train.accumulation == 8
    later = load_config(based, ["train.accumulation=4"])  # and gives way to a later k
    assert (later.train.accumulation, later.train.update_batch) == (4, 0)


# the deep CPU configs (file: J, updates stage 0 may be late, images or windows per update), and
# their backprop twins with the same per update in larger micro-batches (no delay to shorten)
DEEP = {"fashion_mnist.yaml": (10, 2.25, 128), "lm/shakespeare_cpu.yaml": (6, 2.5, 12)}
TWINS = {"fashion_mnist_backprop.yaml": "fashion_mnist.yaml",
         "lm/shakespeare_cpu_backprop.yaml": "lm/shakespeare_cpu.yaml"}


@pytest.mark.parametrize("name", sorted(DEEP))
def test_deep_configs_shorten_the_delay_in_updates(name):
    """The deep configs take the same images per update in smaller micro-batches, so that stage
    0's gradient is d_0 / k updates late as measured (fashion_mnist.yaml at J = 10: 2.25, not 9
    in micro-batches of 64), and the language model's last stage has beta1 = 0."""
    from petra_mpi.core.schedule import schedule_for
    J, late, per_update = DEEP[name]
    cfg = cfg_of(name)
    assert num_stages(cfg) == J
    assert cfg.data.batch_size * cfg.train.accumulation == per_update
    assert schedule_for(cfg.train.method, J, cfg.train.accumulation).delay_in_updates(0) == late
    if cfg.optim.name == "adamw":
        assert cfg.optim.delay_free_momentum == 0


@pytest.mark.parametrize("twin", sorted(TWINS))
def test_backprop_twins_take_the_same_images_per_update(twin):
    cfg, petra = cfg_of(twin), cfg_of(TWINS[twin])
    assert cfg.train.method == "backprop" and petra.train.method == "petra"
    assert (cfg.data.batch_size * cfg.train.accumulation
            == petra.data.batch_size * petra.train.accumulation)
    assert cfg.data.batch_size * cfg.train.limit_batches == (
        petra.data.batch_size * petra.train.limit_batches)  # the same images per epoch
    assert cfg.data.batch_size * cfg.train.limit_eval_batches == (
        petra.data.batch_size * petra.train.limit_eval_batches)  # and evaluated on
    assert (cfg.train.epochs, cfg.optim.lr, cfg.optim.schedule) == (
        petra.train.epochs, petra.optim.lr, petra.optim.schedule)


def test_bounds_are_annotations_checked_by_the_loader():
    bounded = {}
    for section in dataclasses.fields(Config):
        if section.name == "source":
            continue
        for name, hint in typing.get_type_hints(section.type, include_extras=True).items():
            if typing.get_origin(hint) is typing.Annotated and \
                    isinstance(hint.__metadata__[0], AtLeast):
                bounded[f"{section.name}.{name}"] = hint.__metadata__[0].low
    assert {"train.epochs", "train.accumulation", "data.batch_size", "model.width",
            "model.num_classes", "optim.lr", "run.keep_checkpoints"} <= bounded.keys()
    for key, low in bounded.items():
        cfg_of("quickstart.yaml", [f"{key}={low}"])  # the bound itself loads
        with pytest.raises(ConfigError, match=rf"{key}: must be >= {low}, got -?[0-9.]+"):
            cfg_of("quickstart.yaml", [f"{key}={low - 1}"])
