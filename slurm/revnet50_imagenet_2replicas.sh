#!/bin/bash
# RevNet50 on ImageNet with PETRA, 2 data-parallel replicas of the 18-stage pipeline: 36 ranks and
# GPUs over 9 nodes of 4 GPUs (5 of 8: slurm/submit.sh), rank = replica · 18 + stage, so each
# replica's consecutive stages share nodes (SLURM's block distribution) and only the gradient
# all-reduces cross between replicas.
# From the repository root: sbatch slurm/revnet50_imagenet_2replicas.sh  (overrides: see common.sh)
# Table 2's recipe with k = 32 per replica: 4096 images per optimizer step (see the config).
#SBATCH --job-name=revnet50_imagenet_2replicas
#SBATCH --ntasks=36
# layout for 4 GPUs per node, one GPU per rank (other sites: slurm/submit.sh, GPUS_PER_NODE)
#SBATCH --nodes=9
#SBATCH --ntasks-per-node=4
#SBATCH --gpus-per-node=4
#SBATCH --cpus-per-task=8
#SBATCH --time=12:00:00
#SBATCH --requeue
#SBATCH --signal=B:USR1@300
#SBATCH --open-mode=append
#SBATCH --output=slurm-%x-%j.out
# ---- site settings: partition and account (or export SBATCH_PARTITION / SBATCH_ACCOUNT) ----
##SBATCH --partition=gpu
##SBATCH --account=myproject
CONFIG_DEFAULT=configs/replicas/revnet50_imagenet_2x18.yaml
source "${PETRA_ROOT:-${SLURM_SUBMIT_DIR:-.}}/slurm/common.sh"
petra_train
