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
#   ELASTIC=1   fit the layout to the ranks this job got (SLURM_NTASKS): `python -m
#               petra_mpi.elastic` gives the ranks to launch and the stage count that fits them,
#               and the trainer resumes its layout-free checkpoint on that layout
#
# Stop and requeue: SLURM sends SIGUSR1 to this batch shell 5 minutes before the time limit
# (#SBATCH --signal=B:USR1@300); `scancel --signal=USR1 --batch JOB` does the same by hand. The trap
# forwards it to the launcher, which forwards it to every rank; the ranks drain the pipeline, write
# a checkpoint and exit 3, and the job requeues itself; the requeued job resumes (run.resume=auto).
# SIGTERM to this shell (scancel, preemption, admin tooling) is forwarded as SIGUSR1 too: srun
# answers a SIGTERM by killing every rank at once, mid-checkpoint. After a SIGTERM the job does
# not requeue itself (a cancelled job stays cancelled; SLURM requeues a preempted job on its own)
# and ends with EXIT_CHECKPOINTED_TERM.
#
# Exit statuses of a job: 0 finished, or checkpointed and requeued; 2 a problem of this script
# (config not found, bad LAUNCHER...); 3 checkpointed but not requeued (MAX_REQUEUES reached, or
# scontrol requeue refused): resubmit to resume; 4 checkpointed after SIGTERM, not requeued;
# 5 a rank's watchdog ended the run (a lost node or a hang) and it was not requeued here (SLURM
# ends the job, MAX_REQUEUES, or STALL_RESTARTS stalls in a row without progress);
# anything else the trainer's failure (1 a training error, 2 a config error, >128 a signal).

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

EXIT_REQUEUE=3            # the trainer's "checkpointed, please requeue" status; also ours when
                          # a checkpointed job is not requeued (resubmit to resume)
EXIT_CHECKPOINTED_TERM=4  # checkpointed after SIGTERM (cancel, preemption): do not requeue
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
# that uses it (logs/job); a job refuses it while that other job is queued or running.
petra_lock() {
    local lock="$OUT_DIR/logs/job" holder="" state
    if [[ -f $lock ]]; then read -r holder <"$lock"; fi
    if [[ -n $holder && $holder != "$SLURM_JOB_ID" ]]; then
        state=$(petra_job_state "$holder")
        case $state in
            "" | COMPLETED | FAILED | CANCELLED | TIMEOUT | NODE_FAIL | OUT_OF_MEMORY | \
                BOOT_FAIL | DEADLINE | PREEMPTED) ;;  # ended: the directory is free
            *) petra_die "$OUT_DIR is the run directory of job $holder ($state): wait for it," \
                         "cancel it (scancel $holder), or give this job another OUT_DIR" ;;
        esac
    fi
    echo "$SLURM_JOB_ID" >"$lock.$$" && mv -f "$lock.$$" "$lock" ||
        petra_die "cannot write $lock"
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
    if [[ -n ${PETRA_PID:-} ]]; then kill -s USR1 "$PETRA_PID" 2>/dev/null; fi
}

petra_requeue() {
    local restarts=${SLURM_RESTART_COUNT:-0}
    if [[ $PETRA_SIGNAL == *TERM* ]]; then
        petra_say "checkpointed after SIGTERM (scancel or preemption): not requeueing;" \
                  "resubmit the same script to resume"
        exit "$EXIT_CHECKPOINTED_TERM"
    fi
    if ((restarts >= ${MAX_REQUEUES:-100})); then
        petra_say "checkpointed, not requeueing: restarted $restarts times (MAX_REQUEUES)"
        exit "$EXIT_REQUEUE"
    fi
    # SLURM ends this shell once the job is requeued (SIGTERM to it and its children, SIGKILL
    # after KillWait): ignored, so that scontrol can answer and the check below can run.
    trap '' TERM
    if scontrol requeue "$SLURM_JOB_ID" || petra_was_requeued; then
        petra_say "checkpointed; requeued job $SLURM_JOB_ID (it resumes from $OUT_DIR/checkpoints)"
        exit 0
    fi
    petra_say "checkpointed, but scontrol requeue failed (job cancelled?):" \
              "resubmit the same script to resume"
    exit "$EXIT_REQUEUE"
}

