#!/usr/bin/env bash
# What a session lent the GPU machine runs there: issue 10's GPU checks and the 16-core CPU
# pipelines of issue 9, in device calls of under 10 minutes each, in priority order (a session
# has 30 minutes of device time, start-ups included: about three calls). The machine has torch
# with CUDA, h5py, yaml and pytest, but no MPI library: carry MPICH and mpi4py as wheels (.whl/
# is git-ignored). Here, once, from the repository root:
#
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#       --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux1_x86_64 \
#       -d .whl mpich==5.0.2 mpi4py==4.1.2
#
# then `run` calls with carry [".whl"] and timeout_s 600, as many as the budget allows:
#   bash scripts/device_session.sh gpu     # tests/test_gpu.py, bench overhead fp32/bf16 on the GPU
#   bash scripts/device_session.sh gpu-mps # bench pipeline on the GPU: 2 ranks sharing it, 4 ranks
#                                          # under MPS (25 % each) fp32/bf16; bench data nvJPEG
#                                          # vs what RevNet50's pipeline consumes
#   bash scripts/device_session.sh cpu-a   # bench pipeline at J = 4, 8, 10; bench replicas 2x4, 4x2
#   bash scripts/device_session.sh cpu-b   # bench peers at J = 4, 8; bench scaling
#
# Each part writes its whole log to $OUT/PART.log and the benchmarks' JSON lines to
# $OUT/PART.jsonl, and goes on past a failing step. JS, REPLICAS and BENCH_ARGS shrink the CPU
# parts for a try on a small machine: JS=2 REPLICAS=2x1 BENCH_ARGS="--width 4 --batch 4".
set -uo pipefail
part=${1:?usage: scripts/device_session.sh gpu|gpu-mps|cpu-a|cpu-b}
OUT=${OUT:-runs/device_session}
mkdir -p "$OUT"
log="$OUT/$part.log"
jsonl="$OUT/$part.jsonl"
: >"$log"
: >"$jsonl"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

# A wheel is a zip: unpacking it (not pip --target, which drops MPICH's lib/ and bin/) keeps
# mpiexec and libmpi; mpi4py is pointed at that libmpi.
if ls .whl/*.whl >/dev/null 2>&1; then
    rm -rf /tmp/wheels && mkdir -p /tmp/wheels
    for w in .whl/*.whl; do unzip -q -o "$w" -d /tmp/wheels; done
    mpich=$(ls -d /tmp/wheels/mpich-*.data/data 2>/dev/null | head -n 1)
    export PYTHONPATH="/tmp/wheels:$PYTHONPATH"
    if [ -n "$mpich" ]; then
        export PATH="$mpich/bin:$PATH" MPI4PY_LIBMPI="$mpich/lib/libmpi.so.12"
    fi
fi
PY=$(command -v python3 || command -v python)
JS=${JS:-"4 8 10"}
REPLICAS=${REPLICAS:-"2x4 4x2"}  # R x J layouts for bench replicas
read -r -a BENCH_ARGS <<<"${BENCH_ARGS:-}"

step() {  # step SECONDS NAME COMMAND...: run it, keep its output, collect its JSON line
    local seconds=$1 name=$2
    shift 2
    echo "== $name: $*" | tee -a "$log"
    local start=$SECONDS
    timeout "$seconds" "$@" >"$OUT/step.out" 2>&1
    local rc=$?
    cat "$OUT/step.out" >>"$log"
    tail -n 1 "$OUT/step.out" | grep '^{' >>"$jsonl"
    echo "   rc $rc, $((SECONDS - start)) s: $(tail -n 1 "$OUT/step.out" | cut -c1-300)" | tee -a "$log"
    rm -f "$OUT/step.out"
}

case "$part" in
gpu)
    step 20 devices nvidia-smi -L
    step 40 torch "$PY" -c "import torch, mpi4py.MPI as M; print(torch.__version__, torch.version.cuda, torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'no GPU', M.Get_library_version().splitlines()[0], [l.split()[-1] for l in open('/proc/self/maps') if 'libmpi' in l][:1])"
    step 360 test_gpu "$PY" -m pytest -q -rs tests/test_gpu.py
    for precision in fp32 bf16; do
        step 40 "overhead-$precision" "$PY" -m petra_mpi.bench overhead --device cuda --precision "$precision"
        # RevNet18 (width 64) at micro-batch 256, the whole net in one process (paper Table 5)
        step 40 "overhead-mb256-$precision" "$PY" -m petra_mpi.bench overhead --device cuda --precision "$precision" --batch 256
    done
    ;;
gpu-mps)
    # RevNet18 at the paper's width, a micro-batch that gives the GPU work
    gpu_args=(--device cuda --width 64 --batch 256 --rounds 2 --microbatches 16)
    step 140 pipeline-gpu-J2-shared mpiexec -n 2 "$PY" -m petra_mpi.bench pipeline "${gpu_args[@]}"
    # J ranks on one GPU, each held to 1/J of its SMs, emulate J smaller GPUs (MPS needs its
    # daemon; without it the ranks time-slice the whole GPU, and the log says so)
    export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps-pipe CUDA_MPS_LOG_DIRECTORY=/tmp/mps-log
    mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
    if command -v nvidia-cuda-mps-control >/dev/null && nvidia-cuda-mps-control -d; then
        echo "MPS daemon started" | tee -a "$log"
        mps=1
    else
        echo "no MPS: the 4 ranks time-slice the GPU" | tee -a "$log"
        mps=0
    fi
    for precision in fp32 bf16; do
        CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=25 step 140 "pipeline-gpu-J4-mps$mps-$precision" \
            mpiexec -n 4 "$PY" -m petra_mpi.bench pipeline "${gpu_args[@]}" --precision "$precision"
    done
    [ "$mps" = 1 ] && echo quit | nvidia-cuda-mps-control
    # the nvJPEG loader next to what RevNet50's pipeline (18 stages, ImageNet, 224) consumes
    step 150 data-gpu-jpeg "$PY" -m petra_mpi.bench data synthetic --device cuda --jpeg-demo --threads 4 --seconds 3 --pipeline revnet50
    ;;
cpu-a)
    for J in $JS; do
        step 110 "pipeline-J$J" mpiexec -n "$J" "$PY" -m petra_mpi.bench pipeline --threads 1 --rounds 2 "${BENCH_ARGS[@]}"
    done
    for layout in $REPLICAS; do
        R=${layout%x*} J=${layout#*x}
        step 120 "replicas-$layout" mpiexec -n $((R * J)) "$PY" -m petra_mpi.bench replicas --stages "$J"
    done
    ;;
cpu-b)
    for J in $JS; do
        [ "$J" -le 8 ] || continue
        step 170 "peers-J$J" mpiexec -n "$J" "$PY" -m petra_mpi.bench peers --threads 1 --rounds 2 "${BENCH_ARGS[@]}"
    done
    step 200 scaling mpiexec -n "${JS##* }" "$PY" -m petra_mpi.bench scaling --threads 1 --rounds 1 --png "$OUT/scaling.png" "${BENCH_ARGS[@]}"
    ;;
*)
    echo "unknown part $part: gpu, gpu-mps, cpu-a or cpu-b" >&2
    exit 2
    ;;
esac
echo "done: $log, $jsonl"
