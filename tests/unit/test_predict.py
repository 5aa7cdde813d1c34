"""`python -m petra_mpi.predict` (in this process) on a model trained briefly on a packed
folder of pictures: picture by picture it gives the probabilities the run's evaluation gives
the packed file, so its top-1 on the val folder is evaluate's; an unreadable picture, a
language model and a model exported away from its data each get one clear line."""
import json

import numpy as np
import pytest
import torch

from tests.support.model_files import CROP, language_model_file
from tests.support.pictures import CLASSES
from petra_mpi import evaluate, predict
from petra_mpi.data import BatchLoader, open_split
from petra_mpi.export import as_evaluated


@pytest.fixture
def model(picture_model):
    """(model.pt, the val folder, the packed file): tests/conftest.py's picture_model."""
    return picture_model[:3]


def run_predict(capsys, *args):
    status = predict.main([str(a) for a in args])
    out, err = capsys.readouterr()
    return status, out.splitlines(), err


def test_predict_gives_the_evaluation_picture_by_picture(model, capsys):
    path, val, data = model
    status, lines, err = run_predict(capsys, path, val, "--json", "--top", 3, "--batch-size", 4)
    assert status == 0, err
    answers = [json.loads(line) for line in lines]
    files = sorted(str(p) for c in CLASSES for p in (val / c).iterdir())
    assert [a["path"] for a in answers] == files  # the packer's order: classes, then names
    # the run's evaluation on the packed file, as evaluate computes it
    saved = evaluate.load_saved(str(path))
    net = as_evaluated(saved)
    loader = BatchLoader(open_split(str(data), "val"), 8, train=False, augment=False, seed=0,
                         crop=CROP)
    with torch.no_grad():
        probs = torch.cat([torch.softmax(net(x), 1) for x, _ in loader])
    for answer, row in zip(answers, probs):
        want, index = row.topk(3)
        assert [t["index"] for t in answer["top"]] == index.tolist(), answer
        assert np.allclose([t["probability"] for t in answer["top"]], want, atol=1e-5)
        assert [t["class"] for t in answer["top"]] == [CLASSES[i] for i in index]
    right = [a["top"][0]["class"] == a["path"].split("/")[-2] for a in answers]
    assert np.mean(right) == evaluate.evaluate(saved)["val_acc"]


def test_plain_lines_and_an_unreadable_picture(model, capsys, tmp_path):
    path, val, _ = model
    broken = tmp_path / "broken.jpg"
    broken.write_bytes(b"\xff\xd8\xff\xe0 and then nothing that decodes")
    first = val / "cat" / "cat_00.jpg"
    status, lines, err = run_predict(capsys, path, first, broken, val / "dog", "--top", 2)
    assert status == 1 and "1 of 7 picture(s) could not be read" in err
    assert len(lines) == 7
    assert lines[0].startswith(f"{first}: ") and lines[0].count("(") == 2
    assert lines[1].startswith(f"{broken}: error: cannot read the picture")
    assert all(line.startswith(str(val / "dog")) and "error" not in line for line in lines[2:])


def test_a_language_model_points_to_generate(tmp_path, capsys):
    lm = language_model_file(tmp_path / "lm.pt", vocab_size=256)
    status, lines, err = run_predict(capsys, lm, tmp_path)
    assert status == 2 and not lines
    assert err.strip() == (f"error: {lm} holds a language model (revlm): write text with it by "
                           f"python -m petra_mpi.generate {lm} --prompt TEXT")


def test_a_model_exported_away_from_its_data_asks_for_it(model, tmp_path, capsys):
    path, val, data = model
    saved = torch.load(path, weights_only=True)
    saved["preprocess"] = None  # as export writes it when data.path cannot be read
    moved = tmp_path / "moved.pt"
    torch.save(saved, moved)
    status, _, err = run_predict(capsys, moved, val)
    assert status == 2 and "name the file with --data" in err
    status, lines, err = run_predict(capsys, moved, val / "fox", "--data", data)
    assert status == 0 and len(lines) == 5, err
    if not torch.cuda.is_available():
        status, _, err = run_predict(capsys, path, val, "--device", "cuda")
        assert status == 2 and err.strip() == "error: --device cuda: no CUDA device here"
