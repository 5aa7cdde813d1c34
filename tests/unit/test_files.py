"""petra_mpi/files.py, the one atomic writer: a reader sees the old file or the new one, never a
half-written one, and a failed write leaves nothing beside it; an output that would destroy an
input is refused, and a killed writer's temporary file is removed by the next one."""
import json
import os

import pytest

from tests.support.launch import ended_process
from petra_mpi.files import (OutputRefused, atomic_path, check_output, remove_stale_temporaries,
                             write_atomic, write_json_atomic)


def test_a_failed_write_keeps_the_old_file_and_leaves_no_temporary(tmp_path):
    path = tmp_path / "summary.json"
    write_json_atomic(path, {"val_acc": 0.5})

    def half_then_fail(f):
        f.write('{"val_acc": 0.')
        raise OSError("disk full")

    for durable in (False, True):
        with pytest.raises(OSError, match="disk full"):
            write_atomic(path, half_then_fail, durable=durable)
        assert json.loads(path.read_text()) == {"val_acc": 0.5}
        assert os.listdir(tmp_path) == ["summary.json"]


def test_the_new_file_appears_whole_in_a_new_directory(tmp_path):
    path = tmp_path / "run" / "checkpoints" / "manifest.json"
    write_json_atomic(path, {"files": {"stage0.pt": 3}}, durable=True)
    assert path.read_text() == '{\n  "files": {\n    "stage0.pt": 3\n  }\n}\n'
    write_atomic(path, lambda f: f.write(b"\x00\x01"), binary=True)
    assert path.read_bytes() == b"\x00\x01" and os.listdir(path.parent) == ["manifest.json"]


def test_a_writer_that_picks_its_format_by_the_extension_sees_it(tmp_path):
    out = tmp_path / "model.pt2"
    with atomic_path(out, keep_extension=True) as tmp:
        assert tmp.endswith(".pt2") and os.path.dirname(tmp) == str(tmp_path)
        with open(tmp, "w") as f:
            f.write("program")
    assert out.read_text() == "program" and os.listdir(tmp_path) == ["model.pt2"]


def test_an_output_that_would_destroy_data_or_fail_late_is_refused(tmp_path):
    source, single = tmp_path / "photos", tmp_path / "single.parquet"
    (source / "cat").mkdir(parents=True)
    picture = source / "cat" / "a.png"
    picture.write_bytes(b"picture")
    single.write_bytes(b"rows")
    (tmp_path / "link").symlink_to(source)
    existing = tmp_path / "old.h5"
    existing.write_bytes(b"old")
    inputs = [str(source), str(single)]
    refused = {single: "is an input", source: "is an input", picture: "inside the input folder",
               source / "out.h5": "inside the input folder",
               tmp_path / "link" / "out.h5": "inside the input folder",
               source / "cat" / ".." / "out.h5": "inside the input folder",
               existing: "exists: --force replaces it", existing / "x.h5": "is not a folder",
               tmp_path: "is a folder: name the file to write"}
    for out, why in refused.items():
        with pytest.raises(OutputRefused, match=why):
            check_output(str(out), inputs)
    with pytest.raises(OutputRefused, match="is an input"):  # also with --force
        check_output(str(single), inputs, force=True)
    check_output(str(existing), inputs, force=True)
    check_output(str(tmp_path / "new" / "deeper" / "out.h5"), inputs)
    assert picture.read_bytes() == b"picture" and existing.read_bytes() == b"old"
    assert single.read_bytes() == b"rows"


def test_temporaries_of_a_killed_writer_are_removed_and_a_running_ones_kept(tmp_path):
    dead = ended_process()
    out = tmp_path / "data.h5"
    left = [tmp_path / f"data.h5.tmp-{dead}", tmp_path / f"data.tmp-{dead}.h5"]
    kept = [tmp_path / f"data.h5.tmp-{os.getpid()}", tmp_path / f"other.h5.tmp-{dead}",
            tmp_path / "data.h5.tmp-x"]
    for path in left + kept:
        path.write_bytes(b"partial")
    assert sorted(remove_stale_temporaries(str(out))) == sorted(map(str, left))
    assert sorted(os.listdir(tmp_path)) == sorted(p.name for p in kept)


def test_export_keeps_an_existing_model_file_unless_forced(tmp_path, capsys):
    """petra_mpi.export checks its --out before it looks for a checkpoint."""
    from petra_mpi.export import main
    model = tmp_path / "model.pt"
    model.write_bytes(b"an earlier export")
    assert main([str(tmp_path / "run"), "--out", str(model)]) == 2
    assert capsys.readouterr().err == f"error: {model} exists: --force replaces it\n"
    assert main([str(tmp_path / "run"), "--out", str(model), "--force"]) == 2  # no checkpoint: a one-line error too
    assert "no complete checkpoint" in capsys.readouterr().err
    assert model.read_bytes() == b"an earlier export"
