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
#   LAUNCHER    srun (default) or mpirun (one node only)
#   STUCK_GRACE_S  under mpirun: seconds to wait for mpirun after a watchdog report before
#               giving up on it (default 60; srun ends such a step itself)
#   SRUN_MPI    the srun --mpi plugin (default: none given, so srun uses the site's MpiDefault)
#   DRY_RUN=1   only run the trainer's --dry-run in one process (no srun/mpirun) and exit
#   MAX_REQUEUES  stop requeueing after this many restarts (default 100)
#   STALL_RESTARTS  after a stall (exit 5), requeue at most this many times in a row without a
#               newer complete checkpoint (default 2)
#   EXCLUDE_STALLED=0  do not keep a job requeued after a stall off the node the watchdog
#               reports blame (default 1: scontrol update ExcNodeList)
#   EXCLUDE_MAX  the most hosts this script keeps a job off at once (default 2): the one blamed
#               longest ago is allowed again first
#   ELASTIC=1   fit the layout to the ranks this job got (SLURM_NTASKS): `python -m
#               petra_mpi.elastic` gives the ranks to launch and the stage count that fits them,
#               and the trainer resumes its layout-free checkpoint on that layout
#
# Stop and requeue: SLURM sends SIGUSR1 to this batch shell 5 minutes before the time limit
# (#SBATCH --signal=B:USR1@300); `scancel --signal=USR1 --batch JOB` does the same by hand. The trap
# forwards it to the launcher, which forwards it to every rank; the ranks drain the pipeline, write
# a checkpoint and exit 3, and the job requeues itself; the requeued job resumes (run.resume=auto).
# SIGTERM to this shell (scancel -b, admin tooling) is forwarded as SIGUSR1 too: srun answers a
# SIGTERM by killing every rank at once, mid-checkpoint. A SIGTERM to the ranks alone (scancel -s
# TERM, a preemption's grace time) makes them checkpoint and exit EXIT_CHECKPOINTED_TERM. After a
# SIGTERM either way the job does not requeue itself (a cancelled job stays cancelled; SLURM
# requeues a preempted job on its own) and ends with EXIT_CHECKPOINTED_TERM; when SLURM sent
# it because a node of the job failed (or to preempt it) and has requeued the job itself, as
# `scontrol show job` tells, the script says so and ends with 0.
#
# Exit statuses of a job: docs/clusters.md, "Exit statuses" (tests/e2e/test_slurm.py holds the
# table to this script).

# ============================== site settings: edit for your cluster ==============================
# Software: load modules and activate the Python environment holding petra_mpi and an mpi4py built
# against this MPI (docs/clusters.md: "Installing against the site's MPI"). For example:
#   module load cuda/12.4 openmpi/4.1.6
#   source "$HOME/venvs/petra/bin/activate"          # or: conda activate petra
# Partition and account: set them in the #SBATCH lines of each script, or once in your shell before
# sbatch:  export SBATCH_PARTITION=gpu SBATCH_ACCOUNT=myproject
: "${GPUS_PER_NODE:=4}" # GPUs per node of your GPU partition: slurm/submit.sh lays ranks out by it
: "${LAUNCHER:=srun}"    # srun: a SLURM-integrated MPI; mpirun: one node only (e.g. PyPI's MPICH)
: "${SRUN_MPI:=}"        # empty: the site's MpiDefault; else e.g. pmix, pmi2, cray_shasta
: "${PYTHON:=python}"
# HDF5 locks every file it opens, which fails ("unable to lock file") on file systems without
# flock (NFS without lockd, Cray DVS, Lustre without -o flock); the data files here are written
# once by one process and only read afterwards. TRUE where the site wants the locks.
export HDF5_USE_FILE_LOCKING=${HDF5_USE_FILE_LOCKING:-FALSE}
# ==================================================================================================

EXIT_REQUEUE=3            # the trainer's "checkpointed on SIGUSR1, please requeue" status; also
                          # ours when a checkpointed job is not requeued (resubmit to resume)
