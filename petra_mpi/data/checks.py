"""What a reader checks of an HDF5 file from elsewhere before it reads the data: attributes of the
types the schema names, datasets stored in full, and virtual datasets whose sources exist and do
not lead back to themselves. The image and token readers (source.py, text.py) raise the first
problem as a DataError; `petra_mpi.prep.verify` lists them all.

Each check reads metadata only, never data: a crafted file can declare 10**13 labels in a few KiB
(chunks never written read as zeros, and reading them would ask for 73 TiB), or a virtual dataset
that maps itself (HDF5 then recurses until the process dies with a segmentation fault).
"""
import math
import os

import h5py
import numpy as np

from .hdf5 import open_readonly


class DataError(ValueError):
    """A data file that does not hold what the schema says, or more than this machine can load:
    one line that starts with the file's path and says what is wrong."""


def positive_int(value):
    """`value` as an int if it is one integer >= 1 (Python or numpy; not a string, float or
    bool), else None."""
    v = np.asarray(value) if value is not None else None
    if v is None or v.ndim != 0 or v.dtype == bool or not np.issubdtype(v.dtype, np.integer):
        return None
    return int(v) if int(v) >= 1 else None


def flag(value):
    """`value` as a bool if it is one bool or integer 0 or 1, else None."""
    v = np.asarray(value)
    if v.ndim or not (v.dtype == bool or np.issubdtype(v.dtype, np.integer)) or v not in (0, 1):
        return None
    return bool(v)


def three_floats(value):
    """`value` as a tuple of 3 finite floats (any real dtype), else None."""
    v = np.asarray(value) if value is not None else None
    if v is None or v.shape != (3,) or not (np.issubdtype(v.dtype, np.floating)
                                            or np.issubdtype(v.dtype, np.integer)):
        return None
    return tuple(map(float, v)) if np.all(np.isfinite(v)) else None


def shown(value):
    """An attribute's value for a message, numpy types as plain Python ones."""
    return repr(value.tolist() if isinstance(value, (np.ndarray, np.generic)) else value)


def describe_dataset(ds):
    """What stands at a dataset's place, for a message: its dtype and shape, or what it is not."""
    if ds is None:
        return "missing"
    if not isinstance(ds, h5py.Dataset):
        return "a group, not a dataset"
    return f"{ds.dtype}{ds.shape}"


def not_stored(ds):
    """Why dataset `ds` would read, wholly or in part, as its fill value instead of data (chunks
    or contiguous storage never written), else None. Virtual datasets: see virtual_problems."""
    if ds.is_virtual or ds.size == 0:
        return None
    if ds.chunks is None:
        if ds.id.get_create_plist().get_layout() == h5py.h5d.COMPACT:  # held in the header
            return None
        stored = ds.id.get_storage_size()
        return None if stored >= ds.nbytes else f"stores {stored} of its {ds.nbytes} bytes"
    chunks = math.prod(-(-n // c) for n, c in zip(ds.shape, ds.chunks))
    stored = ds.id.get_num_chunks()  # counts the written chunks only: a sparse one has few
    return None if stored >= chunks else f"stores {stored} of its {chunks} chunks"


def stored_problems(f, names):
    """One line for each dataset of `names` (paths in `f`; absent ones are skipped) that is not
    stored in full."""
    problems = []
    for name in names:
        ds = f.get(name)
        why = not_stored(ds) if isinstance(ds, h5py.Dataset) else None
        if why:
            problems.append(f"/{name} declares {ds.shape} but {why} (the rest would read as "
                            f"zeros)")
    return problems


def virtual_problems(f, path):
    """One line for each virtual dataset of `f` (opened from `path`) that HDF5 cannot read as
    it should: a source file that does not exist, or lacks the dataset (HDF5 would read its
    bytes as zeros without an error), and a chain of sources that leads back to a dataset on
    it (HDF5 would recurse until the process dies)."""
    problems, missing = [], set()

    def visit(name, ds):
        if isinstance(ds, h5py.Dataset) and ds.is_virtual:
            problems.extend(_follow(ds, path, (_identity(path, name),), missing))
    f.visititems(visit)
    return problems


def _identity(path, name):
    st = os.stat(path)
    return st.st_dev, st.st_ino, "/" + name.lstrip("/")


def _follow(ds, path, chain, missing):
    """The problems of virtual dataset `ds` of the file at `path`; `chain`: the identities of
    the datasets that led here, `ds` last; `missing`: the source files already named."""
    problems = []
    for source in ds.virtual_sources():
        where = path if source.file_name == "." else find_source(source.file_name, path)
        if where is None:
            named = source_places(source.file_name, path)[-2]
            if named not in missing:
                missing.add(named)
                problems.append(f"joins a shard file that is missing: {named}")
            continue
        key = _identity(where, source.dset_name)
        if key in chain:
            problems.append(f"/{chain[0][2].lstrip('/')} is a virtual dataset whose sources "
                            f"lead back to {where}:{key[2]} (a loop HDF5 cannot read)")
            continue
        try:
            with open_readonly(where) as g:
                target = g.get(source.dset_name)
                if not isinstance(target, h5py.Dataset):
                    problems.append(f"joins {where}, which has no dataset {source.dset_name}")
                elif target.is_virtual:
                    problems.extend(_follow(target, where, chain + (key,), missing))
        except OSError as e:
            problems.append(f"joins {where}, which cannot be opened as HDF5 ({e})")
    return problems


def source_places(name, path):
    """Where HDF5 looks for the source file `name` of a virtual dataset in the file at `path`:
    under each folder of HDF5_VDS_PREFIX (':'-separated, ${ORIGIN} standing for the folder of
    `path`), then in the folder of `path`, then in the working directory."""
    folder = os.path.dirname(os.path.abspath(path))
    prefixes = [p.replace("${ORIGIN}", folder)
                for p in os.environ.get("HDF5_VDS_PREFIX", "").split(":") if p]
    return [os.path.join(p, name) for p in prefixes + [folder, "."]]


def find_source(name, path):
    """The first of source_places that is a file, else None."""
    return next((p for p in source_places(name, path) if os.path.isfile(p)), None)


def load_whole(ds, path=None):
    """Dataset `ds` read into memory, or DataError (naming `path` if given) when this machine
    cannot hold it."""
    try:
        return ds[()]
    except MemoryError:
        raise DataError(("" if path is None else f"{path}: ") + f"{ds.name} holds {ds.size} "
                        f"values ({ds.nbytes / 2**30:.1f} GiB), more than this machine's "
                        f"memory") from None
