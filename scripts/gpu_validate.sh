#!/usr/bin/env bash
# Checks petra_mpi's GPU paths on a GPU node and records what they measure.
#
# None of these checks has run on a GPU yet: the CUDA code (device binding, CUDA-aware and
# staged transport, nvJPEG decode, bf16 and channels-last on the device) is tested on CPU only
# where a CPU can stand in. Expect this script to be the first to exercise it. It goes on past a
# failing step, so one run shows every problem, lists the failed steps at the end and then exits
# with status 1.
#
# On the node, from the repository root, with torch (a CUDA build), the site's MPI, mpi4py built
# against it and petra_mpi installed (README, "Train on your cluster"):
#
#   bash scripts/gpu_validate.sh            # all three GPU parts below, in this order
#   bash scripts/gpu_validate.sh gpu        # the GPU tests, bench overhead in fp32 and bf16 at
#                                           # micro-batch 64 and 256, the quick start over NCCL
#                                           # (comm.transport torch, torchrun; 2 GPUs or more)
#   bash scripts/gpu_validate.sh pipeline   # bench pipeline: 2 ranks sharing the GPU, then 4 ranks
#                                           # under MPS (a quarter of the SMs each), fp32 and bf16
#   bash scripts/gpu_validate.sh data       # the nvJPEG loader against what RevNet50's 18-stage
#                                           # pipeline consumes
#   bash scripts/gpu_validate.sh cpu        # on the node's cores: bench pipeline at J = 4, 8, 10,
#                                           # replicas 2x4 and 4x2, peers at the same J, and the
#                                           # performance model validated up to J = 10 (needs 10
#                                           # or more cores)
#
# Each part writes its whole log to $OUT/PART.log and the benchmarks' JSON lines (one per step)
# to $OUT/PART.jsonl; OUT defaults to runs/gpu_validate. Settings from the environment:
#   MPIRUN        the MPI launcher (default mpirun), called as $MPIRUN -n N ...
#   STEP_TIMEOUT  seconds before a step is killed as hung (default 900)
#   JS, REPLICAS  the stage counts and R x J layouts of the cpu part (default "4 8 10", "2x4 4x2")
set -uo pipefail
part=${1:-all}
OUT=${OUT:-runs/gpu_validate}
MPIRUN=${MPIRUN:-mpirun}
STEP_TIMEOUT=${STEP_TIMEOUT:-900}
JS=${JS:-"4 8 10"}
REPLICAS=${REPLICAS:-"2x4 4x2"}
PY=$(command -v python3 || command -v python)
export PYTHONUNBUFFERED=1
mkdir -p "$OUT"
failed=()

step() {  # step NAME COMMAND...: run it under the timeout, keep its output, collect its JSON line
    local name=$1
    shift
    echo "== $name: $*" | tee -a "$log"
    local start=$SECONDS
    timeout "$STEP_TIMEOUT" "$@" >"$OUT/step.out" 2>&1
    local rc=$?
    cat "$OUT/step.out" >>"$log"
    # every bench prints its figures as one JSON object on its last line
    tail -n 1 "$OUT/step.out" | grep '^{' >>"$jsonl"
    echo "   exit $rc, $((SECONDS - start)) s: $(tail -n 1 "$OUT/step.out" | cut -c1-300)" | tee -a "$log"
    rm -f "$OUT/step.out"
    if [ "$rc" != 0 ]; then failed+=("$name (exit $rc)"); fi
}

