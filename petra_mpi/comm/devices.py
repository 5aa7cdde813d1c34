"""Which GPU a rank uses, decided from the launcher's environment BEFORE MPI starts.

CUDA-aware MPI libraries (UCX, MVAPICH2, Cray MPICH) pick the GPU their communication buffers and
IPC handles live on when MPI_Init runs, so each rank binds its GPU first: `bind_early` runs in
train.main before World.from_environment starts the transport. The binding rule is a pure
function of the environment and of how many GPUs this process sees (`gpu_index`), so it is
unit-tested without CUDA; pick_device in run/trainer.py applies the same rule, so the two always agree.

Rule (first that applies):
- no visible GPU: no binding (the run uses the CPU, or fails if run.device is cuda);
- one visible GPU: index 0 (srun --gpus-per-task=1, or a per-task CUDA_VISIBLE_DEVICES);
- srun --gpus-per-task=G and exactly G GPUs visible: SLURM bound this task's own GPUs: index 0;
- else the node-local rank modulo the visible count (mpirun on a node whose ranks share every GPU).
The node-local rank comes from the launcher (`LOCAL_RANK_VARS`, first found wins); when none is
set, MPI's own node-local rank (World.local_rank) is used once MPI is up.
"""
import os
import socket

# Launcher-specific variables first: under `mpirun` inside an sbatch script SLURM_LOCALID is the
# batch step's (0 for every rank), while the MPI launcher's variable is this rank's.
LOCAL_RANK_VARS = (
    "OMPI_COMM_WORLD_LOCAL_RANK",   # Open MPI (mpirun / prterun)
    "MV2_COMM_WORLD_LOCAL_RANK",    # MVAPICH2
    "MPI_LOCALRANKID",              # MPICH Hydra, Intel MPI
    "PMI_LOCAL_RANK",               # PMI-2 launchers (Cray PALS sets it too)
    "PALS_LOCAL_RANKID",            # Cray PALS
    "PMIX_LOCAL_RANK",              # PMIx launchers that export it
    "LOCAL_RANK",                   # torchrun (which an sbatch script may start: before SLURM's)
    "SLURM_LOCALID",                # srun
)


def launcher_local_rank(env=None):
    """(node-local rank, variable it came from) from the launcher's environment, or None."""
    env = os.environ if env is None else env
    for var in LOCAL_RANK_VARS:
        value = env.get(var, "").strip()
        if value.isdigit():
            return int(value), var
    return None


def gpu_index(env, visible: int, local_rank=None):
    """The CUDA device index this rank should use among the `visible` ones (CUDA_VISIBLE_DEVICES
    already applied), or None when there is none. `local_rank` is the fallback node-local rank
    (MPI's) when the launcher exports none; without either, None when several GPUs are visible
    (the choice waits for MPI's node-local rank)."""
    if visible < 1:
        return None
    if visible == 1:
        return 0
    per_task = env.get("SLURM_GPUS_PER_TASK", "").strip()
    step = env.get("SLURM_STEP_ID", "").strip()  # batch/extern steps have ids near 2**32
    in_srun_step = step.isdigit() and int(step) < 0xFFFFFFF0
    if per_task.isdigit() and int(per_task) == visible and in_srun_step:
        return 0  # srun gave this task its own GPUs
    found = launcher_local_rank(env)
    local = found[0] if found else local_rank
    return None if local is None else local % visible


def bind_early(device_setting: str, env=None):
    """Bind this process to its GPU, and to its network card when PETRA_NET_DEVICES lists them,
    before MPI is initialised (device_setting: run.device). Returns the bound GPU index, or None
    (CPU run, no CUDA, or no launcher local rank yet)."""
    env = os.environ if env is None else env
    index = None
    if device_setting != "cpu":
        import torch
        if torch.cuda.is_available():
            index = gpu_index(env, torch.cuda.device_count())
            if index is not None:
                torch.cuda.set_device(index)
    found = launcher_local_rank(env)
    pin_net_device(env, index if index is not None else (found[0] if found else None))
    return index


def pin_net_device(env, index):
    """UCX_NET_DEVICES for the rank on GPU `index` (its node-local rank without one): entry
    `index` of PETRA_NET_DEVICES, one InfiniBand card per GPU of a node in GPU order, each the
    card nearest that GPU (`nvidia-smi topo -m`; a card two GPUs share is listed twice), e.g.
    "mlx5_0:1,mlx5_1:1,mlx5_2:1,mlx5_3:1". One UCX_NET_DEVICES for the whole job would put every
    rank of a node on one card. UCX reads it when MPI starts. Returns the card, or None (nothing
    listed, or no index)."""
    cards = [c.strip() for c in env.get("PETRA_NET_DEVICES", "").split(",") if c.strip()]
    if not cards or index is None:
        return None
    env["UCX_NET_DEVICES"] = cards[index % len(cards)]
    return env["UCX_NET_DEVICES"]


def bound_cuda_device(local_rank):
    """This rank's GPU by gpu_index (the one bind_early bound, when it could choose), made the
    current device; `local_rank`: MPI's node-local rank, for launchers that export none."""
    import torch
    index = gpu_index(os.environ, torch.cuda.device_count(), local_rank)
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def rank_map(world, device) -> str | None:
    """Gather (host, local rank, device, CUDA_VISIBLE_DEVICES, affinity) of every rank; rank 0
    returns one line per rank, with the stage and replica it runs (None elsewhere). Every rank's
    world keeps the placement (World.map_ranks)."""
    import torch
    name = str(device)
    if device.type == "cuda":
        try:
            name += f" ({torch.cuda.get_device_name(device)})"
        except Exception:  # noqa: BLE001 - a name is cosmetic
            pass
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:
        cpus = os.cpu_count() or 1
    found = launcher_local_rank()
    mine = (socket.gethostname(), world.local_rank, name,
            os.environ.get("CUDA_VISIBLE_DEVICES", "-"), cpus, found[1] if found else "MPI")
    rows = world.map_ranks(mine)
    if world.rank != 0:
        return None
    lines = [f"petra_mpi: rank map ({len(rows)} ranks)"]
    for r, (host, local, dev, visible, ncpu, source) in enumerate(rows):
        where = world.placement[r]
        replica = f" replica {where['replica']}" if world.replicas > 1 else ""
        lines.append(f"  rank {r:>3d}  host {host}  stage {where['stage']}{replica}  local {local} "
                     f"(from {source})  device {dev}  CUDA_VISIBLE_DEVICES={visible}  cpus {ncpu}")
    return "\n".join(lines)


def synchronize(device):
    """Wait for the work queued on `device` (a GPU runs kernels asynchronously, so a host clock
    read after a call would time the launch, not the work); nothing to wait for on the CPU."""
    import torch
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def to_device(module, device, dtype):
    """`module` on `device` in `dtype`, channels-last on CUDA (cuDNN then runs the convolutions
    NHWC, what tensor cores prefer). On CPU the layout stays NCHW: one thread of this project's
    CPUs ran RevNet18's 32x32 backward slower channels-last. The block-cost timing places its
    copies the same way as the stages, so the balance is measured in the layout that runs."""
    import torch
    module = module.to(device=device, dtype=dtype)
    if torch.device(device).type == "cuda":
        module = module.to(memory_format=torch.channels_last)
    return module
