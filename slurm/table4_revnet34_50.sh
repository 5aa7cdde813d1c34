#!/bin/bash
# Paper Table 4 (CIFAR-100), the RevNet34 and RevNet50 columns as a job array: task i runs
# CONFIGS[i] (0-4 RevNet34, 5-9 RevNet50). 18 stages, one rank and one GPU each.
# Submit from the repository root:  sbatch slurm/table4_revnet34_50.sh   (a subset: --array=0-4)
#SBATCH --job-name=table4_revnet34_50
#SBATCH --array=0-9%2
#SBATCH --ntasks=18
# layout for 4 GPUs per node, one GPU per rank (other sites: slurm/submit.sh, GPUS_PER_NODE)
#SBATCH --nodes=5
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
CONFIGS=(configs/table4/revnet{34,50}_{backprop,delayed_both,delayed_inputs,delayed_params,petra}.yaml)
source "${PETRA_ROOT:-${SLURM_SUBMIT_DIR:-.}}/slurm/common.sh"
petra_train