EXIT_CHECKPOINTED_TERM=4  # the trainer's "checkpointed on SIGTERM" (a cancel, a preemption), and
                          # ours after a SIGTERM to this shell: do not requeue
EXIT_STALLED=5            # the trainer's watchdog ended a rank that made no progress (a lost
                          # node or a hang): requeue, the run resumes from its last checkpoint

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
source slurm/lib/launch_end.sh

# A job submitted with --export=NONE (or a list without ALL; some sites default to it through
# SBATCH_EXPORT) starts without the submitting shell's variables, and srun inherits that policy
# (SLURM_EXPORT_ENV), which would start the ranks without the modules and Python environment of
# the site block: every srun of this job passes this shell's whole environment on.
if [[ -n ${SLURM_JOB_ID:-} ]]; then
    if [[ -n ${SLURM_EXPORT_ENV:-} && ${SLURM_EXPORT_ENV^^} != ALL* ]]; then
        petra_say "warning: submitted with --export=$SLURM_EXPORT_ENV: CONFIG, EXTRA_ARGS," \
                  "OUT_DIR and the other overrides of your shell did not reach this job;" \
                  "submit with slurm/submit.sh or sbatch --export=ALL"
    fi
    export SLURM_EXPORT_ENV=ALL
fi

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
        # An OUT_DIR given for the whole array holds one run directory per config: the tasks run
        # at once and would otherwise share checkpoints and metrics.
        if [[ -n ${OUT_DIR:-} ]]; then
            local base=${CONFIG##*/}
            suffix="/${base%.y*ml}"
        fi
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

# The state of a job (RUNNING, PENDING, ...), or nothing when SLURM no longer knows it.
petra_job_state() {
    scontrol -o show job "$1" 2>/dev/null | sed -n 's/.* JobState=\([A-Z_]*\).*/\1/p' | head -n 1
}

# One job per run directory: a resubmission while the requeued job waits, or two jobs given one
# OUT_DIR, would run two trainers on one set of checkpoints. The run directory names the job
# that uses it (logs/job); a job refuses it while that other job is queued or running. The file
# is only ever created where there is none (noclobber: O_EXCL), and an ended job's is renamed
# away (of two jobs renaming it, one does): of two jobs starting at once, one gets it.
petra_lock() {
    local lock="$OUT_DIR/logs/job" holder taken state tries
    for tries in 1 2 3 4 5; do
        if (set -o noclobber; echo "$SLURM_JOB_ID" >"$lock") 2>/dev/null; then return 0; fi
        holder=""
        read -r holder <"$lock" 2>/dev/null
        if [[ $holder == "$SLURM_JOB_ID" ]]; then return 0; fi
        if [[ -z $holder ]] && ((tries < 5)); then sleep 1; continue; fi  # being written
        if [[ -n $holder ]]; then
            state=$(petra_job_state "$holder")
            case $state in
                "" | COMPLETED | FAILED | CANCELLED | TIMEOUT | NODE_FAIL | OUT_OF_MEMORY | \
                    BOOT_FAIL | DEADLINE | PREEMPTED) ;;  # ended: the directory is free
                *) petra_die "$OUT_DIR is the run directory of job $holder ($state): wait for" \
                             "it, cancel it (scancel $holder), or give this job another OUT_DIR" ;;
            esac
        fi
        if mv "$lock" "$lock.$SLURM_JOB_ID" 2>/dev/null; then
            taken=""
            read -r taken <"$lock.$SLURM_JOB_ID"
            if [[ $taken != "$holder" ]]; then  # another job's, taken meanwhile: put it back
                (set -o noclobber; cat "$lock.$SLURM_JOB_ID" >"$lock") 2>/dev/null
            fi
            rm -f "$lock.$SLURM_JOB_ID"
        fi
    done
    petra_die "cannot take $lock: other jobs keep taking it"
}

