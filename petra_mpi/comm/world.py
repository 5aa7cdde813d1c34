"""The MPI context of a run: ranks, node-local binding, start-up agreement and fault handling.

mpi4py is imported only when the process was started by an MPI launcher, so single-process runs
need no MPI library at all.
"""
import os
import sys
import time
import traceback

# Seconds a failing rank waits between printing why and MPI_Abort (see World._abort).
ABORT_GRACE_S = 1.0
_LAUNCHER_VARS = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK", "MPI_LOCALNRANKS",
                  "MV2_COMM_WORLD_SIZE", "PETRA_MPI")


class LaunchError(RuntimeError):
    pass


def _srun_step_tasks() -> int:
    """Tasks of the srun job step this process belongs to (1 outside srun; SLURM's batch,
    extern and interactive steps have ids near 2**32)."""
    step = os.environ.get("SLURM_STEP_ID", "")
    if not step.isdigit() or int(step) >= 0xFFFFFFF0:
        return 1
    try:
        return int(os.environ.get("SLURM_STEP_NUM_TASKS", "1"))
    except ValueError:
        return 1


def launcher_rank_and_size(env=None):
    """(rank, world size) from the launcher's environment, read before MPI starts (and before
    torch loads), so a config that does not fit the world size fails at once on every rank;
    None when no known launcher started this process."""
    env = os.environ if env is None else env
    for rank_var, size_var in (("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"),  # Open MPI
                               ("PMI_RANK", "PMI_SIZE"),  # MPICH Hydra, Intel MPI, PMI-1/2
                               ("MV2_COMM_WORLD_RANK", "MV2_COMM_WORLD_SIZE")):  # MVAPICH2
        rank, size = env.get(rank_var, "").strip(), env.get(size_var, "").strip()
        if rank.isdigit() and size.isdigit():
            return int(rank), int(size)
    step = env.get("SLURM_STEP_ID", "")
    rank, size = env.get("SLURM_PROCID", ""), env.get("SLURM_STEP_NUM_TASKS", "")
    if step.isdigit() and int(step) < 0xFFFFFFF0 and rank.isdigit() and size.isdigit():
        return int(rank), int(size)  # an srun step (not the batch step a script's mpirun is in)
    return None


def cpu_affinity() -> set:
    """The CPUs this process may run on (all of them where the OS cannot say)."""
    try:
        return set(os.sched_getaffinity(0))
    except AttributeError:
        return set(range(os.cpu_count() or 1))


def _cpu_times(cpus) -> dict:
    """cpu -> (busy, total) jiffies since boot, from /proc/stat (empty where unreadable)."""
    times = {}
    try:
        with open("/proc/stat") as f:
            for line in f:
                name, *fields = line.split()
                if name.startswith("cpu") and name[3:].isdigit() and int(name[3:]) in cpus:
                    ticks = [int(v) for v in fields[:8]]
                    idle = ticks[3] + ticks[4]  # idle and iowait
                    times[int(name[3:])] = (sum(ticks) - idle, sum(ticks))
    except (OSError, ValueError, IndexError):
        return {}
    return times


def busy_cpus(cpus, seconds: float = 0.2) -> float:
    """How many of the CPUs `cpus` other programs keep busy: their busy share over `seconds`
    while this process sleeps (0.0 where /proc/stat is unreadable). Called by every rank at once
    right after a collective, so the run's own ranks sleep through the window too."""
    cpus = set(cpus)
    before = _cpu_times(cpus)
    time.sleep(seconds)
    after = _cpu_times(cpus)
    busy = 0.0
    for cpu, (b0, t0) in before.items():
        b1, t1 = after.get(cpu, (b0, t0))
        busy += (b1 - b0) / (t1 - t0) if t1 > t0 else 0.0
    return busy


def _sharers(mine, node_sets) -> int:
    return sum(1 for other in node_sets if set(mine) & set(other)) or 1


