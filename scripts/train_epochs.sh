#!/usr/bin/env bash
# Train the first N epochs of a run's recipe (the learning-rate schedule of all its epochs), then
# stop it as a scheduler would: SIGTERM, so it drains, checkpoints and exits; running the same
# command with a larger N (or `python -m petra_mpi.train ...` alone) resumes it.
#   scripts/train_epochs.sh N OUT_DIR CONFIG [--set KEY=VALUE ...]
# e.g. the first 2 of the 9 epochs of PETRA at J = 10, micro-batch 64 with k = 8:
#   scripts/train_epochs.sh 2 runs/probe_k8 configs/fashion_mnist.yaml --set model.stages=10 \
#       --set data.batch_size=64 --set train.accumulation=8
set -euo pipefail
[ $# -ge 3 ] || { sed -n 2,8p "$0" >&2; exit 2; }
epochs=$1 out=$2 config=$3
shift 3
mkdir -p "$out"
count() { grep -c '"event": "eval"' "$out/metrics.jsonl" 2>/dev/null || true; }
python -m petra_mpi.train "$config" --set run.out_dir="$out" "$@" &
pid=$!
while kill -0 "$pid" 2>/dev/null; do
    done_epochs=$(count)
    if [ "${done_epochs:-0}" -ge "$epochs" ]; then kill -TERM "$pid"; break; fi
    sleep 1
done
wait "$pid" || true  # 0 when it finished, 4 (checkpointed on SIGTERM) when it stopped
python - "$out/metrics.jsonl" <<'PY'
import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line)
    if r["event"] == "eval":
        print(f"epoch {r['epoch']}: val_acc {r['val_acc']:.4f} val_loss {r['val_loss']:.4f}")
PY