# Whether this job is requeued already: `scontrol requeue` can report a failure after doing its
# work (killed by the job's end, or a time-out waiting for the answer).
petra_was_requeued() {
    local job restarts
    job=$(scontrol -o show job "$SLURM_JOB_ID" 2>/dev/null) || return 1
    restarts=$(sed -n 's/.* Restarts=\([0-9]*\).*/\1/p' <<<"$job")
    [[ -n $restarts ]] && ((restarts > ${SLURM_RESTART_COUNT:-0})) ||
        [[ $job =~ \ JobState=(REQUEUE|PENDING) ]]
}

# The --nodes, --ntasks-per-node and --gpus-per-node of a job of NTASKS ranks, one GPU each, on
# nodes of GPUS_PER_NODE GPUs: the fewest nodes, the ranks spread evenly over them (consecutive
# ranks, i.e. consecutive stages, share a node under SLURM's block distribution).
petra_layout() {
    local ntasks=$1 per_node=${2:-$GPUS_PER_NODE}
    ((ntasks > 0 && per_node > 0)) || petra_die "petra_layout: ranks and GPUs per node must be > 0"
    local nodes=$(((ntasks + per_node - 1) / per_node))
    local tasks=$(((ntasks + nodes - 1) / nodes))
    echo "--nodes=$nodes --ntasks-per-node=$tasks --gpus-per-node=$tasks"
}

# Tell the launcher to stop the ranks; remember the signal (and act on it later if none runs yet).
# Always SIGUSR1: srun passes it to every rank, while a SIGTERM makes srun kill the step at once.
petra_forward() {
    PETRA_SIGNAL+=" $1"
    petra_say "batch shell got SIG$1: sending SIGUSR1 to the launcher (pid ${PETRA_PID:-none})"
    if [[ -n ${PETRA_PID:-} ]]; then
        kill -s USR1 "$PETRA_PID" 2>/dev/null
        # SLURM kills this shell KillWait after its SIGTERM, maybe before srun is over: say now
        # what was lost and what SLURM does with the job
        if [[ $1 == TERM ]]; then petra_name_stall; petra_slurm_requeued; fi
    fi
}

# Whether SLURM itself requeued this job when it sent SIGTERM (a node failure, or a preemption,
# of a --requeue job: `scontrol show job` has its restart count grown at once, which a scancel
# leaves as it was); said once, with the job's nodes that SLURM marks down.
petra_slurm_requeued() {
    [[ $PETRA_SIGNAL == *TERM* ]] || return 1
    if [[ -n $PETRA_SLURM_REQUEUED ]]; then return 0; fi
    (trap '' TERM; petra_was_requeued) || return 1  # (SLURM's SIGTERM reaches every process)
    PETRA_SLURM_REQUEUED=1
    local down="" why=""
    if [[ -n ${SLURM_JOB_NODELIST:-} ]]; then
        down=$(trap '' TERM; sinfo -h -N -n "$SLURM_JOB_NODELIST" -t down,fail,no_respond \
                                   -o %N 2>/dev/null | sort -u | paste -sd , -)
    fi
    if [[ -n $down ]]; then why=" (node failure: $down down)"; fi
    petra_say "SLURM requeued job $SLURM_JOB_ID$why: it resumes from its last complete" \
              "checkpoint in $OUT_DIR/checkpoints"
}

# The end of a job whose batch shell got SIGTERM: SLURM's doing, so say what SLURM does with the
# job. $1: what the run saved ("checkpointed", "nothing saved"); $2: the status when SLURM does
# not requeue the job (a scancel, a preemption that cancels): resubmit to resume.
petra_end_after_term() {
    if petra_slurm_requeued; then
        petra_say "$1; SLURM requeued the job itself"
        exit 0
    fi
    petra_say "$1 after SIGTERM (scancel or preemption), not requeueing:" \
              "resubmit the same script to resume"
    exit "$2"
}

