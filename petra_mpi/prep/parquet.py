"""Pack an image dataset saved as parquet files (the layout of Hugging Face image datasets).

  python -m petra_mpi.prep.parquet --source DIR_OR_FILES... --out FILE.h5 [--force]
         [--size 256 | --raw S] [--split NAME] [--val-fraction 0.1 --seed 0] [--image-column C]
         [--label-column C] [--skip-bad] [--max-pixels N] [--workers N]

Needs pyarrow: pip install -e ".[parquet]" (or pip install pyarrow).

--source: parquet files, or folders searched for *.parquet (hidden names ignored). Each file's
split is the word its name starts with (train-00000-of-00003.parquet, validation.parquet,
test-00000-of-00001-5f3a.parquet), else its folder's name (train/0000.parquet); a file that
names no split is read as train. The val split is --split NAME, by default the first of
validation, valid, val and test that is there; without one, --val-fraction of each class is
drawn from train (default 0.1, chosen by --seed) as petra_mpi.prep.folder does. Other splits are
left out, with a line saying so.

Columns: the image column holds encoded pictures, as Hugging Face writes its Image feature (a
struct of `bytes` and `path`; a row without bytes is read from `path`, which must be relative
and lead to a regular file inside its parquet file's folder) or as plain binary; the label
column holds integers (or strings: the classes are then their sorted values). Both are found
from the Hugging Face feature metadata in the file's schema (an Image and a ClassLabel feature)
or from the usual names (image, img; label, labels), else named with --image-column and
--label-column. The class names come from the ClassLabel feature when present, else the file
has no /classes and as many classes as the largest label + 1 (at most MAX_CLASSES: a larger
label is a bad row).

The pictures are stored as petra_mpi.prep.folder stores them (the JPEG variant at --size, or
--raw S pixels), and bad input (a picture that does not decode, a row without a label or with a
label outside the classes, a path that is not read) is handled the same way: one line each,
exit status 2 at the first without --skip-bad. --out may not be a source file or lie inside a
source folder, nor exist unless --force. The labels are read first (one column, small) and
checked; the pictures are then read one row group at a time, so memory does not grow with the
data set.
"""
import argparse
import json
import os
import re
import sys
import time

import numpy as np

from .common import SPLITS, PrepError, add_output_options, claim_output, run_cli, shown
from .pictures import (MAX_CLASSES, VAL_FRACTION, BadInput, add_picture_options,
                       check_picture_options, draw_val, pack_pictures, regular_file, unfit_name)

VAL_NAMES = ("validation", "valid", "val", "test")
KNOWN_SPLITS = ("train",) + VAL_NAMES
ROWS_PER_READ = 64  # rows taken at a time from a row group being read


def import_parquet():
    """pyarrow.parquet, or a one-line error saying how to install it."""
    try:
        import pyarrow.parquet
    except ImportError:
        raise PrepError("reading parquet files needs pyarrow: pip install -e \".[parquet]\" "
                        "(or pip install pyarrow)") from None
    return pyarrow.parquet


def find_files(sources):
    """The parquet files named or found below the folders named, in order."""
    files = []
    for source in sources:
        if os.path.isdir(source):
            for root, dirs, names in os.walk(source):
                dirs[:] = sorted(d for d in dirs if not d.startswith("."))
                files += [os.path.join(root, n) for n in sorted(names)
                          if n.endswith(".parquet") and not n.startswith(".")]
        elif os.path.isfile(source):
            files.append(source)
        else:
            raise PrepError(f"{source}: no such file or folder")
    if not files:
        raise PrepError(f"no .parquet file in {' '.join(sources)}")
    return files


def split_of(path):
    """The split a file's name starts with (a word followed by -, _ or .), else its folder's
    name, or None."""
    word = re.match(r"([A-Za-z]+)[-_.]", os.path.basename(path))
    folder = os.path.basename(os.path.dirname(path)).lower()
    for name in (word.group(1).lower() if word else None, folder):
        if name in KNOWN_SPLITS:
            return name
    return None


def group_splits(files, val_name):
    """{"train": [files], "val": [files] or None}, saying which files were left out."""
    found = {}
    for path in files:
        split = split_of(path)
        if split is None:
            print(f"{path}: no split in its name, read as train", file=sys.stderr)
        found.setdefault(split or "train", []).append(path)
    if "train" not in found:
        raise PrepError(f"no train split among {', '.join(sorted(found))} (a file's name "
                        f"starts with its split: train-00000-of-00001.parquet)")
    if val_name is not None and val_name not in found:
        raise PrepError(f"--split {val_name}: the files hold the splits {', '.join(sorted(found))}")
    val_name = val_name or next((n for n in VAL_NAMES if n in found), None)
    for name in sorted(set(found) - {"train", val_name}):
        print(f"left out: the {name} split ({len(found[name])} files; --split {name} packs it "
              f"as val)", file=sys.stderr)
    return {"train": found["train"], "val": found.get(val_name)}


