"""A tiny language-model run through the train command: a token file packed from random words,
and the command's arguments (tests/unit/test_lm.py, tests/mpi/test_lm_mpi.py)."""
import subprocess
import sys

import torch

from tests.support.paths import ROOT


def tiny_lm_run(token_file, out, *sets):
    """The train command's arguments for a tiny revlm on `token_file` (2 stages, 2 epochs of 6
    micro-batches, k = 2, AdamW), one torch thread per rank."""
    return ["-m", "petra_mpi.train", str(ROOT / "configs/lm/shakespeare_cpu.yaml"),
            "--set", f"data.path={token_file}", "--set", f"run.out_dir={out}",
            "--set", "run.threads=1", "--set", "run.progress=false", "--set", "model.width=16",
            "--set", "model.heads=2", "--set", "model.depth=2", "--set", "model.context=16",
            "--set", "model.stages=2", "--set", "data.batch_size=4", "--set", "train.epochs=2",
            "--set", "train.limit_batches=6", "--set", "train.limit_eval_batches=3",
            "--set", "train.accumulation=2", "--set", "data.prefetch=0", *sets]


def pack_token_file(folder):
    """folder/text.h5: 3,000 random words packed by petra_mpi.prep.text (bytes)."""
    text = folder / "text.txt"
    g = torch.Generator().manual_seed(0)
    words = ["the", "king", "queen", "doth", "speak", "and", "thou", "art", "\n"]
    text.write_text(" ".join(words[i] for i in torch.randint(0, 9, (3000,), generator=g)))
    out = folder / "text.h5"
    subprocess.run([sys.executable, "-m", "petra_mpi.prep.text", "--source", str(text), "--out",
                    str(out)], check=True, capture_output=True, cwd=ROOT, timeout=60)
    return out
