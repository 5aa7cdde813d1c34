# Shared body of the slurm/*.sh batch scripts; sourced by them, never run alone.
#
# An experiment script is its #SBATCH lines, CONFIG_DEFAULT (or CONFIGS=(...) for a job array,
# where SLURM_ARRAY_TASK_ID picks the entry) and `source .../common.sh; petra_train`.
#
# Environment overrides (all optional):
#   CONFIG      the config file (default: the script's CONFIG_DEFAULT or its array entry)
#   EXTRA_ARGS  more trainer arguments, split on whitespace, e.g. "--set train.epochs=1"
#   OUT_DIR     the run directory (default: runs/<config path under configs/, without .yaml>;
#               stable across requeues, so a requeued job finds its checkpoints)
#   LAUNCHER    srun (default) or mpirun
#   SRUN_MPI    the srun --mpi plugin (default pmix)
#   DRY_RUN=1   only run the trainer's --dry-run in one process (no srun/mpirun) and exit
#   MAX_REQUEUES  stop requeueing after this many restarts (default 100)
#
# Stop and requeue: SLURM sends SIGUSR1 to this batch shell 5 minutes before the time limit
# (#SBATCH --signal=B:USR1@300); `scancel --signal=USR1 --batch JOB` does the same by hand. The trap
# forwards it to the launcher, which forwards it to every rank; the ranks drain the pipeline, write
# a checkpoint and exit 3, and the job requeues itself; the requeued job resumes (run.resume=auto).
# SIGTERM (scancel, preemption) also makes the ranks checkpoint and exit 3, but the job does not
# requeue itself: a cancelled job stays cancelled, and SLURM requeues a preempted job on its own.

# ============================== site settings: edit for your cluster ==============================
# Software: load modules and activate the Python environment holding petra_mpi and an mpi4py built
# against this MPI (docs/clusters.md: "Installing against the site's MPI"). For example:
#   module load cuda/12.4 openmpi/4.1.6
#   source "$HOME/venvs/petra/bin/activate"          # or: conda activate petra
# Partition and account: set them in the #SBATCH lines of each script, or once in your shell before
# sbatch:  export SBATCH_PARTITION=gpu SBATCH_ACCOUNT=myproject
: "${LAUNCHER:=srun}"    # srun: a SLURM-integrated MPI; mpirun: one node only (e.g. PyPI's MPICH)
: "${SRUN_MPI:=pmix}"    # pmix for Open MPI and most sites; pmi2 for MPICH / Intel MPI
: "${PYTHON:=python}"
# ==================================================================================================

EXIT_REQUEUE=3          # the trainer's "checkpointed, please requeue" status

petra_say() {
    local line="[petra $(date '+%F %T')] $*"
    echo "$line"
    if [[ -n ${PETRA_LOG:-} ]]; then echo "$line" >>"$PETRA_LOG"; fi
}

petra_die() { petra_say "error: $*"; exit 2; }

# The repository root: sbatch runs the script from a spool copy, so $0 cannot locate it; jobs start
# in the submit directory, so submit from the repository root (or export PETRA_ROOT).
cd "${PETRA_ROOT:-${SLURM_SUBMIT_DIR:-.}}" || petra_die "cannot cd to the repository root"
[[ -f slurm/common.sh ]] ||
    petra_die "run sbatch from the repository root (or set PETRA_ROOT); cwd is $PWD"

