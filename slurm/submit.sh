#!/bin/bash
# Submit a batch script laid out for this site's GPUs per node (GPUS_PER_NODE in the site block of
# slurm/common.sh, or in the environment): the script's --ntasks ranks on the fewest nodes, spread
# evenly, one GPU per rank. Anything after the script goes to sbatch (it beats the layout too).
#   slurm/submit.sh slurm/revnet50_imagenet.sh               # 18 ranks: 5 nodes x 4, or 3 x 6 on 8
#   GPUS_PER_NODE=8 slurm/submit.sh slurm/revnet18_imagenet.sh --array=3
#   ELASTIC_NODES=2-3 slurm/submit.sh slurm/revnet18_cifar10.sh  # GPUS_PER_NODE ranks per node
# ELASTIC_NODES=MIN-MAX submits with that node range and no fixed rank count (the script's
# --ntasks and layout lines are left out): a job started on fewer nodes gets fewer ranks, and with
# ELASTIC=1 the run goes on in the layout that fits them (slurm/common.sh). It also submits with
# --no-kill: a node lost mid-run leaves the job running on the others, where the script launches
# the run again on the layout that fits them. (A requeued job keeps the node count it first ran
# with, and its node range cannot be changed from inside the job: a job that lost its batch node
# resumes when that node is back, or resubmit it.)
# Plain `sbatch SCRIPT` uses the script's #SBATCH layout, written for 4 GPUs per node.
# Submits with --export=ALL: the overrides of your shell (CONFIG, EXTRA_ARGS, OUT_DIR, ...) reach
# the job even where the site defaults to --export=NONE (SBATCH_EXPORT).
set -euo pipefail
script=${1:?usage: slurm/submit.sh SCRIPT [sbatch options...]}
shift
source "${PETRA_ROOT:-.}/slurm/common.sh"   # the site block (and the check that we are at the root)
if [[ -n ${ELASTIC_NODES:-} ]]; then
    per_node=(--ntasks-per-node="$GPUS_PER_NODE" --gpus-per-node="$GPUS_PER_NODE")
    petra_say "sbatch --nodes=$ELASTIC_NODES --no-kill ${per_node[*]} $* $script (elastic)"
    export ELASTIC=1  # sbatch passes the environment on to the job
    sed '/^#SBATCH --\(ntasks\|nodes\|ntasks-per-node\|gpus-per-node\)=/d' "$script" |
        sbatch --export=ALL --nodes="$ELASTIC_NODES" --no-kill "${per_node[@]}" "$@"
    exit "${PIPESTATUS[1]}"
fi
ntasks=$(sed -n 's/^#SBATCH --ntasks=\([0-9]*\)$/\1/p' "$script")
[[ -n $ntasks ]] || petra_die "$script has no '#SBATCH --ntasks=N' line"
read -r -a layout <<<"$(petra_layout "$ntasks")"
petra_say "sbatch ${layout[*]} $* $script  ($ntasks ranks, $GPUS_PER_NODE GPUs per node)"
exec sbatch --export=ALL "${layout[@]}" "$@" "$script"
