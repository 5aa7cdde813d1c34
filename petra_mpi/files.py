"""Writing a file atomically: under a temporary name beside it, renamed into place only once
complete, so a reader (or a run resumed after a crash) sees the old file or the new one, never
half of one. The one writer of checkpoints, metrics summaries, traces, exports and packed data.

durable=True also flushes the file to disk before the rename and the directory after it, so the
new file survives a crash of the node (checkpoints need that; a summary or a trace does not)."""
import contextlib
import errno
import json
import os
import re


def fsync_dir(path: str):
    """Make the entries of directory `path` (files renamed or removed in it) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError as e:
        if e.errno != errno.EINVAL:  # file systems that cannot sync a directory say EINVAL
            raise
    finally:
        os.close(fd)


class OutputRefused(Exception):
    """An output a command will not write (check_output says why, in one line)."""


def check_output(path: str, inputs=(), force: bool = False):
    """Refuse, before any work, an output that would destroy data or fail only at the end:
    a folder; a path whose folder cannot be made or written; one of `inputs` (files or folders)
    or a path inside an input folder (symbolic links and `..` resolved); an existing file
    unless `force`. Raises OutputRefused."""
    real = os.path.realpath(path)
    for source in inputs:
        source_real = os.path.realpath(source)
        if real == source_real or (os.path.exists(path) and os.path.exists(source)
                                   and os.path.samefile(path, source)):
            raise OutputRefused(f"{path} is an input of this command: write the output elsewhere")
        if os.path.isdir(source) and real.startswith(source_real.rstrip(os.sep) + os.sep):
            raise OutputRefused(f"{path} lies inside the input folder {source}: write the "
                                f"output elsewhere")
    if os.path.isdir(path):
        raise OutputRefused(f"{path} is a folder: name the file to write")
    folder = os.path.dirname(os.path.abspath(path))
    while not os.path.exists(folder):  # the nearest folder that exists must take the new ones
        folder = os.path.dirname(folder)
    if not os.path.isdir(folder):
        raise OutputRefused(f"cannot write {path}: {folder} is not a folder")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise OutputRefused(f"cannot write {path}: no permission to write in {folder}")
    if os.path.lexists(path) and not force:
        raise OutputRefused(f"{path} exists: --force replaces it")


def remove_stale_temporaries(path: str) -> list:
    """Remove the temporary files of `path` (temporary_name's) whose writer is no longer
    running on this machine, as a writer killed by SIGKILL leaves them; returns their names."""
    folder, base = os.path.split(os.path.abspath(path))
    root, ext = os.path.splitext(base)
    pattern = re.compile(rf"(?:{re.escape(base)}\.tmp-(\d+)|{re.escape(root)}\.tmp-(\d+)"
                         rf"{re.escape(ext)})")
    removed = []
    for name in sorted(os.listdir(folder)) if os.path.isdir(folder) else ():
        match = pattern.fullmatch(name)
        if match and not process_running(int(match.group(1) or match.group(2))):
            with contextlib.suppress(OSError):  # gone meanwhile, or not a file
                os.remove(os.path.join(folder, name))
                removed.append(os.path.join(folder, name))
    return removed


def process_running(pid: int) -> bool:
    """Whether process `pid` runs on this machine (another user's process counts)."""
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, OverflowError):
        return False
    except PermissionError:
        pass
    return True


def temporary_name(path: str, keep_extension: bool = False) -> str:
    """The temporary name beside `path`: PATH.tmp-PID, or ROOT.tmp-PID.EXT when the writer
    picks its format by the extension (torch.export's does)."""
    if keep_extension:
        root, ext = os.path.splitext(path)
        return f"{root}.tmp-{os.getpid()}{ext}"
    return f"{path}.tmp-{os.getpid()}"


@contextlib.contextmanager
def atomic_path(path: str, durable: bool = False, keep_extension: bool = False):
    """Yield a temporary name beside `path` for the block to write; rename it to `path` only if
    the block succeeds, delete it on any exception (KeyboardInterrupt included). durable: the
    block must have flushed the file to disk (write_atomic does); the rename is then made
    durable too."""
    path = os.path.abspath(path)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = temporary_name(path, keep_extension)
    try:
        yield tmp
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.remove(tmp)
        raise
    if durable:
        fsync_dir(os.path.dirname(path))


def write_atomic(path: str, write, binary: bool = False, durable: bool = False):
    """Atomically write `path` with write(f), f the temporary file open for writing (text, or
    bytes when `binary`)."""
    with atomic_path(path, durable) as tmp:
        with open(tmp, "wb" if binary else "w") as f:
            write(f)
            if durable:
                f.flush()
                os.fsync(f.fileno())


def write_json_atomic(path: str, data, durable: bool = False):
    """Atomically write `data` as indented JSON with a final newline."""
    def dump(f):
        json.dump(data, f, indent=2)
        f.write("\n")
    write_atomic(path, dump, durable=durable)
