#!/bin/bash
# Paper Fig. 4: RevNet18 on ImageNet with PETRA for accumulation k = 1 ... 32, and the backprop
# reference, as a job array: task i runs CONFIGS[i] (0-5: k = 1, 2, 4, 8, 16, 32; 6: backprop).
# 10 stages, one rank and one GPU each, over 3 nodes of 4 GPUs (2 of 8: slurm/submit.sh).
# Submit from the repository root:  sbatch slurm/fig4_revnet18_imagenet.sh   (a subset: --array=0,3)
#SBATCH --job-name=fig4_revnet18_imagenet
#SBATCH --array=0-6%2
#SBATCH --ntasks=10
# layout for 4 GPUs per node, one GPU per rank (other sites: slurm/submit.sh, GPUS_PER_NODE)
#SBATCH --nodes=3
#SBATCH --ntasks-per-node=4
#SBATCH --gpus-per-node=4
#SBATCH --cpus-per-task=8
#SBATCH --time=12:00:00
#SBATCH --requeue
#SBATCH --signal=B:USR1@300
#SBATCH --open-mode=append
#SBATCH --output=slurm-%x-%A_%a.out
# ---- site settings: partition and account (or export SBATCH_PARTITION / SBATCH_ACCOUNT) ----
##SBATCH --partition=gpu
##SBATCH --account=myproject
CONFIGS=(configs/fig4/revnet18_imagenet_{k1,k2,k4,k8,k16,k32,backprop}.yaml)
source "${PETRA_ROOT:-${SLURM_SUBMIT_DIR:-.}}/slurm/common.sh"
petra_train
