#!/usr/bin/env bash
# The race of docs/peers.md ("The race") as docs/benchmarks.md reports it, on 2 ranks of an
# otherwise idle machine: every contender tuned (micro-batch 64, 32, 16 at 256 images per
# update), the layout and kept plans fixed once, 5 rounds of one launch per contender in a
# shuffled order, PETRA and torch's schedules over one transport (gloo); then the same race with
# every contender compiled (torch.compile); then the tables, the first with the time to
# accuracy of the accuracy runs in ACCURACY (directories of METHOD_J<J>[_mb<B>]_s<SEED> runs).
#   bash scripts/race.sh [OUT] > race.txt   (default runs/race: OUT/eager, OUT/compiled)
# Started again with the same OUT, a race goes on where it stopped (finished launches are kept).
# About 45 minutes for the eager race and 60 for the compiled one on an idle 2-core machine.
# RACE_ARGS: more `bench race` options for both races, after the script's own (the last of an
# option wins), e.g. a trial of the whole script in a few minutes:
#   RACE_ARGS="--rounds 1 --batches 8,4 --update 16 --width 4 --microbatches 1
#              --tune-microbatches 1 --threads 1" bash scripts/race.sh /tmp/race_trial
set -euo pipefail
out=${1:-runs/race}
accuracy=${ACCURACY:-docs/results/fashion_mnist docs/results/fashion_mnist/micro16}
emulated=${EMULATED:-docs/results/pareto/J10_paper_run1.txt}
read -r -a more <<< "${RACE_ARGS:-}"
python -m petra_mpi.bench race --rounds 5 --out "$out/eager" "${more[@]}"
python -m petra_mpi.bench race --rounds 5 --compile --out "$out/compiled" "${more[@]}"
# shellcheck disable=SC2086  # ACCURACY may name several directories
python -m petra_mpi.bench race --table "$out/eager" --accuracy $accuracy --emulated "$emulated" \
    --target 0.9
python -m petra_mpi.bench race --table "$out/compiled"
