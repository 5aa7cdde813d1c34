"""The package's layers (docs/design.md, "Module map"): a module imports only from its own layer
or the layers below it, so each folder can be read, and tested, without the ones above; and only
comm/ talks across ranks (mpi4py is imported there alone, and no one else reaches for a world's
communicator: World is the one object that talks across ranks)."""
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
     "plot", "bench", "check_model", "__init__"},  # the commands users run
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


def test_the_schedule_the_config_reads_imports_nothing_but_the_channel_table():
    """core/schedule.py stays pure data for the config below it (no torch, checked by
    test_configs.py): of the package it imports only the channel table (comm/channels.py), which
    imports nothing of the package."""
    schedule = list(imports_of((PACKAGE / "core" / "schedule.py").read_text(), ("core", "schedule")))
    assert schedule == [("comm", "channels")]
    channels = (PACKAGE / "comm" / "channels.py").read_text()
    assert list(imports_of(channels, ("comm", "channels"))) == []


def test_the_check_sees_an_upward_import():
    # a check that cannot fail is no check: a core module importing the trainer is caught
    module = ("core", "x")
    found = list(imports_of("from ..run.trainer import Trainer\nfrom . import schedule\n", module))
    assert found == [("run", "trainer"), ("core", "schedule")]
    assert layer_of(found[0]) > layer_of(module) == layer_of(found[1])


def talks_across_ranks(source):
    """What `source` does that only comm/ may: imports of mpi4py, and uses of a world's
    communicator (world.comm, self.world.comm, bench.world.comm...)."""
    def names_a_world(node):
        return (isinstance(node, ast.Name) and node.id == "world"
                or isinstance(node, ast.Attribute) and node.attr == "world")
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            yield from (f"imports {a.name}" for a in node.names
                        if a.name.split(".")[0] == "mpi4py")
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            if node.module.split(".")[0] == "mpi4py":
                yield f"imports from {node.module}"
        elif isinstance(node, ast.Attribute) and node.attr == "comm" and names_a_world(node.value):
            yield f"line {node.lineno}: uses {ast.unparse(node)}"


def test_only_comm_talks_across_ranks():
    wrong = []
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE).with_suffix("").parts
        if parts[0] != "comm":
            wrong += [f"{'/'.join(parts)}: {what}" for what in talks_across_ranks(path.read_text())]
    assert not wrong, "\n".join(wrong)


def test_the_check_sees_mpi_and_a_worlds_communicator():
    found = list(talks_across_ranks(
        "import mpi4py\nfrom mpi4py import MPI\nx = world.comm.bcast(1)\n"
        "self.world.comm.Barrier()\nn = cfg.comm.forward\nfrom .comm import world\n"))
    assert found == ["imports mpi4py", "imports from mpi4py", "line 3: uses world.comm",
                     "line 4: uses self.world.comm"]
