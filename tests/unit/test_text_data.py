"""Token files (petra_mpi/prep/text.py) and their reader (petra_mpi/data/text.py) through BatchLoader:
the schema, next-token windows, seeded shuffles, replica shards, mid-epoch resume, bad input."""
import subprocess
import sys

import h5py
import numpy as np
import pytest
import torch

from tests.support.paths import ROOT
from tests.support.verify_files import assert_one_problem
from petra_mpi.data import BatchLoader, open_split

TEXT = "To be, or not to be, that is the question: whether 'tis nobler in the mind to suffer\n"


def pack(tmp_path, *args, text=TEXT * 20, name="a.txt"):
    """Run the packer on one file of `text` (a str, or bytes as they are); returns the result."""
    src = tmp_path / name
    src.write_bytes(text.encode("utf-8") if isinstance(text, str) else text)
    out = tmp_path / "text.h5"
    return subprocess.run([sys.executable, "-m", "petra_mpi.prep.text", "--source", str(src),
                           "--out", str(out), *args], capture_output=True, text=True, cwd=ROOT,
                          timeout=60), out


def test_bytes_schema_and_split(tmp_path):
    r, out = pack(tmp_path, "--val-fraction", "0.25")
    assert r.returncode == 0, r.stderr
    data = (TEXT * 20).encode()
    with h5py.File(out, "r") as f:
        assert f.attrs["kind"] == "tokens" and f.attrs["num_classes"] == 256
        assert f.attrs["vocab"] == "bytes" and f.attrs["bytes_per_token"] == 1.0
        train, val = f["train/tokens"][()], f["val/tokens"][()]
    n_val = round(len(data) * 0.25)
    assert bytes(train) == data[:-n_val] and bytes(val) == data[-n_val:]  # the tail is val


def test_char_vocabulary(tmp_path):
    text = "héllo wörld, ünïcode\n" * 30
    r, out = pack(tmp_path, "--vocab", "char", text=text)
    assert r.returncode == 0, r.stderr
    with h5py.File(out, "r") as f:
        vocab = f["vocab"][()].decode()
        assert f.attrs["num_classes"] == len(vocab) == len(set(text))
        ids = np.concatenate([f["train/tokens"][()], f["val/tokens"][()]])
        assert f.attrs["bytes_per_token"] > 1.0  # accented letters take 2 bytes
    assert "".join(vocab[i] for i in ids) == text


@pytest.mark.parametrize("case,text,args,message", [
    ("empty", b"", (), "a.txt: the file is empty"),
    ("undecodable", b"abc\xff\xfedef" * 10, ("--vocab", "char"), "a.txt: byte 3 is not UTF-8"),
    ("too short", b"ab", (), "too few to split"),
])
def test_bad_input_one_line_nothing_left(tmp_path, case, text, args, message):
    r, out = pack(tmp_path, *args, text=text)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], r.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.txt"]  # no output, no temporary


