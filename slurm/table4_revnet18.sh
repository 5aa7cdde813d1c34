#!/bin/bash
# Paper Table 4 (CIFAR-100), the RevNet18 column as a job array: task i runs CONFIGS[i].
# 10 stages, one rank and one GPU each. The RevNet34/50 columns: table4_revnet34_50.sh (18 ranks).
# From the repository root: sbatch slurm/table4_revnet18.sh   (one row: sbatch --array=4 ...)
#SBATCH --job-name=table4_revnet18
#SBATCH --array=0-4%2
#SBATCH --ntasks=10
# layout for 4 GPUs per node, one GPU per rank (other sites: slurm/submit.sh, GPUS_PER_NODE)
#SBATCH --nodes=3
#SBATCH --ntasks-per-node=4
#SBATCH --gpus-per-node=4
#SBATCH --cpus-per-task=4
#SBATCH --time=12:00:00
#SBATCH --requeue
#SBATCH --signal=B:USR1@300
#SBATCH --open-mode=append
#SBATCH --output=slurm-%x-%A_%a.out
# ---- site settings: partition and account (or export SBATCH_PARTITION / SBATCH_ACCOUNT) ----
##SBATCH --partition=gpu
##SBATCH --account=myproject
CONFIGS=(configs/table4/revnet18_{backprop,delayed_both,delayed_inputs,delayed_params,petra}.yaml)
source "${PETRA_ROOT:-${SLURM_SUBMIT_DIR:-.}}/slurm/common.sh"
petra_train
