"""The shell commands of README.md and docs/*.md, as a reader meets them, and what each one is.

`extract()` finds every command: each line of a fenced block tagged bash/sh (or, in an untagged
block, a line that starts with a command word: an untagged block may also show output), joined
across trailing backslashes, its trailing comment dropped and split at `&&`; and every inline
code span holding `python -m`, `mpirun`, `sbatch` or `bash`. `KINDS` classifies each by its exact
text; tests/e2e/test_docs.py runs the ones that run here and fails on any command not in it.

Kinds:
  run       runs here in seconds (training runs shortened by SHORTEN)
  long      runs here but takes minutes (training runs, export, evaluate); the extended selection
            runs both kinds, in document order
  refused   runs here in seconds and refuses its input: exit status 2 and the line it prints
  bench     a benchmark as documented (minutes to an hour each here): tests/e2e/test_bench.py
            runs every bench, shortened, and checks its report
  usage     a synopsis with placeholders (CONFIG.yaml, RUN_DIR, [options], SEED): not a command
  install   installs into the environment (pip, a virtual environment): not run
  site      needs a cluster's modules, MPI or many more ranks than this machine has
  slurm     needs a SLURM cluster (sbatch, squeue, a batch log): tests/e2e/test_slurm.py runs them
  gpu       needs a GPU
  download  needs the internet or a dataset that is not here
  suite     the test suite itself (running it from here would recurse)
"""
import re

from tests.support.paths import ROOT

DOCS = [ROOT / "README.md"] + sorted((ROOT / "docs").glob("*.md"))

# Appended to every documented training command the test runs: the override set that
# docs/testing.md gives readers for trying a documented run quickly.
SHORTEN = ["--set", "train.epochs=1", "--set", "train.limit_batches=8",
           "--set", "train.limit_eval_batches=2"]

# What an untagged block's command line starts with (its other lines are output or code).
COMMAND_WORDS = ("python -", "mpirun ", "pip ", "sbatch ", "srun ", "squeue ", "bash ",
                 "module ", "tail ", "slurm/", "nvidia-cuda-mps-control", "echo ", "[mpirun ",
                 "torchrun ")
_ENV = re.compile(r"^(?:[A-Z_][A-Z0-9_]*=\S*\s+)+")  # leading VAR=value assignments
_INLINE = re.compile(r"`([^`\n]+)`")
# An inline span that is a command, not a mention of a program: a module run, a launch of one,
# or a script submitted or run.
_INLINE_COMMAND = re.compile(r"python -m |^(?:[A-Z_]+=\S+ )*(?:sbatch|bash) .*\.sh")
_FENCE = re.compile(r"^```(\w*)\s*\n(.*?)^```", re.S | re.M)


def _strip_comment(line: str) -> str:
    """The line without a trailing `# comment` (one after whitespace, outside quotes)."""
    quote = None
    for i, ch in enumerate(line):
        if ch in "'\"" and quote in (None, ch):
            quote = None if quote else ch
        elif ch == "#" and quote is None and (i == 0 or line[i - 1].isspace()):
            return line[:i].rstrip()
    return line.rstrip()


def _normal(command: str) -> str:
    return " ".join(command.split())


def _is_command(text: str, tagged: bool) -> bool:
    text = _ENV.sub("", text)
    return bool(text) and (tagged or text.startswith(COMMAND_WORDS))


def _split(command: str) -> list:
    """`a && b` -> [a, b]: each part is classified (and run) on its own, in order."""
    return [_normal(part) for part in command.split("&&") if part.strip()]


def extract(files=DOCS) -> list:
    """[(file name, line number, command)] in document order."""
    found = []
    for path in files:
        text = path.read_text()
        fences, start_of_file = [], len(found)
        for block in _FENCE.finditer(text):
            fences.append(block.span())
            tagged = block.group(1) in ("bash", "sh", "shell", "console")
            first = text.count("\n", 0, block.start(2)) + 1
            pending, start = "", None
            for offset, raw in enumerate(block.group(2).splitlines()):
                line = _strip_comment(raw) if not pending else raw.rstrip()
                if pending:
                    line = _strip_comment(line)
                if not line.strip() and not pending:
                    continue
                if start is None:
                    start = first + offset
                if line.endswith("\\"):
                    pending += line[:-1] + " "
                    continue
                command, pending = _normal(pending + line), ""
                if _is_command(command, tagged):
                    found += [(path.name, start, part) for part in _split(command)]
                start = None
        for span in _INLINE.finditer(text):
            if any(a <= span.start() < b for a, b in fences):
                continue
            code = _normal(span.group(1))
            if _INLINE_COMMAND.search(code):
                line = text.count("\n", 0, span.start()) + 1
                found += [(path.name, line, part) for part in _split(code)]
        found[start_of_file:] = sorted(found[start_of_file:], key=lambda item: item[1])
    return found