# CONFIG and OUT_DIR for this job (an array task picks its entry of CONFIGS).
petra_resolve() {
    local task=${SLURM_ARRAY_TASK_ID:-}
    local suffix=""
    if [[ -n ${CONFIG:-} ]]; then
        # One config for every task of an array (tests, reruns): keep the tasks' run dirs apart.
        if [[ -n $task ]]; then suffix="/task$task"; fi
    elif [[ -n ${CONFIGS+x} ]]; then
        [[ -n $task ]] ||
            petra_die "a job array: submit it with sbatch, or set SLURM_ARRAY_TASK_ID or CONFIG"
        ((task >= 0 && task < ${#CONFIGS[@]})) ||
            petra_die "array task $task has no config: ${#CONFIGS[@]} configs (${CONFIGS[*]})"
        CONFIG=${CONFIGS[$task]}
    else
        CONFIG=${CONFIG_DEFAULT:?the script sets CONFIG_DEFAULT}
    fi
    [[ -f $CONFIG ]] || petra_die "config $CONFIG not found (in $PWD)"
    if [[ -z ${OUT_DIR:-} ]]; then
        local name=${CONFIG#./}
        name=${name#configs/}
        OUT_DIR="runs/${name%.y*ml}"
    fi
    OUT_DIR+=$suffix
    read -r -a EXTRA <<<"${EXTRA_ARGS:-}"
}

# Forward a signal to the launcher (which forwards it to every rank); remember it if none runs yet.
petra_forward() {
    PETRA_SIGNAL+=" $1"
    petra_say "batch shell got SIG$1: forwarding it to the launcher (pid ${PETRA_PID:-none})"
    if [[ -n ${PETRA_PID:-} ]]; then kill -s "$1" "$PETRA_PID" 2>/dev/null; fi
}

petra_requeue() {
    local restarts=${SLURM_RESTART_COUNT:-0}
    if [[ $PETRA_SIGNAL == " TERM"* ]]; then
        petra_say "checkpointed after SIGTERM (scancel or preemption): not requeueing;" \
                  "resubmit the same script to resume"
        exit "$EXIT_REQUEUE"
    fi
    if ((restarts >= ${MAX_REQUEUES:-100})); then
        petra_say "checkpointed, not requeueing: restarted $restarts times (MAX_REQUEUES)"
        exit "$EXIT_REQUEUE"
    fi
    if scontrol requeue "$SLURM_JOB_ID"; then
        petra_say "checkpointed; requeued job $SLURM_JOB_ID (it resumes from $OUT_DIR/checkpoints)"
        exit 0
    fi
    petra_say "checkpointed, but scontrol requeue failed (job cancelled?):" \
              "resubmit the same script to resume"
    exit "$EXIT_REQUEUE"
}

petra_train() {
    petra_resolve
    if [[ ${DRY_RUN:-0} == 1 ]]; then
        petra_say "dry run: $PYTHON -m petra_mpi.train $CONFIG --dry-run ${EXTRA[*]}"
        "$PYTHON" -m petra_mpi.train "$CONFIG" --dry-run "${EXTRA[@]}"
        exit
    fi
    [[ -n ${SLURM_JOB_ID:-} ]] ||
        petra_die "submit with sbatch (or set DRY_RUN=1 to check the config)"

    PETRA_SIGNAL="" PETRA_PID=""
    trap 'petra_forward USR1' USR1
    trap 'petra_forward TERM' TERM

    mkdir -p "$OUT_DIR/logs" || petra_die "cannot create $OUT_DIR/logs"
    PETRA_LOG="$OUT_DIR/logs/train.log"
    local trainer=("$PYTHON" -m petra_mpi.train "$CONFIG" --set "run.out_dir=$OUT_DIR"
                   --set run.resume=auto "${EXTRA[@]}")
    local launch
    case $LAUNCHER in
        srun) launch=(srun "--mpi=$SRUN_MPI") ;;
        mpirun) launch=(mpirun -n "${SLURM_NTASKS:-1}") ;;
        *) petra_die "LAUNCHER must be srun or mpirun, not '$LAUNCHER'" ;;
    esac
    petra_say "job $SLURM_JOB_ID (restart ${SLURM_RESTART_COUNT:-0})" \
              "on ${SLURM_JOB_NODELIST:-$(hostname)}, ${SLURM_NTASKS:-1} ranks; log: $PETRA_LOG"
    petra_say "${launch[*]} ${trainer[*]}"
    if [[ -n $PETRA_SIGNAL ]]; then petra_requeue; fi   # stopped before starting: nothing to save

    # In the background, so the traps run while we wait; a trap interrupts `wait`, so wait again
    # until the launcher has really exited.
    "${launch[@]}" "${trainer[@]}" >>"$PETRA_LOG" 2>&1 &
    PETRA_PID=$!
    local status
    while :; do
        wait "$PETRA_PID"
        status=$?
        kill -0 "$PETRA_PID" 2>/dev/null || break
    done
    PETRA_PID=""
    case $status in
        0) petra_say "finished: $OUT_DIR/summary.json"; exit 0 ;;
        "$EXIT_REQUEUE") petra_requeue ;;
        *) petra_say "failed with status $status (see $PETRA_LOG)"; exit "$status" ;;
    esac
}
