"""Where this process runs: its stage and replica in the world, its device, storage dtype and
CPU threads (and the JPEG decode workers that share them). Set up first, before the data and
the stages; rank 0 says what is in force and where each rank runs."""
import dataclasses
import sys

import torch

from ..comm.compress import Compression
from ..comm.world import busy_cpus, cpu_affinity, cpu_share, oversubscribed
from ..config import num_replicas, num_stages
from ..models import NetSpec
from .errors import TrainingError


def pick_device(cfg, local_rank: int = 0) -> torch.device:
    """The device of this process: the GPU devices.gpu_index picks from the launcher's
    environment (the one devices.bind_early bound before MPI started), else by `local_rank`."""
    if cfg.run.device == "cpu" or (cfg.run.device == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise TrainingError("run.device is cuda but CUDA is not available")
    from ..comm.devices import bound_cuda_device
    return bound_cuda_device(local_rank)


def cpu_threads(cfg, world, busy: float = 0.0) -> int:
    """CPU threads this process may keep busy: run.threads, else its share of the CPUs it may
    use that other programs leave free (`busy`: how many they keep busy; comm.world.cpu_share):
    under MPI its CPU set divided among the node's ranks that share it, in one process the whole
    set (at most torch's default)."""
    if cfg.run.threads:
        return cfg.run.threads
    if world:
        return world.thread_share(busy)
    mine = cpu_affinity()
    return max(1, min(torch.get_num_threads(), cpu_share(mine, [mine], busy)))


def decode_threads(cfg, share: int, loaders: int = 1) -> int:
    """JPEG decode workers of each data loader: data.decode_workers, else the process's CPU share
    (what its torch threads get) divided among the training loaders it runs at once (R in one
    process, one per stage-0 rank under MPI). Not the affinity set: R stage-0 ranks sharing a
    node's CPUs would each start one thread per CPU."""
    return cfg.data.decode_workers or max(1, share // loaders)


@dataclasses.dataclass
class Placement:
    """Where this process sits in the run: J stages of R replicas, its stage and replica, its
    device, storage dtype and CPU threads."""
    J: int
    R: int
    rank: int
    stage: int
    replica: int
    device: torch.device
    dtype: torch.dtype
    threads: int


def find_placement(cfg, world) -> Placement:
    """Split the world into R replicas of J stages, bind the device and set the CPU threads."""
    size = world.size if world else 1
    # a network of one's own has the blocks its function returned (built already by the
    # check at the start)
    J = num_stages(cfg, size, NetSpec.of_config(cfg).num_blocks)
    R = num_replicas(cfg, size)
    if world:
        world.split(J)  # rank = replica · J + stage
    device = pick_device(cfg, world.local_rank if world else 0)
    table = None
    if world:
        from ..comm.devices import rank_map
        table = rank_map(world, device)
    # Measured by every rank at once, just after the rank map's collective (see busy_cpus).
    mine, sets = cpu_affinity(), (world.node_sets() if world else [cpu_affinity()])
    busy = busy_cpus(mine)
    threads = cpu_threads(cfg, world, busy)
    torch.set_num_threads(threads)
    if table:  # rank 0: what is in force first, then where each rank runs
        print(f"petra_mpi: {world.size} ranks, {threads} torch thread(s) per rank, "
              f"{Compression.from_config(cfg.comm, cfg.run.seed).describe()}",
              file=sys.stderr, flush=True)
    if not world or world.rank == 0:
        warning = oversubscribed(mine, sets, threads, busy)
        if warning:
            print(warning, file=sys.stderr, flush=True)
    if table:
        print(table, file=sys.stderr, flush=True)
    return Placement(J, R, world.rank if world else 0, world.stage if world else 0,
                     world.replica if world else 0, device, getattr(torch, cfg.run.dtype),
                     threads)