# Requeue the job after a stop on SIGUSR1 (time limit, scancel -s USR1), unless a SIGTERM reached
# this shell or MAX_REQUEUES is reached. $1: what the stop saved, for the messages ("checkpointed",
# or "nothing saved" when the ranks ended before they could checkpoint).
petra_requeue() {
    local saved=$1 restarts=${SLURM_RESTART_COUNT:-0}
    if [[ $PETRA_SIGNAL == *TERM* ]]; then
        petra_end_after_term "$saved" "$EXIT_CHECKPOINTED_TERM"
    fi
    if ((restarts >= ${MAX_REQUEUES:-100})); then
        petra_say "$saved, not requeueing: restarted $restarts times (MAX_REQUEUES)"
        exit "$EXIT_REQUEUE"
    fi
    # SLURM ends this shell once the job is requeued (SIGTERM to it and its children, SIGKILL
    # after KillWait): ignored, so that scontrol can answer and the check below can run.
    trap '' TERM
    if scontrol requeue "$SLURM_JOB_ID" || petra_was_requeued; then
        petra_say "$saved; requeued job $SLURM_JOB_ID (it resumes from its last complete" \
                  "checkpoint in $OUT_DIR/checkpoints)"
        exit 0
    fi
    petra_say "$saved, but scontrol requeue failed (job cancelled?):" \
              "resubmit the same script to resume"
    exit "$EXIT_REQUEUE"
}