# A rank's watchdog ended the run. The reports name the rank each one waited on; the chain of
# waits ends at the rank that is lost or stalled, and the requeued job avoids its node. When
# SLURM itself is ending the job (a node failure: SIGTERM reached us) it requeues a --requeue job
# on its own; otherwise (a hang, a node that came back in time) requeue it ourselves, within the
# stall budget.
petra_stalled() {
    petra_say "a rank stopped making progress (exit $EXIT_STALLED, see 'watchdog' in $PETRA_LOG);" \
              "the run resumes from its last complete checkpoint"
    local avoid="" why=""
    { read -r avoid; read -r why; } < <("$PYTHON" -m petra_mpi.watchdog --diagnose "$OUT_DIR" \
                                          --log-from "$PETRA_LOGGED")
    if [[ -n $why ]]; then petra_say "watchdog reports: $why"; fi
    if [[ $PETRA_SIGNAL == *TERM* ]]; then
        petra_say "SLURM is ending this job (node failure or cancel): not requeueing it here"
        exit "$EXIT_STALLED"
    fi
    if ((${SLURM_RESTART_COUNT:-0} >= ${MAX_REQUEUES:-100})); then
        petra_say "not requeueing: restarted ${SLURM_RESTART_COUNT:-0} times (MAX_REQUEUES)"
        exit "$EXIT_STALLED"
    fi
    petra_stall_budget || exit "$EXIT_STALLED"
    # SLURM ends this shell once the job is requeued (SIGTERM, then SIGKILL after KillWait): ignore
    # the TERM, here and in scontrol, so that the exclusion, which only a pending job takes, is
    # made.
    trap '' TERM
    if scontrol requeue "$SLURM_JOB_ID"; then
        petra_say "requeued job $SLURM_JOB_ID"
        petra_exclude "$avoid"
        exit 0
    fi
    exit "$EXIT_STALLED"
}

# Whether one more requeue after a stall is within the budget: STALL_RESTARTS (default 2) restarts
# in a row that each stalled again with no newer complete checkpoint end the job (a fault that
# comes back every time would otherwise requeue it up to MAX_REQUEUES times). Counted per job in
# $OUT_DIR/logs/stalls: "job id, stalls in a row, the newest complete checkpoint".
petra_stall_budget() {
    local file="$OUT_DIR/logs/stalls" newest job="" count=0 seen=""
    newest=$(ls -d "$OUT_DIR"/checkpoints/ckpt-*/manifest.json 2>/dev/null | sort | tail -n 1)
    newest=${newest%/manifest.json}
    newest=${newest##*/}
    newest=${newest:-none}
    if [[ -f $file ]]; then read -r job count seen <"$file"; fi
    if [[ $job == "$SLURM_JOB_ID" && $seen == "$newest" ]]; then
        count=$((count + 1))
    else
        count=1
    fi
    echo "$SLURM_JOB_ID $count $newest" >"$file"
    ((count > ${STALL_RESTARTS:-2})) || return 0
    petra_say "not requeueing: $count stall(s) in a row with no newer complete checkpoint than" \
              "$newest (STALL_RESTARTS=${STALL_RESTARTS:-2}): a fault that comes back; see the" \
              "watchdog reports in $PETRA_LOG, then resubmit to resume"
    return 1
}

# Keep the requeued job off the hosts the watchdog reports blame (EXCLUDE_STALLED=0: never):
# a node whose GPU or file system hangs would stall the run again.
petra_exclude() {
    [[ -n $1 && ${EXCLUDE_STALLED:-1} == 1 ]] || return 0
    local old
    old=$(scontrol -o show job "$SLURM_JOB_ID" | sed -n 's/.* ExcNodeList=\([^ ]*\).*/\1/p')
    if [[ $old == "(null)" ]]; then old=""; fi
    if scontrol update "jobid=$SLURM_JOB_ID" "ExcNodeList=${old:+$old,}$1"; then
        petra_say "the requeued job avoids $1 (to allow it again: scontrol update" \
                  "jobid=$SLURM_JOB_ID ExcNodeList=${old})"
    fi
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
            launch=(mpirun -n "$RANKS") ;;
        *) petra_die "LAUNCHER must be srun or mpirun, not '$LAUNCHER'" ;;
    esac
    petra_say "job $SLURM_JOB_ID (restart ${SLURM_RESTART_COUNT:-0})" \
              "on ${SLURM_JOB_NODELIST:-$(hostname)}, ${SLURM_NTASKS:-1} ranks; log: $PETRA_LOG"
    petra_say "${launch[*]} ${trainer[*]}"
    if [[ -n $PETRA_SIGNAL ]]; then petra_requeue; fi   # stopped before starting: nothing to save

    # In the background, so the traps run while we wait; a trap interrupts `wait` (status > 128),
    # so wait again until the launcher has really exited. The launcher may exit while a trap runs,
    # after the interrupted `wait`: the last `wait` then reaps its real status (bash keeps it).
    PETRA_LOGGED=$(stat -c %s "$PETRA_LOG" 2>/dev/null || echo 0)  # where this launch's part starts
    "${launch[@]}" "${trainer[@]}" >>"$PETRA_LOG" 2>&1 &
    PETRA_PID=$!
    local reaper=""
    if [[ $LAUNCHER == mpirun ]]; then petra_reap_stuck_mpirun "$PETRA_PID" & reaper=$!; fi
    while kill -0 "$PETRA_PID" 2>/dev/null; do wait "$PETRA_PID"; done
    wait "$PETRA_PID"
    status=$?
    PETRA_PID=""
    if [[ -n $reaper ]]; then kill "$reaper" 2>/dev/null; wait "$reaper" 2>/dev/null; fi
    petra_step_end
}

