#!/bin/bash
# RevNet50 on CIFAR-10 with PETRA (paper Table 2): 18 stages, one rank and GPU each.
# From the repository root: sbatch slurm/revnet50_cifar10.sh  (overrides: see common.sh)
#SBATCH --job-name=revnet50_cifar10
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
#SBATCH --output=slurm-%x-%j.out
# ---- site settings: partition and account (or export SBATCH_PARTITION / SBATCH_ACCOUNT) ----
##SBATCH --partition=gpu
##SBATCH --account=myproject
CONFIG_DEFAULT=configs/table2/cifar10/revnet50_petra.yaml
source "${PETRA_ROOT:-${SLURM_SUBMIT_DIR:-.}}/slurm/common.sh"
petra_train
