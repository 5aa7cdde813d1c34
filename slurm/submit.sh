#!/bin/bash
# Submit a batch script laid out for this site's GPUs per node (GPUS_PER_NODE in the site block of
# slurm/common.sh, or in the environment): the script's --ntasks ranks on the fewest nodes, spread
# evenly, one GPU per rank. Anything after the script goes to sbatch (it beats the layout too).
#   slurm/submit.sh slurm/revnet50_imagenet.sh               # 18 ranks: 5 nodes x 4, or 3 x 6 on 8
#   GPUS_PER_NODE=8 slurm/submit.sh slurm/revnet18_imagenet.sh --array=3
# Plain `sbatch SCRIPT` uses the script's #SBATCH layout, written for 4 GPUs per node.
set -euo pipefail
script=${1:?usage: slurm/submit.sh SCRIPT [sbatch options...]}
shift
source "${PETRA_ROOT:-.}/slurm/common.sh"   # the site block (and the check that we are at the root)
ntasks=$(sed -n 's/^#SBATCH --ntasks=\([0-9]*\)$/\1/p' "$script")
[[ -n $ntasks ]] || petra_die "$script has no '#SBATCH --ntasks=N' line"
read -r -a layout <<<"$(petra_layout "$ntasks")"
petra_say "sbatch ${layout[*]} $* $script  ($ntasks ranks, $GPUS_PER_NODE GPUs per node)"
exec sbatch "${layout[@]}" "$@" "$script"
