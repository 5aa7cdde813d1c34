"""Code named in prose exists: the package's dotted names (three parts or more) that the docs
give in backticks and that its comments and docstrings give, such as `core.optim.constant_lr`,
resolve to a module and its attributes, so that a move or a rename leaves no name behind that
points nowhere."""
import importlib
import importlib.util
import io
import pkgutil
import re
import tokenize

import petra_mpi
from tests.support.paths import ROOT

THIRD_PARTY = ("torch", "torchvision")  # names of theirs are not the package's
PLACEHOLDERS = {"petra_mpi.prep.x"}  # "python -m petra_mpi.prep.x": any packer
_DOTTED = r"[a-z_][a-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*){2,}"


def _modules_by_last_name() -> dict:
    """{"world": ["petra_mpi.comm.world"], ...}: a name may start at any module of the package."""
    found = {}
    for info in pkgutil.walk_packages(petra_mpi.__path__, "petra_mpi."):
        found.setdefault(info.name.rsplit(".", 1)[1], []).append(info.name)
    return found


MODULES = _modules_by_last_name()


def _exists(dotted: str) -> bool:
    """The longest importable prefix of `dotted`, then its attributes (a dataclass's fields
    count: they are attributes of its instances)."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            if importlib.util.find_spec(".".join(parts[:i])) is None:
                continue
        except ModuleNotFoundError:  # a parent that is not a package
            continue
        obj = importlib.import_module(".".join(parts[:i]))
        for name in parts[i:]:
            fields = getattr(obj, "__dataclass_fields__", {})
            if not hasattr(obj, name) and name not in fields:
                return False
            obj = getattr(obj, name, None)
        return True
    return False


def resolves(name: str) -> bool:
    head, rest = name.split(".", 1)
    if head in THIRD_PARTY:
        return True
    candidates = [name if head == "petra_mpi" else f"petra_mpi.{name}"]
    candidates += [f"{module}.{rest}" for module in MODULES.get(head, [])]
    return name in PLACEHOLDERS or any(_exists(c) for c in candidates)


def _prose_of_code(text: str) -> str:
    """The comments and docstrings of a module's source."""
    return "\n".join(t.string for t in tokenize.generate_tokens(io.StringIO(text).readline)
                     if t.type == tokenize.COMMENT or (t.type == tokenize.STRING
                                                       and t.string.lstrip("rb").startswith('"""')))


def test_names_in_the_docs_exist():
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    named = {(page.name, m) for page in pages
             for m in re.findall(rf"`({_DOTTED})`", page.read_text())}
    assert len(named) > 5  # the pattern still finds the docs' names
    assert not [f"{page}: {name}" for page, name in sorted(named) if not resolves(name)]


def test_names_in_the_code_comments_exist():
    files = sorted((ROOT / "petra_mpi").rglob("*.py"))
    named = {(str(f.relative_to(ROOT)), m) for f in files
             for m in re.findall(rf"(?<![\w.])({_DOTTED})", _prose_of_code(f.read_text()))}
    assert len(named) > 5
    assert not [f"{path}: {name}" for path, name in sorted(named) if not resolves(name)]
