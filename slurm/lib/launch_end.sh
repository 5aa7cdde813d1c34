# How a launch of the trainer ended and what follows, for slurm/common.sh, which sources it
# (never run alone): the status read from the launch's part of the log (petra_step_end), a stall
# (requeued within a budget, kept off the hosts the watchdog reports blame) and the reaper of an
# mpirun that cannot end.

# How the launch ended, in `status`, read from this launch's part of the log: the launcher's own
# status is that of a rank it killed after the first one ended (srun: 143 or 137; mpirun: 9).
# The trainer's final line (a finished run, a checkpointed stop) says how the run ended, though a
# process that could not exit afterwards had to be killed. Else srun names the first rank to end:
# its exit code is the run's (3 a checkpointed stop for a requeue, 4 one on SIGTERM, 5 a watchdog), and a rank ended by a signal
# (a segfault, an OOM kill) before any watchdog reported is a crash, not a stall: PETRA_CRASH
# holds srun's line ("n2: task 3: Segmentation fault"); one the start-up watcher had to SIGKILL
# after its report is a stall. mpirun names nobody: a watchdog's report says the run stalled.
PETRA_TASK_END='^srun: error: [^ ]+: tasks? [0-9,-]+: '  # srun's line for a task that ended
petra_step_end() {
    local final first srun
    PETRA_CRASH=""
    final=$(petra_log_from "$PETRA_LOGGED" | grep -m1 -E "$PETRA_FINAL_LINE")
    srun=$(petra_log_from "$PETRA_LOGGED" | grep -m1 -E "$PETRA_TASK_END")
    first=$(petra_log_from "$PETRA_LOGGED" | grep -m1 -E "$PETRA_TASK_END|$PETRA_REPORT")
    if [[ $final =~ exit\ status\ ([0-9]+) ]]; then
        status=${BASH_REMATCH[1]}
    elif [[ -n $final ]]; then
        status=0
    elif [[ $srun =~ :\ Exited\ with\ exit\ code\ ([0-9]+)$ ]]; then
        status=${BASH_REMATCH[1]}
    elif [[ -n $srun && $first == "$srun" ]]; then
        PETRA_CRASH=${srun#srun: error: }
        if ((status <= 128)); then status=1; fi  # never one of the statuses that requeue
    elif [[ -n $first && $status != @(0|$EXIT_REQUEUE|$EXIT_CHECKPOINTED_TERM) ]]; then
        status=$EXIT_STALLED
    fi
}

# mpirun (Hydra) waits for every process that holds a rank's output, and one stuck in the kernel (a
# GPU or I/O hang, a data worker in D state) never ends, not even on SIGKILL: the job would run
# until its time limit. Once the run is over (a watchdog reported, the trainer printed its final
# line, or a rank's process ended: the end of a run, a crash, an OOM kill), give mpirun
# STUCK_GRACE_S to end, then kill it, its process group and every process under it (Hydra starts
# its proxies and ranks in sessions of their own), so the script can go on; SLURM ends what is
# left with the job. (srun ends such a step itself: --kill-on-bad-exit, UnkillableStepTimeout.)
PETRA_RANK_MARK=PETRA_RANK_OF_MPIRUN=1  # in the environment of the ranks' processes alone
PETRA_REPORT='petra_mpi: watchdog: '
PETRA_FINAL_LINE='^(done in [0-9:]+: val acc|stopped on request)'
petra_reap_stuck_mpirun() {
    local pid=$1 read_to=$PETRA_LOGGED size from added seen=" " now over="" p
    trap - USR1 TERM
    while [[ -z $over ]]; do
        sleep 2
        kill -0 "$pid" 2>/dev/null || return 0
        # what the log gained since the last look (and 64 bytes before: a line split there)
        size=$(stat -c %s "$PETRA_LOG")
        from=$((read_to > PETRA_LOGGED + 64 ? read_to - 64 : PETRA_LOGGED))
        added=$(petra_log_from "$from" | head -c $((size - from)))
        read_to=$size
        if grep -q "$PETRA_REPORT" <<<"$added"; then
            over="a watchdog report"
        elif grep -q -E "$PETRA_FINAL_LINE" <<<"$added"; then
            over="the trainer's final line"
        fi
        now=" $(petra_rank_pids "$pid" | tr '\n' ' ')"
        for p in $seen; do
            if [[ -z $over && $now != *" $p "* ]]; then over="a rank's process ended"; fi
        done
        for p in $now; do
            if [[ $seen != *" $p "* ]]; then seen+="$p "; fi
        done
    done
    sleep "${STUCK_GRACE_S:-60}"
    kill -0 "$pid" 2>/dev/null || return 0
    petra_say "mpirun has not ended ${STUCK_GRACE_S:-60} s after $over (a process that cannot" \
              "exit holds it): killing it and every process under it"
    petra_end_tree "$pid"
}

# The part of the log from byte $1 on.
petra_log_from() { tail -c +$(($1 + 1)) "$PETRA_LOG"; }

# Every process under $1, "pid ppid" a line, its children before theirs.
petra_tree() {
    ps -e -o pid=,ppid= | awk -v root="$1" '
        { kids[$2] = kids[$2] " " $1 }
        END { todo[n = 1] = root
              while (n) { p = todo[n--]; k = split(kids[p], c, " ")
                          for (i = 1; i <= k; i++) { print c[i], p; todo[++n] = c[i] } } }'
}

# The ranks' processes under $1: marked (PETRA_RANK_MARK), their parent not (a rank's own
# processes inherit the mark). A rank that has exited (a zombie too) is not among them.
petra_rank_pids() {
    local pid ppid
    while read -r pid ppid; do
        if petra_marked "$pid" && ! petra_marked "$ppid"; then echo "$pid"; fi
    done < <(petra_tree "$1")
}

petra_marked() { tr '\0' '\n' <"/proc/$1/environ" 2>/dev/null | grep -q -x "$PETRA_RANK_MARK"; }

# SIGKILL to the process group of $1 (a session leader) and to every process under it, listed
# first: a pid is only signalled while its process is known to be there.
petra_end_tree() {
    local pids
    pids=$(petra_tree "$1" | cut -d ' ' -f 1)
    kill -KILL -- "-$1" 2>/dev/null
    if [[ -n $pids ]]; then kill -KILL $pids 2>/dev/null; fi
}

# A rank's watchdog ended the run. The reports name the rank each one waited on; the chain of
# waits ends at the rank that is lost or stalled, and the requeued job avoids its node. When
# SLURM itself is ending the job (SIGTERM reached us) it requeues a --requeue job on its own after
# a node failure, and a cancelled one stays cancelled; otherwise (a hang, a node that came back
# in time) requeue it ourselves, within the stall budget.
petra_stalled() {
    petra_say "a rank stopped making progress (exit $EXIT_STALLED, see 'watchdog' in $PETRA_LOG);" \
              "the run resumes from its last complete checkpoint"
    petra_name_stall
    local avoid=$PETRA_STALL_AVOID
    if [[ $PETRA_SIGNAL == *TERM* ]]; then petra_end_after_term "stalled" "$EXIT_STALLED"; fi
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

# Name the rank the chain of the watchdog reports ends at ("watchdog reports: ..."), once per
# launch; its node in PETRA_STALL_AVOID. Also called from the SIGTERM trap while the launcher still
# runs: a node failure ends the job with SIGTERM and SIGKILL KillWait later, and srun, waiting on
# the lost node's tasks, may outlive that, so the line is written as soon as the SIGTERM comes.
# That SIGTERM reaches every process of the job: the commands here ignore it (a diagnosis killed
# by it would name nobody).
petra_name_stall() {
    [[ -z $PETRA_STALL_NAMED ]] || return 0
    (trap '' TERM; petra_log_from "$PETRA_LOGGED" | grep -q "$PETRA_REPORT") || return 0
    PETRA_STALL_NAMED=1
    local diagnosis why=""
    diagnosis=$(trap '' TERM
                "$PYTHON" -m petra_mpi.watchdog --diagnose "$OUT_DIR" --log-from "$PETRA_LOGGED")
    { read -r PETRA_STALL_AVOID; read -r why; } <<<"$diagnosis"
    if [[ -n $why ]]; then petra_say "watchdog reports: $why"; fi
}

# Whether one more requeue after a stall is within the budget: STALL_RESTARTS (default 2) restarts
# in a row that each stalled again with no newer complete checkpoint end the job (a fault that
# comes back every time would otherwise requeue it up to MAX_REQUEUES times). Counted per job in
# $OUT_DIR/logs/stalls: "job id, stalls in a row, the newest complete checkpoint".
petra_stall_budget() {
    local file="$OUT_DIR/logs/stalls" newest job="" count=0 seen=""
    # (a checkpoint the trainer set aside as unreadable, ckpt-...corrupt, is none)
    newest=$(ls -d "$OUT_DIR"/checkpoints/ckpt-*/manifest.json 2>/dev/null |
                 grep -E '/ckpt-e[0-9]+-b[0-9]+/manifest\.json$' | sort | tail -n 1)
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
# a node whose GPU or file system hangs would stall the run again. At most EXCLUDE_MAX (2) of
# them at once, the newest blamed (a list that grew with every stall could leave too few nodes
# for the job); those given at submission stay. This job's, oldest first: logs/excluded.
petra_exclude() {
    [[ -n $1 && ${EXCLUDE_STALLED:-1} == 1 ]] || return 0
    local file="$OUT_DIR/logs/excluded" max=${EXCLUDE_MAX:-2} old ours keep drop list again=""
    old=$(scontrol -o show job "$SLURM_JOB_ID" | sed -n 's/.* ExcNodeList=\([^ ]*\).*/\1/p')
    if [[ $old == "(null)" ]]; then old=""; fi
    ours=$( { sed -n "s/^$SLURM_JOB_ID //p" "$file" 2>/dev/null; tr ',' '\n' <<<"$1"; } |
           tac | awk 'NF && !seen[$0]++' | tac)  # each host once, at its newest place
    keep=$(tail -n "$max" <<<"$ours")
    drop=$(head -n "-$max" <<<"$ours")
    list=$( { if [[ -n $old ]]; then scontrol show hostnames "$old"; fi; echo "$keep"; } |
           awk -v drop="$drop" 'BEGIN { n = split(drop, d, "\n"); while (n) out[d[n--]] = 1 }
                                NF && !out[$0] && !seen[$0]++' | paste -sd , -)
    if scontrol update "jobid=$SLURM_JOB_ID" "ExcNodeList=$list"; then
        { grep -v "^$SLURM_JOB_ID " "$file" 2>/dev/null; sed "s/^/$SLURM_JOB_ID /" <<<"$keep"; } \
            >"$file.tmp" && mv -f "$file.tmp" "$file"
        if [[ -n $drop ]]; then again=" (allowed again: ${drop//$'\n'/,}; EXCLUDE_MAX=$max)"; fi
        petra_say "the requeued job avoids $list$again (to allow them: scontrol update" \
                  "jobid=$SLURM_JOB_ID ExcNodeList=$old)"
    fi
}
