"""Opening HDF5 files without HDF5's file lock (readers and the packers alike)."""
import h5py


def open_readonly(path, **kwargs):
    """h5py.File(path, "r") without HDF5's file lock. A read-only open still takes a lock, which
    fails ("unable to lock file") where the file system has no flock (Lustre mounted without
    it, Cray DVS, some NFS) and conflicts with a writer's lock; readers here never need it."""
    return open_unlocked(path, "r", **kwargs)


def open_unlocked(path, mode, **kwargs):
    """h5py.File(path, mode) without HDF5's file lock (the packers write each file from one
    process, under a name of their own). h5py before 3.5, or built against HDF5 before 1.12.1 /
    1.10.7, cannot switch the lock per file and refuses `locking=`: those open as the
    environment says, HDF5_USE_FILE_LOCKING=FALSE in the batch scripts (HDF5 reads it once, when
    the library starts, so it must be set before Python starts)."""
    try:
        return h5py.File(path, mode, locking=False, **kwargs)
    except (TypeError, ValueError) as e:
        if "locking" not in str(e):
            raise
    return h5py.File(path, mode, **kwargs)