# mpirun (Hydra) waits for every process that holds a rank's output, and one stuck in the kernel (a
# GPU or I/O hang, a data worker in D state) never ends, not even on SIGKILL: the job would run
# until its time limit. Once a watchdog has reported (the run is over), give mpirun STUCK_GRACE_S
# to end, then kill it so the script can requeue; SLURM ends what is left with the job. (srun ends
# such a step itself: --kill-on-bad-exit, slurmstepd's UnkillableStepTimeout.)
petra_reap_stuck_mpirun() {
    local pid=$1
    trap - USR1 TERM
    until tail -c +$((PETRA_LOGGED + 1)) "$PETRA_LOG" | grep -q 'petra_mpi: watchdog: '; do
        sleep 2
        kill -0 "$pid" 2>/dev/null || return 0
    done
    sleep "${STUCK_GRACE_S:-60}"
    kill -0 "$pid" 2>/dev/null || return 0
    petra_say "mpirun has not ended ${STUCK_GRACE_S:-60} s after a watchdog report (a process" \
              "that cannot exit holds it): killing it"
    kill -KILL "$pid"
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

# How the launch ended, in `status`, read from this launch's part of the log: the launcher's own
# status is that of a rank it killed after the first one ended (srun: 143 or 137; mpirun: 9).
# srun names the first rank to end: its exit code is the run's (3 a checkpointed stop, 5 a
# watchdog), and a rank ended by a signal (a segfault, an OOM kill) is a crash, not a stall:
# PETRA_CRASH holds srun's line ("n2: task 3: Segmentation fault"). mpirun names nobody: a
# watchdog's report in the log says the run stalled.
petra_step_end() {
    local first
    PETRA_CRASH=""
    first=$(tail -c +$((PETRA_LOGGED + 1)) "$PETRA_LOG" |
                grep -m1 -E '^srun: error: [^ ]+: tasks? [0-9,-]+: ')
    if [[ $first =~ :\ Exited\ with\ exit\ code\ ([0-9]+)$ ]]; then
        status=${BASH_REMATCH[1]}
    elif [[ -n $first ]]; then
        PETRA_CRASH=${first#srun: error: }
        if ((status <= 128)); then status=1; fi  # never one of the statuses that requeue
    elif [[ $status != 0 && $status != "$EXIT_REQUEUE" ]] &&
             tail -c +$((PETRA_LOGGED + 1)) "$PETRA_LOG" | grep -q 'petra_mpi: watchdog: '; then
        status=$EXIT_STALLED
    fi
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

    PETRA_SIGNAL="" PETRA_PID=""
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
    while [[ $status != 0 && $status != "$EXIT_REQUEUE" && -z $PETRA_SIGNAL ]] && petra_shrunk; do
        petra_launch
    done
    case $status in
        0) petra_say "finished: $OUT_DIR/summary.json"; exit 0 ;;
        "$EXIT_REQUEUE") petra_requeue ;;
        "$EXIT_STALLED") petra_stalled ;;
        *)
            if [[ $PETRA_SIGNAL == *USR1* ]]; then
                # a SIGUSR1 that reached a rank before its handler was installed ended it
                petra_say "the run ended with status $status after SIGUSR1, before it could" \
                          "checkpoint; it resumes from its last complete checkpoint"
                petra_requeue
            fi
            if [[ -n $PETRA_CRASH ]]; then
                petra_say "a rank crashed, $PETRA_CRASH (srun's first line about a task):" \
                          "not requeueing; resubmit to resume from the last complete checkpoint"
            fi
            petra_say "failed with status $status (see $PETRA_LOG)"; exit "$status" ;;
    esac
}
