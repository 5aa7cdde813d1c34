#!/bin/bash
# RevNet50 on ImageNet with PETRA (paper Table 2): 18 stages, one rank and GPU each, over 3 nodes.
# From the repository root: sbatch slurm/revnet50_imagenet.sh  (overrides: see common.sh)
# configs/imagenet.yaml is configs/table2/imagenet/revnet50_petra.yaml writing to runs/imagenet.
#SBATCH --job-name=revnet50_imagenet
#SBATCH --ntasks=18
#SBATCH --gpus-per-task=1
#SBATCH --cpus-per-task=8
#SBATCH --time=24:00:00
#SBATCH --requeue
#SBATCH --signal=B:USR1@300
#SBATCH --open-mode=append
#SBATCH --output=slurm-%x-%j.out
# site: ranks per node <= GPUs per node (consecutive stages share a node)
#SBATCH --nodes=3
#SBATCH --ntasks-per-node=6
# ---- site settings: partition and account (or export SBATCH_PARTITION / SBATCH_ACCOUNT) ----
##SBATCH --partition=gpu
##SBATCH --account=myproject
CONFIG_DEFAULT=configs/imagenet.yaml
source "${PETRA_ROOT:-${SLURM_SUBMIT_DIR:-.}}/slurm/common.sh"
petra_train
