"""The ranks of a run: `World` is the one object that talks across them (rank facts, bcast,
gather, barrier, the stop votes, the replicas' average, the pipeline's channels), over the
transport the config names (comm.transport); launcher detection, CPU shares and fault handling.

A transport is one module of comm/ and a line of TRANSPORTS: its `start(srun_tasks)` returns the
group of every rank (or None for one rank alone), a group being what World calls (mpi.MPIGroup
shows every method). Nothing is imported before a launcher is seen, so single-process runs need
neither MPI nor torch.distributed.
"""
import importlib
import os
import sys
import time
import traceback

# comm.transport -> the module of comm/ that carries it
TRANSPORTS = {"mpi": "mpi", "torch": "torch_dist"}
# Seconds a failing rank waits between printing why and ending every rank (see _abort).
ABORT_GRACE_S = 1.0
_LAUNCHER_VARS = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK", "MPI_LOCALNRANKS",
                  "MV2_COMM_WORLD_SIZE", "PETRA_MPI")


class LaunchError(RuntimeError):
    pass


def transport_module(name: str):
    """The module of comm/ that carries comm.transport `name`."""
    return importlib.import_module(f"{__package__}.{TRANSPORTS[name]}")


def started_by_torchrun(env=None) -> bool:
    """Whether torchrun (torch.distributed.elastic) started this process."""
    env = os.environ if env is None else env
    return "TORCHELASTIC_RUN_ID" in env


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
    rank, size = env.get("RANK", "").strip(), env.get("WORLD_SIZE", "").strip()
    if started_by_torchrun(env) and rank.isdigit() and size.isdigit():
        return int(rank), int(size)  # before srun's: an srun task may run a torchrun
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
    """This rank's view of the run's ranks, over a transport's `group` of all of them. The only
    object outside comm/ that talks across ranks: every method that does is collective over the
    ranks it names, called by each of them at the same point of the program."""

    def __init__(self, group, transport="mpi"):
        self._group = group  # the transport's (mpi.MPIGroup, torch_dist.TorchGroup)
        self.transport = transport
        self.rank, self.size = group.rank, group.size
        self.local_rank, self.local_size, self.node_cpus = group.node(sorted(cpu_affinity()))
        self.placement = None  # rank -> host, stage and replica, once map_ranks ran
        self.split(self.size)  # one pipeline over every rank until the trainer says otherwise

    def split(self, stages: int):
        """Lay the ranks out as R = size / stages replicas of a `stages`-rank pipeline, rank =
        replica · J + stage (so under SLURM's block distribution a replica's consecutive stages
        share a node). The pipeline (the channels) and the stage's data-parallel group (the
        replicas' average; none for R = 1) are groups of their own; stop votes, checkpoints and
        the other collectives stay on the whole world. Collective."""
        assert self.size % stages == 0, (self.size, stages)
        self.stages, self.replicas = stages, self.size // stages
        self.replica, self.stage = divmod(self.rank, stages)
        R, J = self.replicas, stages
        if R == 1:  # (a transport's group of the whole world carries a pipeline already)
            self._pipe, self._dp = self._group, None
        else:
            self._pipe = self._group.subgroups([[r * J + s for s in range(J)] for r in range(R)],
                                               lanes=True)
            self._dp = self._group.subgroups([[r * J + s for r in range(R)] for s in range(J)])

    @classmethod
    def from_environment(cls, transport="mpi"):
        """The world when a launcher (mpirun, srun, torchrun) started more than one rank, over
        comm.transport `transport`; else None. LaunchError (one line) when it cannot start."""
        torchrun = started_by_torchrun()
        if torchrun and transport == "mpi":
            raise LaunchError("started by torchrun, which starts no MPI: set comm.transport: "
                              "torch (--set comm.transport=torch), or launch with mpirun or srun")
        srun_tasks = _srun_step_tasks()
        if not torchrun and not any(v in os.environ for v in _LAUNCHER_VARS) and srun_tasks <= 1:
            return None
        group = transport_module(transport).start(srun_tasks)
        return None if group is None else cls(group, transport)

    def alone(self, ranks):
        """The ranks `ranks` (a list of this world's) as a world of their own (a benchmark's
        sub-run), None on the others. Collective over this world."""
        group = self._group.subgroups([list(ranks)], lanes=True)  # it carries a pipeline
        return None if group is None else World(group, self.transport)

    def pipeline(self):
        """This rank's pipeline as a world of its own (its replica alone). Collective."""
        return World(self._pipe, self.transport)

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
        rows = self.allgather(mine)
        self.placement = [{"rank": r, "host": row[0], "stage": r % self.stages,
                           "replica": r // self.stages} for r, row in enumerate(rows)]
        return rows

    def thread_share(self, busy: float = 0.0) -> int:
        """This rank's share of its CPU set for torch's CPU threads, beside `busy` CPUs kept
        busy by other programs (see cpu_share)."""
        return cpu_share(cpu_affinity(), self.node_sets(), busy)

    def node_sets(self) -> list:
        """The CPU sets of this node's ranks."""
        return self.node_cpus or [cpu_affinity()] * self.local_size

    # ---------------------------------------------------------------- collectives of every rank
    def bcast(self, obj, root: int = 0):
        """Rank `root`'s obj, on every rank."""
        return self._group.bcast(obj, root)

    def gather(self, obj, root: int = 0):
        """Every rank's obj in rank order on `root`, None elsewhere."""
        return self._group.gather(obj, root)

    def allgather(self, obj) -> list:
        """Every rank's obj in rank order, on every rank."""
        return self._group.allgather(obj)

    def barrier(self, poll_sleep=None):
        """Return once every rank is here; poll_sleep: seconds between tests of the wait, so a
        waiting rank leaves its core to those still working (None: the library's wait)."""
        self._group.barrier(poll_sleep)

    def share_lengths(self, lengths):
        """Rank 0 (the data reader) tells everyone the segment lengths and input shape."""
        return self.bcast(lengths)

    def gather_to_writer(self, items: list):
        """Every rank's list, concatenated in rank order on the writing rank (None elsewhere)."""
        gathered = self.gather(items, root=self.writer_rank)
        return [x for part in gathered for x in part] if self.is_writer else None

    def vote(self, level: int) -> int:
        """The highest of every rank's `level` (a stop vote at a drain), on every rank; the wait
        leaves Python's interpreter lock to the watchdog's thread."""
        return self._group.allreduce_max(level)

    def post_vote(self, level: int):
        """Post this rank's `level` to a non-blocking vote of every rank: a request (see
        transport.py) whose value() is the highest level once it has completed."""
        return self._group.iallreduce_max(level)

    # ---------------------------------------------------------------- ranks to ranks
    def send_bytes(self, array, dest: int, poll_sleep: float = 0.0):
        """Send a numpy array to rank `dest` (a benchmark's ping-pong), blocking."""
        self._group.send_bytes(array, dest, poll_sleep)

    def receive_bytes(self, array, source: int, poll_sleep: float = 0.0):
        """Receive into a numpy array from rank `source`, blocking."""
        self._group.receive_bytes(array, source, poll_sleep)

    def torch_distributed(self):
        """torch.distributed over this world's ranks (gloo; NCCL too on GPUs), for what runs on
        it (torch's pipelining schedules): the transport's own under comm.transport torch, else
        started now at an address rank 0 tells the others. Returns the module. Collective."""
        from . import torch_dist
        if not torch_dist.dist.is_initialized():
            torch_dist.init_over(self._group, torch_dist.backend())
        return torch_dist.dist

    def close(self):
        """Let go of the ranks, on every rank once its last message is through and what used
        them (the engine, its streams) is gone: torch.distributed's process groups (of
        comm.transport torch, or started by torch_distributed) end here, while the interpreter
        still runs (torch_dist.end says why). MPI ends at exit (mpi4py's own handler). The world
        is of no more use."""
        self._group = self._pipe = self._dp = None
        loaded = sys.modules.get(f"{__package__}.torch_dist")
        if loaded:
            loaded.end()

    def open_streams(self, **kw):
        """This rank's streams to its pipeline neighbours (streams.open_streams, whose keywords
        these are). Collective over the pipeline."""
        from .streams import open_streams
        return open_streams(self._pipe, self.replica, **kw)

    def replica_mean(self, streams):
        """The average of this stage's gradients over its replicas (replicas.ReplicaMean, on the
        transport of `streams`) and a line for the run log."""
        from .replicas import ReplicaMean
        path, why = self._group.average_path(streams.transport)
        line = f"replica average {path}" + (f" ({why})" if why else "")
        return ReplicaMean(self._dp, streams.transport, path), line


def run_guarded(fn, expected_errors=(), rank=None) -> int:
    """Run fn() on a rank that a launcher started (`rank`: its number; None: the launcher's);
    on any exception print it once from the failing rank and end every rank of the job (none is
    left waiting for a neighbour that died). The end is called inside the except blocks: there
    the traceback still holds the engine, so buffers of sends in flight stay valid while the
    neighbours may still be reading them."""
    rank = (launcher_rank_and_size() or (0, 1))[0] if rank is None else rank
    try:
        return fn()
    except expected_errors as e:
        _abort(f"error (rank {rank}): {e}")
    except BaseException as e:  # noqa: B036 - KeyboardInterrupt must abort the others too
        library = _library_error(e)
        _abort(f"rank {rank}: {library}; aborting" if library else
               f"rank {rank} failed:\n{traceback.format_exc()}")
    return 1


def _library_error(e):
    """One line for an error of a loaded transport's library (most often a neighbour being
    ended), or None for any other error."""
    for module in TRANSPORTS.values():
        loaded = sys.modules.get(f"{__package__}.{module}")
        line = loaded.library_error(e) if loaded else None
        if line:
            return line
    return None


def _abort(message: str):
    """Print why, then end every rank: MPI_Abort where MPI has started, else this rank's exit,
    on which the launcher (torchrun, mpirun) ends the others. The pause lets the launcher
    forward the message first: on an abort it may tear the job down before it has read what the
    rank wrote to its stderr pipe, losing the line that says why the run stopped."""
    print(message, file=sys.stderr, flush=True)
    time.sleep(ABORT_GRACE_S)
    if "mpi4py.MPI" in sys.modules:  # MPI started, by this package or by the program
        transport_module("mpi").abort()
    os._exit(1)