def hf_features(schema):
    """The Hugging Face feature dict of a parquet schema's metadata, or {}."""
    raw = (schema.metadata or {}).get(b"huggingface")
    try:
        return json.loads(raw)["info"]["features"] if raw else {}
    except (ValueError, KeyError, TypeError):
        return {}


def pick_columns(schema, image, label):
    """(image column, label column, class names or None) of a file's arrow schema."""
    features = hf_features(schema)
    names = schema.names

    def choose(given, kind, usual, what):
        if given is not None:
            if given not in names:
                raise PrepError(f"no column {given!r} (the columns: {', '.join(names)})")
            return given
        typed = [n for n, f in features.items() if isinstance(f, dict) and f.get("_type") == kind]
        found = [n for n in typed + list(usual) if n in names]
        if not found:
            raise PrepError(f"cannot tell the {what} column among {', '.join(names)}: name it "
                            f"with --{what}-column")
        return found[0]
    image = choose(image, "Image", ("image", "img"), "image")
    label = choose(label, "ClassLabel", ("label", "labels"), "label")
    classes = features.get(label, {}).get("names") if isinstance(features.get(label), dict) else None
    return image, label, classes


def read_labels(pq, splits, column, classes):
    """({file: int64 labels, -1 where a row has none or one outside the classes}, class names
    or None). String labels are looked up in `classes`, by default their sorted values; without
    names the classes are 0 to MAX_CLASSES - 1. Checked before any picture is read."""
    import pyarrow as pa
    import pyarrow.compute as pc
    files = [path for split in SPLITS for path in splits[split] or ()]
    arrays = {path: pq.read_table(path, columns=[column]).column(0).combine_chunks()
              for path in files}
    kind = arrays[files[0]].type
    strings = pa.types.is_string(kind) or pa.types.is_large_string(kind)
    if strings:
        classes = classes or sorted({v for a in arrays.values() for v in a.unique().to_pylist()
                                     if v is not None})
    if classes is not None:
        check_classes(classes, column)
    if strings:
        arrays = {path: pc.index_in(a, value_set=pa.array(classes)) for path, a in arrays.items()}
    labels = {}
    for path, a in arrays.items():
        if not pa.types.is_integer(a.type):
            raise PrepError(f"{path}: label column {column!r} holds {a.type}, not integers or "
                            f"strings")
        # compared in the column's own type: a uint64 or a huge label must not wrap into range
        values = a.fill_null(0).to_numpy(zero_copy_only=False)
        usable = a.is_valid().to_numpy(zero_copy_only=False) & (values >= 0) & \
            (values < (len(classes) if classes else MAX_CLASSES))
        labels[path] = np.full(len(values), -1, np.int64)
        labels[path][usable] = values[usable]
    return labels, classes


def check_classes(classes, column):
    """Refuse class names that a packed file cannot hold: not a list of names, more than
    MAX_CLASSES, a name twice, a name that cannot be printed on one line."""
    if not isinstance(classes, list) or not all(isinstance(c, str) for c in classes):
        raise PrepError(f"the class names of column {column!r} are not a list of names")
    if len(classes) > MAX_CLASSES:
        raise PrepError(f"column {column!r} names {len(classes):,} classes, more than the "
                        f"{MAX_CLASSES:,} a packed file may have")
    seen = set()
    for name in classes:
        if name in seen:
            raise PrepError(f"the class names of column {column!r} name a class twice: "
                            f"{shown(name)}")
        if why := unfit_name(name):
            raise PrepError(f"column {column!r}: the class name {shown(name)} is {why}")
        seen.add(name)


def plan_rows(splits, labels, classes, args, bad):
    """{file: (the split of each row: 0 train, 1 val, -1 left out; its labels)} and the number
    of classes. Rows without a usable label go to `bad`, one line per file."""
    plan, problems = {}, []
    for index, split in enumerate(SPLITS):
        for path in splits[split] or ():
            lab = labels[path]
            wrong = lab < 0
            if wrong.any():
                rows = np.flatnonzero(wrong)
                limit = (f"0 to {len(classes) - 1}" if classes else
                         f"0 to {MAX_CLASSES - 1:,}, the most classes a packed file may have")
                problems.append((f"{path} row {rows[0]}", f"no label, or one outside the "
                                 f"classes ({limit}; {len(rows)} such rows in this file)"))
            plan[path] = (np.where(wrong, -1, index).astype(np.int8), lab)
    bad.report(problems)
    kept = [lab[which >= 0] for which, lab in plan.values()]
    if not sum(map(len, kept)):
        raise PrepError("no row holds a usable label")
    num_classes = len(classes) if classes else int(max(k.max() for k in kept if len(k))) + 1
    if splits["val"] is None:
        train = splits["train"]
        rows = np.concatenate([plan[path][1][plan[path][0] >= 0] for path in train])
        fraction = VAL_FRACTION if args.val_fraction is None else args.val_fraction
        drawn = draw_val(rows, classes, fraction, args.seed)
        for path in train:  # the drawn rows, file after file
            which = plan[path][0]
            kept = np.flatnonzero(which >= 0)
            which[kept], drawn = drawn[:len(kept)], drawn[len(kept):]
    return plan, num_classes


