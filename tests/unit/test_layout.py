"""The package's layers (docs/design.md, "Module map"): a module imports only from its own layer
or the layers below it, so each folder can be read, and tested, without the ones above."""
import ast
import pathlib

PACKAGE = pathlib.Path(__file__).resolve().parents[2] / "petra_mpi"
LAYERS = [  # bottom to top
    {"config", "archs", "files"},         # settings, writing a file atomically: no torch
    {"models", "data", "comm"},           # networks, datasets, talking between ranks
    {"core"},                             # the algorithm: schedule, stages, worker, optimizer
    {"engines"},                          # running the schedule: one process or one rank per stage
    {"run"},                              # a training run: trainer, checkpoints, logs, dry run
    {"perf", "prep"},                     # performance model, emulation, benchmarks; packers
    {"train", "evaluate", "export", "generate", "predict", "schedule", "watchdog", "elastic",
     "plot", "bench", "__init__"},        # the commands users run
]
# The one import across layers allowed: the config takes train.method's choices from the
# schedules' table, which is pure data (it imports no torch and nothing of the package).
ALLOWED_UPWARDS = {(("config",), ("core", "schedule"))}


def layer_of(parts):
    for i, names in enumerate(LAYERS):
        if parts[0] in names:
            return i
    raise AssertionError(f"petra_mpi/{'/'.join(parts)} belongs to no layer: add it to LAYERS")


def imports_of(source, module):
    """The petra_mpi modules that `source` (the text of module `module`, a tuple of names under
    petra_mpi) imports, as tuples of names under petra_mpi."""
    package = module[:-1]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[:len(package) - (node.level - 1)]
            elif (node.module or "").startswith("petra_mpi"):
                base = ()
                node.module = node.module.partition(".")[2] or None
            else:
                continue
            if node.module:
                yield base + tuple(node.module.split("."))
            else:  # from PACKAGE import module, module
                yield from (base + (alias.name,) for alias in node.names)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("petra_mpi."):
                    yield tuple(alias.name.split(".")[1:])


def test_no_module_imports_from_a_layer_above_it():
    modules = sorted(PACKAGE.rglob("*.py"))
    assert len(modules) > 40
    wrong = []
    for path in modules:
        parts = path.relative_to(PACKAGE).with_suffix("").parts
        mine = layer_of(parts)
        for target in imports_of(path.read_text(), parts):
            if layer_of(target) > mine and (parts, target) not in ALLOWED_UPWARDS:
                wrong.append(f"{'/'.join(parts)} (layer {mine}) imports {'.'.join(target)} "
                             f"(layer {layer_of(target)})")
    assert not wrong, "\n".join(wrong)


def test_the_schedule_the_config_reads_imports_nothing_of_the_package():
    """core/schedule.py stays pure data for the config below it (no torch, checked by
    test_configs.py): it imports no module of the package."""
    module = ("core", "schedule")
    source = (PACKAGE / "core" / "schedule.py").read_text()
    assert list(imports_of(source, module)) == []


def test_the_check_sees_an_upward_import():
    # a check that cannot fail is no check: a core module importing the trainer is caught
    module = ("core", "x")
    found = list(imports_of("from ..run.trainer import Trainer\nfrom . import schedule\n", module))
    assert found == [("run", "trainer"), ("core", "schedule")]
    assert layer_of(found[0]) > layer_of(module) == layer_of(found[1])
