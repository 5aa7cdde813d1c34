"""The C allocator a benchmark runs under (petra_mpi/perf/allocator.py): the process is started
again with the allocator's environment, really loads the library, and says which it ran under;
an unknown or missing allocator is one line."""
import os
import subprocess
import sys

import pytest

from petra_mpi.perf import allocator
from tests.support.paths import ROOT

# Re-executes itself under the allocator named in argv[1], then prints what it runs with.
PROBE = """import os, sys
from petra_mpi.perf import allocator
allocator.use(sys.argv[1], sys.argv)
maps = open("/proc/self/maps").read()
print(allocator.current(), "jemalloc" in maps, "tcmalloc" in maps,
      os.environ.get("MALLOC_TRIM_THRESHOLD_"))
"""


def installed(name):
    try:
        allocator.library_path(name)
        return True
    except allocator.AllocatorError:
        return False


def probe(name, tmp_path):
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    proc = subprocess.run([sys.executable, str(script), name], cwd=ROOT, capture_output=True,
                          text=True, timeout=60, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.split()


@pytest.mark.parametrize("name", ["jemalloc", "tcmalloc"])
def test_a_preloaded_allocator_is_loaded_in_the_restarted_process(name, tmp_path):
    if not installed(name):
        pytest.skip(f"{allocator.LIBRARIES[name][1]} is not installed")
    current, jemalloc, tcmalloc, _ = probe(name, tmp_path)
    assert current == name
    assert (jemalloc, tcmalloc) == (("True", "False") if name == "jemalloc" else ("False", "True"))


def test_glibc_keep_sets_the_thresholds_and_glibc_changes_nothing(tmp_path):
    assert probe("glibc-keep", tmp_path) == ["glibc-keep", "False", "False", str(1 << 30)]
    assert probe("glibc", tmp_path) == ["glibc", "False", "False", "None"]


def test_an_unknown_or_missing_allocator_is_one_line(monkeypatch):
    with pytest.raises(allocator.AllocatorError, match="unknown allocator 'hoard'; choose one of"):
        allocator.environment("hoard")
    monkeypatch.setattr(allocator.glob, "glob", lambda pattern: [])
    monkeypatch.setattr(allocator.ctypes.util, "find_library", lambda name: None)
    with pytest.raises(allocator.AllocatorError, match="apt-get install libjemalloc2"):
        allocator.environment("jemalloc")
    proc = subprocess.run([sys.executable, "-m", "petra_mpi.bench", "memory", "--allocator",
                           "hoard"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith("petra_mpi.bench: unknown allocator")