def pictures_of(column, folder):
    """The pictures of one batch of the image column, each (bytes or a file to read, None) or
    (None, why there is none)."""
    import pyarrow as pa
    if not pa.types.is_struct(column.type):
        return [(b, None if b is not None else "no picture (no bytes)")
                for b in column.to_pylist()]
    data = column.field("bytes").to_pylist()
    paths = (column.field("path").to_pylist() if column.type.get_field_index("path") >= 0
             else [None] * len(data))
    return [(b, None) if b is not None else picture_file(p, folder) for b, p in zip(data, paths)]


def picture_file(path, folder):
    """(the file that a row's `path` names, None), or (None, why it is not read). A data set
    names only its own files: a relative path that stays inside `folder` (its parquet file's),
    links resolved, to a regular file."""
    if not path:
        return None, "no picture (no bytes, and no path)"
    full = os.path.join(folder, path)
    try:
        inside = os.path.realpath(full).startswith(os.path.join(os.path.realpath(folder), ""))
    except ValueError:  # a NUL in the path
        inside = False
    if os.path.isabs(path) or not inside:
        return None, (f"its path {shown(path)} leads out of the folder of its parquet file "
                      f"(only relative paths inside it are read)")
    why = regular_file(full)
    return (None, f"no picture at its path {shown(path)}: {why}") if why else (full, None)


def stream(pq, plan, column, bad):
    """(split, where, picture, label) of every row to pack, reading the image column of one row
    group at a time."""
    for path, (which, labels) in plan.items():
        row = 0
        with pq.ParquetFile(path) as f:
            # read_row_group, not iter_batches: pyarrow 26's iter_batches held a whole file's
            # column in memory (measured), a row group at a time holds one group
            batches = (batch for group in range(f.num_row_groups)
                       for batch in f.read_row_group(group, columns=[column]).to_batches(
                           ROWS_PER_READ))
            for batch in batches:
                for picture, why in pictures_of(batch.column(0), os.path.dirname(path)):
                    where = f"{path} row {row}"
                    if which[row] >= 0 and picture is None:
                        bad(where, why)
                    elif which[row] >= 0:
                        yield SPLITS[which[row]], where, picture, int(labels[row])
                    row += 1


def pack(args):
    start = time.monotonic()
    pq = import_parquet()
    bad = BadInput(args.skip_bad, hint="--skip-bad")
    splits = group_splits(find_files(args.source), args.split)
    if splits["val"] is not None and args.val_fraction is not None:
        raise PrepError("--val-fraction draws the val split from train, but the files hold one")
    try:
        schemas = {path: pq.read_schema(path) for s in SPLITS for path in splits[s] or ()}
    except Exception as e:  # pyarrow's own errors: not a parquet file, truncated...
        raise PrepError(f"cannot read a parquet file: {e}") from None
    image, label, classes = pick_columns(schemas[splits["train"][0]], args.image_column,
                                         args.label_column)
    for path, schema in schemas.items():
        if image not in schema.names or label not in schema.names:
            raise PrepError(f"{path} has no column {image!r} or {label!r}")
    labels, classes = read_labels(pq, splits, label, classes)
    plan, num_classes = plan_rows(splits, labels, classes, args, bad)
    total = sum(int((which >= 0).sum()) for which, _ in plan.values())
    pack_pictures(args, stream(pq, plan, image, bad), total, start=start, source="parquet",
                  classes=classes, num_classes=num_classes, bad=bad)


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m petra_mpi.prep.parquet", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--source", required=True, nargs="+", help="parquet files or folders")
    add_output_options(p)
    p.add_argument("--split", help="the split packed as val (default: validation, valid, val "
                                   "or test, the first there)")
    p.add_argument("--image-column", help="default: the Image feature, else image or img")
    p.add_argument("--label-column", help="default: the ClassLabel feature, else label or labels")
    add_picture_options(p, "without a val split: the share of each class drawn from train")
    args = p.parse_args(argv)
    check_picture_options(p, args)
    claim_output(args, args.source)
    pack(args)


if __name__ == "__main__":
    run_cli(main)