def cpu_share(mine, node_sets, busy: float = 0.0) -> int:
    """Threads for a rank whose CPU set is `mine`, among the CPU sets of every rank of its node:
    the CPUs of the set that other programs leave free (`busy`: how many they keep busy, see
    busy_cpus) divided by the ranks that overlap it. srun --cpus-per-task or mpirun --bind-to
    gives each rank its own set (disjoint: the whole set is this rank's); an unbound mpirun gives
    every rank the same set (shared: divided by the local ranks). Never more threads than free
    CPUs: torch's threads spin while they wait for each other, and one of them sharing a core
    with another busy program stalls every operation (tens of times slower, not twice)."""
    free = len(set(mine)) - min(len(set(mine)), round(busy))
    return max(1, free // _sharers(mine, node_sets))


def oversubscribed(mine, node_sets, threads: int, busy: float) -> str | None:
    """A warning when other programs keep CPUs of this rank's set busy and, beside them, the
    run's threads (`threads` per rank on the set) outnumber its CPUs; None otherwise."""
    cpus, others = len(set(mine)), round(busy)
    wanted = threads * _sharers(mine, node_sets)
    if others < 1 or others + wanted <= cpus:
        return None
    return (f"petra_mpi: warning: other programs keep {busy:.1f} of the {cpus} CPU(s) this run "
            f"may use busy, and its {wanted} torch thread(s) do not fit beside them: every step "
            f"will be slower (run.threads sets the threads per rank; docs/running.md)")


class World:
    def __init__(self, comm):
        from mpi4py import MPI
        self.comm = comm
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        node = comm.Split_type(MPI.COMM_TYPE_SHARED)
        self.local_rank, self.local_size = node.Get_rank(), node.Get_size()
        self.node_cpus = node.allgather(sorted(cpu_affinity()))  # CPU sets of this node's ranks
        node.Free()
        self.placement = None  # rank -> host, stage and replica, once map_ranks ran
        self.split(self.size)  # one pipeline over every rank until the trainer says otherwise

    def split(self, stages: int):
        """Lay the ranks out as R = size / stages replicas of a `stages`-rank pipeline, rank =
        replica · J + stage (so under SLURM's block distribution a replica's consecutive stages
        share a node). `pipe` is this replica's pipeline (its ranks are the stage indices), `dp`
        the stage's data-parallel group (one rank per replica, in replica order; None for R = 1).
        `comm` stays the whole world: stop votes and checkpoints involve every rank."""
        assert self.size % stages == 0, (self.size, stages)
        self.stages, self.replicas = stages, self.size // stages
        self.replica, self.stage = divmod(self.rank, stages)
        if self.replicas == 1:
            self.pipe, self.dp = self.comm, None
        else:
            self.pipe = self.comm.Split(color=self.replica, key=self.stage)
            self.dp = self.comm.Split(color=self.stage, key=self.replica)

    @classmethod
    def from_environment(cls):
        """The world when launched by mpirun/srun with more than one rank, else None."""
        srun_tasks = _srun_step_tasks()
        if not any(v in os.environ for v in _LAUNCHER_VARS) and srun_tasks <= 1:
            return None
        from mpi4py import MPI
        if MPI.COMM_WORLD.Get_size() == 1:
            if srun_tasks > 1:  # else each task would train the whole net on its own
                raise LaunchError(f"started by srun as one of {srun_tasks} tasks, but MPI sees a "
                                  f"single rank: give srun the PMI of your MPI (srun --mpi=pmix "
                                  f"or --mpi=pmi2; `srun --mpi=list` shows them)")
            return None
        return cls(MPI.COMM_WORLD)

    @property
    def writer_rank(self) -> int:
        """The one rank that writes the run's outputs (metrics.jsonl, summary.json, trace.json,
        checkpoint manifests): replica 0's last stage, which computes the loss the metrics report.
        One rank for all of them, so that with node-local output directories they land on one
        node."""
        return self.stages - 1

    @property
    def is_writer(self) -> bool:
        return self.rank == self.writer_rank

    def map_ranks(self, mine) -> list:
        """Gather every rank's `mine` (its host first) and keep the placement, rank -> (host,
        stage, replica), as self.placement: the run's metrics record it, and the hang watchdog
        names a silent neighbour's host from it. Returns the gathered rows. Collective."""
        rows = self.comm.allgather(mine)
        self.placement = [{"rank": r, "host": row[0], "stage": r % self.stages,
                           "replica": r // self.stages} for r, row in enumerate(rows)]
        return rows

    def thread_share(self, busy: float = 0.0) -> int:
        """This rank's share of its CPU set for torch's CPU threads, beside `busy` CPUs kept
        busy by other programs (see cpu_share)."""
        return cpu_share(cpu_affinity(), self.node_sets(), busy)

    def node_sets(self) -> list:
        """The CPU sets of this node's ranks."""
        return getattr(self, "node_cpus", None) or [cpu_affinity()] * self.local_size

    def share_lengths(self, lengths):
        """Rank 0 (the data reader) tells everyone the segment lengths and input shape."""
        return self.comm.bcast(lengths, root=0)

    def gather_to_writer(self, items: list):
        """Every rank's list, concatenated in rank order on the writing rank (None elsewhere)."""
        gathered = self.comm.gather(items, root=self.writer_rank)
        return [x for part in gathered for x in part] if self.is_writer else None


def run_guarded(comm, fn, expected_errors=()) -> int:
    """Run fn(); on any exception print it once from the failing rank and abort every rank of
    comm (no rank is left waiting for a neighbour that died). Abort is called inside the except
    blocks: there the traceback still holds the engine, so buffers of sends in flight stay
    valid while the neighbours may still be reading them."""
    from mpi4py import MPI
    rank = comm.Get_rank()
    try:
        return fn()
    except expected_errors as e:
        _abort(comm, f"error (rank {rank}): {e}")
    except MPI.Exception as e:  # most often a neighbour that is being aborted: one line
        _abort(comm, f"rank {rank}: MPI error "
                     f"({e.Get_error_string().splitlines()[0]}); aborting")
    except BaseException:  # noqa: B036 - KeyboardInterrupt must abort the others too
        _abort(comm, f"rank {rank} failed:\n{traceback.format_exc()}")
    return 1


def _abort(comm, message: str):
    """Print why, then abort every rank. The pause lets the launcher forward the message
    first: on MPI_Abort the launcher may tear the job down before it has read what the rank
    wrote to its stderr pipe, losing the line that says why the run stopped."""
    print(message, file=sys.stderr, flush=True)
    time.sleep(ABORT_GRACE_S)
    comm.Abort(1)
