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
# mallopt's options for the same thresholds (malloc.h: M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD)
MALLOPT = {-1: "MALLOC_TRIM_THRESHOLD_", -2: "MALLOC_TOP_PAD_", -3: "MALLOC_MMAP_THRESHOLD_"}
LIBRARIES = {"jemalloc": ("libjemalloc.so.2", "libjemalloc2"),
             "tcmalloc": ("libtcmalloc_minimal.so.4", "libtcmalloc-minimal4")}
CHOICES = ("glibc", "glibc-keep", "jemalloc", "tcmalloc")


_kept_here = False  # keep_freed_memory set glibc's thresholds in this process


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
    """The allocator this process was started with (by `use`), else what its environment says
    (glibc-keep also when keep_freed_memory set it here)."""
    if _kept_here:
        return "glibc-keep"
    if os.environ.get(ENV_MARK):
        return os.environ[ENV_MARK]
    preload = os.environ.get("LD_PRELOAD", "")
    for name, (soname, _) in LIBRARIES.items():
        if soname.split(".so")[0] in preload:
            return name
    return "glibc-keep" if "MALLOC_TRIM_THRESHOLD_" in os.environ else "glibc"


def keep_freed_memory() -> bool:
    """In this process, glibc's malloc keeps what it frees, as "glibc-keep" does (GLIBC_KEEP's
    thresholds, set with mallopt), unless the process was started with an allocator of its own
    choice (`use`, LD_PRELOAD or MALLOC_* variables): training's and the benchmarks' default.
    Why: a kept micro-batch's graph is allocated in one tick and freed ticks later, so glibc's
    default trims and unmaps that memory and the next kept forward faults it back in, page by page
    (on RevNet18, width 32, batch 64: a kept micro-batch cost 0.79-1.04 of a rebuilt one per block
    instead of 0.72-0.79). Returns whether it changed anything."""
    global _kept_here
    if os.environ.get(ENV_MARK) or current() != "glibc" or any(
            v.startswith("MALLOC_") for v in os.environ):
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.gnu_get_libc_version  # glibc's own: another C library has no mallopt to set
    except (OSError, AttributeError):
        return False
    for option, variable in MALLOPT.items():
        if libc.mallopt(option, int(GLIBC_KEEP[variable])) != 1:
            return False
    _kept_here = True
    return True


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
