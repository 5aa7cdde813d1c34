"""The C allocator a process runs with: glibc's malloc (the default), glibc's with its trimming
and mmap thresholds raised, jemalloc or tcmalloc (Debian's libjemalloc2, libtcmalloc-minimal4).

glibc returns freed memory to the OS (trimming the heap top, unmapping large blocks) and faults it
back in on the next allocation of that size: a training step frees and reallocates the same
activations every micro-batch. The others keep freed memory for reuse. An allocator is chosen
before the process starts (LD_PRELOAD, MALLOC_* variables), so `use` re-executes the program
with the environment it needs, once, before MPI starts."""
import ctypes.util
import glob
import os
import sys

ENV_MARK = "PETRA_ALLOCATOR"
# glibc's thresholds: freed memory under 1 GiB stays in the process, blocks under 64 MiB come from
# the heap instead of their own mapping (both default to 128 KiB, adjusted dynamically)
GLIBC_KEEP = {"MALLOC_TRIM_THRESHOLD_": str(1 << 30), "MALLOC_MMAP_THRESHOLD_": str(64 << 20),
              "MALLOC_TOP_PAD_": str(64 << 20)}
LIBRARIES = {"jemalloc": ("libjemalloc.so.2", "libjemalloc2"),
             "tcmalloc": ("libtcmalloc_minimal.so.4", "libtcmalloc-minimal4")}
CHOICES = ("glibc", "glibc-keep", "jemalloc", "tcmalloc")


class AllocatorError(RuntimeError):
    pass


def library_path(name) -> str:
    """The shared library of jemalloc or tcmalloc, found where the dynamic linker looks."""
    soname, package = LIBRARIES[name]
    for d in ("/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib64",
              "/usr/lib", "/usr/local/lib"):
        hits = sorted(glob.glob(os.path.join(d, soname)))
        if hits:
            return hits[0]
    found = ctypes.util.find_library(soname.split(".so")[0][3:])
    if found and os.path.isabs(found):
        return found
    raise AllocatorError(f"{name}: {soname} not found (Debian/Ubuntu: apt-get install {package})")


def environment(name) -> dict:
    """This process's environment, changed to run a program with allocator `name`."""
    env = dict(os.environ)
    if name not in CHOICES:
        raise AllocatorError(f"unknown allocator {name!r}; choose one of {', '.join(CHOICES)}")
    if name == "glibc-keep":
        env.update(GLIBC_KEEP)
    elif name in LIBRARIES:
        path = library_path(name)
        env["LD_PRELOAD"] = ":".join(p for p in (path, env.get("LD_PRELOAD", "")) if p)
    env[ENV_MARK] = name
    return env


def current() -> str:
    """The allocator this process was started with (by `use`), else what its environment says."""
    if os.environ.get(ENV_MARK):
        return os.environ[ENV_MARK]
    preload = os.environ.get("LD_PRELOAD", "")
    for name, (soname, _) in LIBRARIES.items():
        if soname.split(".so")[0] in preload:
            return name
    return "glibc-keep" if "MALLOC_TRIM_THRESHOLD_" in os.environ else "glibc"


def use(name, argv):
    """Run this program again as `python argv...` with allocator `name`, unless it already runs
    with it; never returns when it re-executes. Call it before MPI starts: the re-executed process
    keeps its pid, so the launcher still knows it as the same rank."""
    if name is None or os.environ.get(ENV_MARK) == name:
        return
    env = environment(name)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *argv], env)