# RANKS and FIT_ARGS: the ranks to launch on this allocation and the trainer overrides that fit
# them (none when the config fits as it is; see petra_mpi/run/elastic.py).
petra_fit() {
    RANKS=${SLURM_NTASKS:-1} FIT_ARGS=()
    [[ ${ELASTIC:-0} == 1 && -n ${SLURM_NTASKS:-} ]] || return 0
    local fit
    fit=$("$PYTHON" -m petra_mpi.elastic "$CONFIG" "$SLURM_NTASKS" "${EXTRA[@]}") ||
        petra_die "no layout of $CONFIG fits this job's $SLURM_NTASKS ranks"
    read -r -a fit <<<"$fit"
    RANKS=${fit[0]} FIT_ARGS=("${fit[@]:1}")
    if ((${#FIT_ARGS[@]})); then
        petra_say "elastic: $SLURM_NTASKS ranks on ${SLURM_JOB_NUM_NODES:-1} node(s): launching" \
                  "$RANKS with ${FIT_ARGS[*]}"
    fi
}

# Launch the trainer on this job's ranks (the layout that fits them under ELASTIC=1) and wait for
# it; its exit status in `status`.
petra_launch() {
    trainer=("$PYTHON" -m petra_mpi.train "$CONFIG" --set "run.out_dir=$OUT_DIR"
             --set run.resume=auto "${EXTRA[@]}")
    petra_fit
    trainer+=("${FIT_ARGS[@]}")
    launch=()
    case $LAUNCHER in
        srun)
            # --cpus-per-task explicitly: srun 22.05-23.02 ignores SLURM_CPUS_PER_TASK and binds
            # each rank to one CPU. --gpu-bind=none: every rank sees all GPUs of its node (CUDA
            # IPC between the stages of a node needs that); petra_mpi picks one by SLURM_LOCALID.
            # A job asked with --cpus-per-gpu has no SLURM_CPUS_PER_TASK: with one GPU per rank
            # the two are the same (and srun refuses both at once).
            if [[ -z ${SLURM_CPUS_PER_TASK:-} && -n ${SLURM_CPUS_PER_GPU:-} ]]; then
                export SLURM_CPUS_PER_TASK=$SLURM_CPUS_PER_GPU
                unset SLURM_CPUS_PER_GPU
            fi
            # --kill-on-bad-exit=1: when a rank exits with an error (a watchdog's 5, a crash),
            # srun ends the others; SLURM's default (KillOnBadExit=0, WaitTime=0) waits for
            # every rank, and one that cannot exit (a GPU or I/O hang) would hold the job until
            # its time limit. --wait: the same, a minute after a rank exited 0.
            launch=(srun "--cpus-per-task=${SLURM_CPUS_PER_TASK:-1}" --gpu-bind=none
                    --kill-on-bad-exit=1 --wait=60)
            if [[ -n $SRUN_MPI ]]; then launch+=("--mpi=$SRUN_MPI"); fi
            if [[ $RANKS != "${SLURM_NTASKS:-1}" ]]; then launch+=("--ntasks=$RANKS"); fi
            # after a lost node the old step lingers (its node cannot confirm the end) and
            # holds the CPUs of the nodes left: the new step shares them
            if [[ -n ${PETRA_SHRUNK:-} ]]; then launch+=(--overlap); fi ;;
        mpirun)
            # mpirun knows nothing of SLURM's GPUs on other nodes (nor, with some MPIs, of the
            # nodes at all): remote ranks could share one GPU, or all run on this node.
            ((${SLURM_JOB_NUM_NODES:-1} == 1)) ||
                petra_die "LAUNCHER=mpirun runs on one node only; this job has" \
                          "$SLURM_JOB_NUM_NODES nodes: use LAUNCHER=srun (see docs/clusters.md)"
            # Hydra (MPICH, Intel MPI) inside an allocation starts its proxy with `srun -n1`,
            # a step that SLURM 22.05-23.02 gives one CPU, shared by every rank: fork it here.
            export HYDRA_LAUNCHER=${HYDRA_LAUNCHER:-fork}
            export I_MPI_HYDRA_BOOTSTRAP=${I_MPI_HYDRA_BOOTSTRAP:-fork}
            # in a session of its own, so that its process group can be ended; `env` marks the
            # ranks' processes (not mpirun's own), whose end the reaper watches for
            launch=(setsid mpirun -n "$RANKS" env "$PETRA_RANK_MARK") ;;
        *) petra_die "LAUNCHER must be srun or mpirun, not '$LAUNCHER'" ;;
    esac
    petra_say "job $SLURM_JOB_ID (restart ${SLURM_RESTART_COUNT:-0})" \
              "on ${SLURM_JOB_NODELIST:-$(hostname)}, ${SLURM_NTASKS:-1} ranks; log: $PETRA_LOG"
    petra_say "${launch[*]} ${trainer[*]}"
    if [[ -n $PETRA_SIGNAL ]]; then petra_requeue "nothing saved (stopped before the launch)"; fi

    # In the background, so the traps run while we wait; a trap interrupts `wait` (status > 128),
    # so wait again until the launcher has really exited. The launcher may exit while a trap runs,
    # after the interrupted `wait`: the last `wait` then reaps its real status (bash keeps it).
    PETRA_LOGGED=$(stat -c %s "$PETRA_LOG" 2>/dev/null || echo 0)  # where this launch's part starts
    PETRA_STALL_NAMED="" PETRA_STALL_AVOID=""
    "${launch[@]}" "${trainer[@]}" >>"$PETRA_LOG" 2>&1 &
    PETRA_PID=$!  # (setsid runs mpirun in this process: the shell's child is mpirun itself)
    local reaper=""
    if [[ $LAUNCHER == mpirun ]]; then petra_reap_stuck_mpirun "$PETRA_PID" & reaper=$!; fi
    while kill -0 "$PETRA_PID" 2>/dev/null; do wait "$PETRA_PID"; done
    wait "$PETRA_PID"
    status=$?
    PETRA_PID=""
    if [[ -n $reaper ]]; then kill "$reaper" 2>/dev/null; wait "$reaper" 2>/dev/null; fi
    petra_step_end
}

# MPICH names a node's shared-memory segment after the job and step ids, and a rank killed before
# MPI_Finalize leaves it behind: the first step of a requeued job (same job id, step ids from 0
# again) on that node would open it and fail in MPI_Init. Empty steps first, so that the
# trainer's step id is the restart count, one that no earlier run of this job used.
petra_skip_step_ids() {
    local n
    for ((n = 0; n < ${SLURM_RESTART_COUNT:-0}; n++)); do
        srun --ntasks=1 --nodes=1 true >/dev/null 2>&1
    done
}

