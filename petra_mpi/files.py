"""Writing a file atomically: under a temporary name beside it, renamed into place only once
complete, so a reader (or a run resumed after a crash) sees the old file or the new one, never
half of one. The one writer of checkpoints, metrics summaries, traces, exports and packed data.

durable=True also flushes the file to disk before the rename and the directory after it, so the
new file survives a crash of the node (checkpoints need that; a summary or a trace does not)."""
import contextlib
import errno
import json
import os


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
