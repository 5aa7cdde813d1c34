"""petra_mpi/files.py, the one atomic writer: a reader sees the old file or the new one, never a
half-written one, and a failed write leaves nothing beside it."""
import json
import os

import pytest

from petra_mpi.files import atomic_path, write_atomic, write_json_atomic


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