# Whether SLURM took a lost node out of this job's allocation (a --no-kill job keeps running on
# the others); if so, the SLURM_* variables of the job are brought up to date for the next launch.
petra_shrunk() {
    [[ ${ELASTIC:-0} == 1 && $LAUNCHER == srun ]] || return 1
    local job nodes list per
    job=$(scontrol -o show job "$SLURM_JOB_ID") || return 1
    nodes=$(sed -n 's/.* NumNodes=\([0-9]*\).*/\1/p' <<<"$job")
    list=$(sed -n 's/.* NodeList=\([^ ]*\).*/\1/p' <<<"$job")
    [[ -n $nodes ]] && ((nodes < ${SLURM_JOB_NUM_NODES:-1})) || return 1
    per=${SLURM_NTASKS_PER_NODE:-$GPUS_PER_NODE}
    PETRA_SHRUNK=1
    petra_say "lost $((SLURM_JOB_NUM_NODES - nodes)) node(s) of $SLURM_JOB_NODELIST: going on" \
              "with $list"
    export SLURM_JOB_NUM_NODES=$nodes SLURM_NNODES=$nodes SLURM_JOB_NODELIST=$list \
           SLURM_NODELIST=$list SLURM_NTASKS=$((nodes * per)) SLURM_NPROCS=$((nodes * per)) \
           SLURM_TASKS_PER_NODE="$per(x$nodes)"
    if [[ $SLURM_JOB_CPUS_PER_NODE =~ ^([0-9]+)\(x[0-9]+\)$ ]]; then
        export SLURM_JOB_CPUS_PER_NODE="${BASH_REMATCH[1]}(x$nodes)"
    fi
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

    PETRA_SIGNAL="" PETRA_PID="" PETRA_SLURM_REQUEUED=""
    trap 'petra_forward USR1' USR1
    trap 'petra_forward TERM' TERM

    mkdir -p "$OUT_DIR/logs" || petra_die "cannot create $OUT_DIR/logs"
    PETRA_LOG="$OUT_DIR/logs/train.log"
    petra_lock
    local status trainer launch  # set by petra_launch
    if [[ $LAUNCHER == srun ]]; then petra_skip_step_ids; fi
    petra_launch
    # ELASTIC=1 (slurm/submit.sh with ELASTIC_NODES, which submits with --no-kill): a lost node
    # leaves the job running on the nodes left; launch again on the layout that fits them, and
    # the run resumes from its last complete checkpoint.
    while [[ $status != @(0|$EXIT_REQUEUE|$EXIT_CHECKPOINTED_TERM) && -z $PETRA_SIGNAL ]] &&
              petra_shrunk; do
        petra_launch
    done
    case $status in
        0) petra_say "finished: $OUT_DIR/summary.json"; exit 0 ;;
        "$EXIT_REQUEUE") petra_requeue checkpointed ;;
        "$EXIT_CHECKPOINTED_TERM")
            if [[ $PETRA_SIGNAL == *TERM* ]]; then
                petra_end_after_term checkpointed "$EXIT_CHECKPOINTED_TERM"
            fi
            petra_say "checkpointed after a SIGTERM to the ranks (scancel -s TERM, or a" \
                      "preemption's grace time), not requeueing: resubmit the same script to resume"
            exit "$EXIT_CHECKPOINTED_TERM" ;;
        "$EXIT_STALLED") petra_stalled ;;
        *)
            petra_name_stall  # a crash after a lost node: reports may name the node
            if [[ $PETRA_SIGNAL == *USR1* ]]; then
                # a SIGUSR1 that reached a rank before its handler was installed ended it
                petra_say "the run ended with status $status after SIGUSR1, before it could" \
                          "checkpoint; it resumes from its last complete checkpoint"
                petra_requeue "nothing saved"
            fi
            if [[ $PETRA_SIGNAL == *TERM* ]]; then  # srun got it too (scancel --full): it
                petra_requeue "nothing saved"        # ended the ranks at once
            fi
            if [[ -n $PETRA_CRASH ]]; then
                petra_say "a rank crashed, $PETRA_CRASH (srun's first line about a task):" \
                          "not requeueing; resubmit to resume from the last complete checkpoint"
            fi
            petra_say "failed with status $status (see $PETRA_LOG)"; exit "$status" ;;
    esac
}