run_gpu() {
    step devices nvidia-smi -L
    step versions "$PY" -c "import torch, mpi4py.MPI as M; print('torch', torch.__version__, 'CUDA', torch.version.cuda, torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'no GPU visible'); print(M.Get_library_version().splitlines()[0])"
    # -m "": the GPU tests are outside the default selection (marked extended)
    step gpu-tests "$PY" -m pytest -q -rs -m "" tests/e2e/test_gpu.py
    for precision in fp32 bf16; do
        step "overhead-$precision" "$PY" -m petra_mpi.bench overhead --device cuda --precision "$precision"
        # micro-batch 256, the paper's Table 5 setting: the tick is RevNet18's time per micro-batch
        step "overhead-mb256-$precision" "$PY" -m petra_mpi.bench overhead --device cuda --precision "$precision" --batch 256
    done
    # the torch.distributed transport over NCCL: one GPU per rank (NCCL refuses two ranks on one)
    if [ "$("$PY" -c 'import torch; print(torch.cuda.device_count())')" -ge 2 ]; then
        step nccl-train "$PY" -m torch.distributed.run --standalone --nproc-per-node 2 -m petra_mpi.train configs/quickstart.yaml --set comm.transport=torch --set run.device=cuda --set model.stages=2 --set train.epochs=1 --set run.out_dir="$OUT/nccl"
    else
        echo "one GPU: the NCCL steps need two (NCCL refuses two ranks on one GPU)" | tee -a "$log"
    fi
}

run_pipeline() {
    # RevNet18 at the paper's width, with a micro-batch that gives the GPU work
    local args=(--device cuda --width 64 --batch 256 --rounds 2 --microbatches 16)
    step pipeline-J2-shared "$MPIRUN" -n 2 "$PY" -m petra_mpi.bench pipeline "${args[@]}"
    # J ranks on one GPU, each held to 1/J of its SMs, stand in for J smaller GPUs. MPS needs its
    # control daemon; without it the ranks time-slice the whole GPU, and the log says so.
    export CUDA_MPS_PIPE_DIRECTORY=${CUDA_MPS_PIPE_DIRECTORY:-/tmp/mps-pipe-$(id -un)}
    export CUDA_MPS_LOG_DIRECTORY=${CUDA_MPS_LOG_DIRECTORY:-/tmp/mps-log-$(id -un)}
    mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
    local mps=0
    if command -v nvidia-cuda-mps-control >/dev/null && nvidia-cuda-mps-control -d; then
        echo "MPS daemon started" | tee -a "$log"
        mps=1
    else
        echo "no MPS: the 4 ranks time-slice the GPU" | tee -a "$log"
    fi
    for precision in fp32 bf16; do
        CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=25 step "pipeline-J4-mps$mps-$precision" \
            "$MPIRUN" -n 4 "$PY" -m petra_mpi.bench pipeline "${args[@]}" --precision "$precision"
    done
    if [ "$mps" = 1 ]; then echo quit | nvidia-cuda-mps-control; fi
}

run_data() {
    # JPEGs decoded by nvJPEG and cropped to 224 on the GPU, next to what RevNet50 consumes
    step data-jpeg "$PY" -m petra_mpi.bench data synthetic --device cuda --jpeg-demo --threads 4 --seconds 3 --pipeline revnet50
}

run_cpu() {
    for J in $JS; do
        step "pipeline-cpu-J$J" "$MPIRUN" -n "$J" "$PY" -m petra_mpi.bench pipeline --threads 1 --rounds 2
    done
    for layout in $REPLICAS; do
        local R=${layout%x*} J=${layout#*x}
        step "replicas-cpu-$layout" "$MPIRUN" -n $((R * J)) "$PY" -m petra_mpi.bench replicas --stages "$J"
    done
    for J in $JS; do
        step "peers-cpu-J$J" "$MPIRUN" -n "$J" "$PY" -m petra_mpi.bench peers --threads 1 --rounds 2
    done
    step scaling-cpu "$MPIRUN" -n "${JS##* }" "$PY" -m petra_mpi.bench scaling --threads 1 --rounds 1 --png "$OUT/scaling.png"
}

case "$part" in
all) parts="gpu pipeline data" ;;
gpu | pipeline | data | cpu) parts=$part ;;
*)
    echo "usage: scripts/gpu_validate.sh [all|gpu|pipeline|data|cpu]" >&2
    exit 2
    ;;
esac
for p in $parts; do
    log="$OUT/$p.log"
    jsonl="$OUT/$p.jsonl"
    : >"$log"
    : >"$jsonl"
    "run_$p"
    echo "$p done: $log, $jsonl"
done
if [ ${#failed[@]} -gt 0 ]; then
    printf 'failed: %s\n' "${failed[@]}"
    exit 1
fi
echo "every step passed"
