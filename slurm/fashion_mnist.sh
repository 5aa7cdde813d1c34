#!/bin/bash
# RevNet18 on Fashion-MNIST with PETRA at full size: 10 stages, one rank and GPU each.
# Pack the data once first (docs/data.md), e.g. from the Debian package dataset-fashion-mnist:
#   python -m petra_mpi.prep.idx --source /usr/share/datasets/fashion-mnist --out data/fashion_mnist.h5
# From the repository root: sbatch slurm/fashion_mnist.sh  (overrides: see common.sh; the backprop
# twin: CONFIG=configs/fashion_mnist_gpu_backprop.yaml sbatch slurm/fashion_mnist.sh)
#SBATCH --job-name=fashion_mnist
#SBATCH --ntasks=10
# layout for 4 GPUs per node, one GPU per rank (other sites: slurm/submit.sh, GPUS_PER_NODE)
#SBATCH --nodes=3
#SBATCH --ntasks-per-node=4
#SBATCH --gpus-per-node=4
#SBATCH --cpus-per-task=4
#SBATCH --time=4:00:00
#SBATCH --requeue
#SBATCH --signal=B:USR1@300
#SBATCH --open-mode=append
#SBATCH --output=slurm-%x-%j.out
# ---- site settings: partition and account (or export SBATCH_PARTITION / SBATCH_ACCOUNT) ----
##SBATCH --partition=gpu
##SBATCH --account=myproject
CONFIG_DEFAULT=configs/fashion_mnist_gpu.yaml
source "${PETRA_ROOT:-${SLURM_SUBMIT_DIR:-.}}/slurm/common.sh"
petra_train