def test_a_folder_skips_hidden_and_empty_files_with_a_note(tmp_path):
    """A folder as a repository or a Mac leaves it: an empty .gitkeep, a .DS_Store, a .git
    folder. Only the text is packed, each skip is named; a folder of nothing else fails."""
    folder = tmp_path / "texts"
    (folder / ".git").mkdir(parents=True)
    (folder / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    (folder / ".gitkeep").write_bytes(b"")
    (folder / ".DS_Store").write_bytes(b"\x00\x00\x00\x01Bud1" * 20)
    (folder / "a.txt").write_text(TEXT * 10)
    (folder / "b.txt").write_text(TEXT * 10)
    (folder / "empty.txt").write_bytes(b"")
    out = tmp_path / "text.h5"

    def pack_folder():
        return subprocess.run([sys.executable, "-m", "petra_mpi.prep.text", "--source",
                               str(folder), "--out", str(out), "--val-fraction", "0.25"],
                              capture_output=True, text=True, cwd=ROOT, timeout=60)
    r = pack_folder()
    assert r.returncode == 0, r.stderr
    with h5py.File(out, "r") as f:
        packed = bytes(f["train/tokens"][()]) + bytes(f["val/tokens"][()])
    assert packed == (TEXT * 20).encode()  # a.txt then b.txt, nothing else
    (note,) = [line for line in r.stdout.splitlines() if line.startswith("note: skipped")]
    for name, why in ((".git", "a hidden folder"), (".DS_Store", "a hidden file"),
                      (".gitkeep", "a hidden file"), ("empty.txt", "the file is empty")):
        assert f"{folder / name} ({why})" in note
    for name in ("a.txt", "b.txt"):
        (folder / name).unlink()
    out.unlink()
    r = pack_folder()
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert "no text to pack" in r.stderr and "empty.txt: the file is empty" in r.stderr
    assert not out.exists()


def test_undecodable_bytes_are_fine_as_bytes(tmp_path):
    r, _ = pack(tmp_path, text=b"abc\xff\xfedef" * 10)
    assert r.returncode == 0, r.stderr


@pytest.fixture
def token_file(tmp_path):
    r, out = pack(tmp_path, "--val-fraction", "0.2")
    assert r.returncode == 0, r.stderr
    return out


def test_windows_are_inputs_and_next_tokens(token_file):
    src = open_split(token_file, "train").set_context(16)
    tokens = src.tokens
    assert len(src) == (len(tokens) - 1) // 16
    x, y = src.take([0, 3])
    assert x.shape == (2, 16) and y.shape == (32,)
    assert np.array_equal(x[1], tokens[48:64]) and np.array_equal(y[16:], tokens[49:65])
    with pytest.raises(ValueError, match="fewer than model.context 100000 \\+ 1"):
        open_split(token_file, "val").set_context(100_000)


def batches(loader):
    return [(x.clone(), y.clone()) for x, y in loader]


def test_loader_seeded_sharded_and_resumable(token_file):
    def loader(seed=0, shard=(0, 1)):
        return BatchLoader(open_split(token_file, "train").set_context(8), 4, train=True,
                           seed=seed, prefetch=0, shard=shard)
    first = batches(loader())
    assert first[0][0].dtype == torch.int64 and first[0][0].shape == (4, 8)
    assert all(torch.equal(a, b) for (a, _), (b, _) in zip(first, batches(loader())))
    assert not torch.equal(first[0][0], batches(loader(seed=1))[0][0])
    epoch1 = loader()
    epoch1.set_epoch(1)
    assert not torch.equal(first[0][0], batches(epoch1)[0][0])  # a new order every epoch
    # replicas read disjoint windows of the same epoch
    shares = [loader(shard=(r, 2)) for r in range(2)]
    windows = [i for share in shares for b in range(len(share)) for i in share.batch_indices(b)]
    assert len(shares[0]) == len(first) // 2
    assert len(windows) == len(set(windows)) == 2 * len(shares[0]) * 4
    x, _ = next(iter(shares[1]))
    assert torch.equal(x, torch.from_numpy(shares[1].src.take(shares[1].batch_indices(0))[0]))
    # mid-epoch resume: a fresh loader at the saved position goes on with the same batches
    run = loader()
    it = iter(run)
    for _ in range(3):
        next(it)
    state = run.state_dict()
    resumed = loader()
    resumed.load_state_dict(state)
    rest = batches(resumed)
    assert len(rest) == len(first) - 3
    assert all(torch.equal(a, b) and torch.equal(c, d)
               for (a, c), (b, d) in zip(first[3:], rest))


# ---- petra_mpi.prep.verify on token files -----------------------------------------------------------

def _break_id(f):
    f["train/tokens"][3] = int(f.attrs["num_classes"])


def _break_dtype(f):
    ids = f["val/tokens"][()]
    del f["val/tokens"]
    f.create_dataset("val/tokens", data=ids.astype(np.int64), chunks=(len(ids),))


def _break_missing_split(f):
    del f["val/tokens"]


def _break_kind(f):
    f.attrs["kind"] = "images"


def _break_bytes_per_token(f):
    f.attrs["bytes_per_token"] = 1.5


def _break_vocab_size(f):
    f.attrs["num_classes"] = np.int64(f.attrs["num_classes"] + 1)


def _break_chunks(f):
    ids = f["train/tokens"][()]
    del f["train/tokens"]
    f["train/tokens"] = ids  # contiguous


def _break_version(f):
    f.attrs["schema_version"] = np.int64(2)


UNICODE_TEXT = "héllo wörld, ünïcode\n" * 30


@pytest.mark.parametrize("breaker, words", [
    (_break_id, ["/train/tokens", "1 ids outside [0, "]),
    (_break_dtype, ["/val/tokens", "int64", "expected uint8"]),
    (_break_missing_split, ["/val/tokens is missing"]),
    (_break_kind, ["attr kind", "'images'"]),
    (_break_bytes_per_token, ["attr bytes_per_token = 1.5", "validation ids give 1."]),
    (_break_vocab_size, ["/vocab has", "attr num_classes is"]),
    (_break_chunks, ["/train/tokens is not chunked"]),
    (_break_version, ["schema_version"]),
])
def test_verify_catches_token_violations(tmp_path, breaker, words):
    """A packed character-vocabulary file verifies clean; each breakage is one problem naming
    what is wrong (and no complaint about images, labels or mean/std)."""
    from petra_mpi.prep.verify import verify
    r, good = pack(tmp_path, "--vocab", "char", text=UNICODE_TEXT)
    assert r.returncode == 0, r.stderr
    summary, problems = verify(str(good))
    assert problems == [] and any("tokens" in line for line in summary)
    assert_one_problem(good, tmp_path, breaker, words)


def test_verify_command_on_token_files(tmp_path):
    """The command: a bytes file is OK (exit 0); a bad one exits 1 with one line for its one
    problem."""
    def verify(path):
        return subprocess.run([sys.executable, "-m", "petra_mpi.prep.verify", str(path)],
                              capture_output=True, text=True, cwd=ROOT, timeout=60)
    r, good = pack(tmp_path)
    assert r.returncode == 0, r.stderr
    proc = verify(good)
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stderr
    assert f"train: {len(TEXT * 20) - round(len(TEXT * 20) * 0.1):,} tokens" in proc.stdout
    with h5py.File(good, "r+") as f:
        f.attrs["num_classes"] = np.int64(100)  # a bytes vocabulary has 256
        f["val/tokens"][:] = 0  # keeps the ids inside 100: one problem
        f["train/tokens"][:] = 0
    proc = verify(good)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 1 and len(lines) == 2, proc.stderr
    assert "INVALID, 1 problem(s)" in lines[0]
    assert "attr num_classes is 100, but a bytes vocabulary has 256 tokens" in lines[1]
