#!/bin/bash
# Pack ILSVRC2012 into data/imagenet.h5 (the encoded-JPEG schema) on the cluster: a job array packs
# one shard per task, and a merge job, which the first task submits with --dependency=afterok on
# this array, joins the shards once every task has succeeded. The join is virtual (seconds, no
# copy: data/imagenet.h5 reads the shard files, which must stay in $PARTS); MERGE_COPY=1 copies
# the bytes into a file that stands alone instead. Requests are sized in docs/data.md
# ("Packing ImageNet on a cluster"): about 5 minutes of work per shard, 1 hour asked.
#   SOURCE=/datasets/ILSVRC2012 sbatch slurm/pack_imagenet.sh
# SOURCE holds train/<wnid>/*.JPEG and val/ (see python -m petra_mpi.prep.imagenet --help); more packer
# options in PACK_ARGS, e.g. PACK_ARGS="--val-labels /datasets/LOC_val_solution.csv".
# To redo failed shards: sbatch --array=3,7 slurm/pack_imagenet.sh (its first task queues a merge).
# The same in two sbatch lines (NO_MERGE=1: no merge from the array):
#   jid=$(NO_MERGE=1 sbatch --parsable slurm/pack_imagenet.sh)
#   sbatch --dependency=afterok:$jid \
#     --wrap "python -m petra_mpi.prep.imagenet merge --out data/imagenet.h5 data/imagenet_parts/part*.h5"
#SBATCH --job-name=pack_imagenet
#SBATCH --array=0-15
#SBATCH --ntasks=1
#SBATCH --cpus-per-task=8
#SBATCH --time=1:00:00
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --output=slurm-%x-%A_%a.out
# ---- site settings: partition and account (or export SBATCH_PARTITION / SBATCH_ACCOUNT) ----
##SBATCH --partition=cpu
##SBATCH --account=myproject
: "${SOURCE:=/datasets/ILSVRC2012}"   # the ImageNet folder
: "${OUT:=data/imagenet.h5}"          # the merged file (data.path of the ImageNet configs)
: "${PARTS:=data/imagenet_parts}"     # where the shard files go
: "${SHARDS:=16}"                     # must match the --array range above (0 to SHARDS-1)
source "${PETRA_ROOT:-${SLURM_SUBMIT_DIR:-.}}/slurm/common.sh"

task=${SLURM_ARRAY_TASK_ID:?submit with sbatch: this script is a job array}
read -r -a pack_args <<<"${PACK_ARGS:-}"
mkdir -p "$PARTS" "$(dirname "$OUT")" || petra_die "cannot create $PARTS"

# The first task of a fresh submission queues the merge, to start when all shards succeeded.
first=${SLURM_ARRAY_TASK_MIN:-0}
if [[ $task == "$first" && ${SLURM_RESTART_COUNT:-0} == 0 && -z ${NO_MERGE:-} ]]; then
    # virtual join: reads ~20 MB of offsets and labels; a copy moves ~35 GB (>= 100 MB/s)
    merge_time=0:15:00 merge_copy=
    [[ -n ${MERGE_COPY:-} ]] && merge_time=2:00:00 merge_copy=" --copy"
    # The merge runs under this job's account, partition, QOS and reservation (where -A is
    # mandatory a bare sbatch fails), with this job's environment (HDF5_USE_FILE_LOCKING
    # included) whatever the site's --export default; a shard that fails leaves its dependency
    # never satisfied, and --kill-on-invalid-dep ends the merge then instead of leaving it
    # pending forever. If it cannot be queued, the shards still get packed: merge by hand.
    if merge_id=$(sbatch --parsable --job-name=pack_imagenet_merge --export=ALL \
        ${SLURM_JOB_ACCOUNT:+"--account=$SLURM_JOB_ACCOUNT"} \
        ${SLURM_JOB_PARTITION:+"--partition=$SLURM_JOB_PARTITION"} \
        ${SLURM_JOB_QOS:+"--qos=$SLURM_JOB_QOS"} \
        ${SLURM_JOB_RESERVATION:+"--reservation=$SLURM_JOB_RESERVATION"} \
        --dependency="afterok:$SLURM_ARRAY_JOB_ID" --kill-on-invalid-dep=yes \
        --ntasks=1 --cpus-per-task=1 --time=$merge_time \
        --output="$(dirname "$OUT")/slurm-%x-%j.out" \
        --wrap "$PYTHON -m petra_mpi.prep.imagenet merge --force --out $OUT$merge_copy $PARTS/part*.h5"); then
        petra_say "submitted merge job $merge_id (after array $SLURM_ARRAY_JOB_ID): writes $OUT"
    else
        petra_say "warning: could not submit the merge job; once every shard is packed, run:" \
                  "python -m petra_mpi.prep.imagenet merge --out $OUT$merge_copy $PARTS/part*.h5"
    fi
fi

petra_say "shard $task/$SHARDS of $SOURCE -> $PARTS/part$task.h5"
# --force: a task run again (requeued, or the array submitted again) packs its shard anew, and
# the merge rebuilds $OUT
"$PYTHON" -m petra_mpi.prep.imagenet --source "$SOURCE" --out "$PARTS/part$task.h5" --force \
    --shard "$task/$SHARDS" --workers "${SLURM_CPUS_PER_TASK:-1}" "${pack_args[@]}"
