"""The trainer: builds a run (placement, data, stages, engine, outputs, resume) and trains it.

`Trainer(cfg, world, placement, stop)` builds everything; `fit` trains epoch after epoch
(`train_epoch`, then `end_epoch`: `evaluate`, the metrics line, `save_checkpoint` at its cadence)
until the run ends or a stop is agreed; `finish` writes the summary and says the exit status;
`close` releases the data loaders. The loop is the same for both engines: every replica's stage 0
reads its share of the data, the last stage computes the loss, and replica 0's last stage
(World.writer_rank) writes every run output: metrics.jsonl, summary.json, trace.json and the
checkpoint manifests.
"""
import dataclasses
import itertools
import json
import math
import os
import sys
import time

import torch

from .checkpoint import MANIFEST, find_resume, load_blocks, read_manifest, resume_readable
from ..archs import LM_ARCHS
from ..comm.compress import Compression
from ..config import num_replicas, num_stages
from ..engines.evaluation import correct
from ..comm.world import _affinity, busy_cpus, cpu_share, oversubscribed
from .metrics import MetricsWriter, Progress, fmt_time, stage_memory, write_json_atomic
from ..models import num_blocks
from ..engines.stopping import EVAL_CHECK_BATCHES, EXIT_REQUEUE, STOP, Interrupts, agree
from .checkpointing import RunCheckpoints, describe_run
from .assemble import build_run_engine
from ..comm.watchdog import EVALUATION_GRACE_S, end_startup, startup_step
from ..core import trace


class TrainingError(RuntimeError):
    """A run that cannot go on (bad data, non-finite loss): reported as one line, exit status 1."""


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
    use that other programs leave free (`busy`: how many they keep busy; mpi.world.cpu_share):
    under MPI its CPU set divided among the node's ranks that share it, in one process the whole
    set (at most torch's default)."""
    if cfg.run.threads:
        return cfg.run.threads
    if world:
        return world.thread_share(busy)
    mine = _affinity()
    return max(1, min(torch.get_num_threads(), cpu_share(mine, [mine], busy)))


def decode_threads(cfg, share: int, loaders: int = 1) -> int:
    """JPEG decode workers of each data loader: data.decode_workers, else the process's CPU share
    (what its torch threads get) divided among the training loaders it runs at once (R in one
    process, one per stage-0 rank under MPI). Not the affinity set: R stage-0 ranks sharing a
    node's CPUs would each start one thread per CPU."""
    return cfg.data.decode_workers or max(1, share // loaders)


def open_data(cfg, device, shard=(0, 1), decoders=1):
    """Training and validation loaders (only processes holding a stage 0 call this). shard:
    (replica, R): the training loader hands out this replica's share of every epoch. decoders:
    JPEG decode workers per loader (decode_threads)."""
    from ..data import BatchLoader, open_split
    sizes = (cfg.data.synthetic_train, cfg.data.synthetic_val)
    try:
        train = open_split(cfg.data.path, "train", synthetic_sizes=sizes, seed=cfg.data.synthetic_seed)
        val = open_split(cfg.data.path, "val", synthetic_sizes=sizes, seed=cfg.data.synthetic_seed)
    except (OSError, ValueError) as e:
        raise TrainingError(f"data.path {e}") from None  # e starts with the path
    if train.num_classes != cfg.model.num_classes:
        raise TrainingError(f"data.path {cfg.data.path} has {train.num_classes} classes but "
                            f"model.num_classes is {cfg.model.num_classes}")
    if (train.kind == "tokens") != (cfg.model.arch in LM_ARCHS):
        held = "tokens" if train.kind == "tokens" else "images"
        raise TrainingError(f"data.path {cfg.data.path} holds {held} but model.arch is "
                            f"{cfg.model.arch}: token files (petra_mpi.prep.text) go with revlm/lm")
    if train.kind == "tokens":  # the windows are the model's context
        try:
            train.set_context(cfg.model.context)
            val.set_context(cfg.model.context)
        except ValueError as e:
            raise TrainingError(f"data.path {e}") from None
    jpeg = train.kind == "jpeg"
    if jpeg:
        from ..data.augment import has_gpu_decode
        warning = decode_cpu_warning(cfg, len(os.sched_getaffinity(0)), has_gpu_decode(device))
        if warning:
            print(warning, file=sys.stderr, flush=True)
    common = dict(seed=cfg.run.seed, device=device, crop=cfg.data.crop if jpeg else None,
                  prefetch=cfg.data.prefetch, decode_threads=decoders,
                  decode_pool=cfg.data.decode_pool)
    side = cfg.data.crop if jpeg else train.image_size
    shape = (cfg.model.context,) if train.kind == "tokens" else (3, side, side)
    return (BatchLoader(train, cfg.data.batch_size, train=True, augment=cfg.data.augment,
                        shard=shard, **common),
            BatchLoader(val, cfg.data.batch_size, train=False, augment=False, **common),
            shape)


# CPUs a stage-0 rank decoding full-size JPEGs on the CPU should have when data.decode_workers
# leaves it to the rank's CPU set: what the ImageNet batch scripts give each rank.
MIN_DECODE_CPUS = 8


def decode_cpu_warning(cfg, cpus: int, gpu_decode: bool):
    """A warning when this stage-0 rank has fewer CPUs than the config's JPEG decode needs (a
    launcher that binds each rank to one CPU starves the whole pipeline of data), else None."""
    needed = cfg.data.decode_workers or MIN_DECODE_CPUS
    if gpu_decode or cpus >= needed:
        return None
    wanted = ("data.decode_workers asks for" if cfg.data.decode_workers else
              "full-size ImageNet wants")
    return (f"petra_mpi: warning: stage 0 decodes JPEGs on {cpus} CPU(s), fewer than the "
            f"{needed} that {wanted}: the pipeline will wait for data. Under SLURM give the "
            f"job --cpus-per-task={needed} and pass it to srun (slurm/common.sh does); the rank "
            f"map shows each rank's CPUs")


def evaluate_in_pieces(engine, batches, m, vote):
    """The evaluation of m batches in pieces of EVAL_CHECK_BATCHES, every rank agreeing after
    each whether to stop (vote(): the agreed level), so a stop request need not wait for a whole
    evaluation (a due wall-time checkpoint does wait). Returns (totals, stopped); totals: the
    summed EvalTotals where the loss is computed, None elsewhere and when stopped."""
    totals, done = None, 0
    while True:
        piece = min(EVAL_CHECK_BATCHES, m - done)
        part = engine.evaluate(None if batches is None else itertools.islice(batches, piece),
                               piece)
        if totals is None:
            totals = part
        elif part is not None:
            for f in dataclasses.fields(totals):
                setattr(totals, f.name, getattr(totals, f.name) + getattr(part, f.name))
        done += piece
        if done >= m:
            return totals, False
        if vote() == STOP:
            return None, True


def choose_partition(cfg, J, world, device, dtype, input_shape, resume):
    """(blocks per stage, kept plan), the same on every rank. The split: the config's; the
    checkpoint's when resuming (a measured split may come out differently on another start);
    else None (one block per stage, or the estimate) unless model.balance is measure, when rank
    0 times every block on this run's device, dtype and batch and tells the others the balanced
    split. The kept plan (Stage.set_kept per stage) comes with a measured split under
    model.memory_budget, planned in the measured costs (the checkpoint's when resuming); else
    None, and build_stages plans by the estimate."""
    blocks_total = num_blocks(cfg.model.arch, cfg.model.depth)
    if cfg.model.partition or J == blocks_total:
        return cfg.model.partition, None
    if resume:
        with open(os.path.join(resume, MANIFEST)) as f:
            manifest = json.load(f)
        # A checkpoint written with other stages is split afresh below.
        if manifest.get("stages") == J:
            return manifest.get("partition"), manifest.get("kept")
    if cfg.model.balance != "measure":
        return None, None
    chosen = None
    if world is None or world.rank == 0:
        from ..core.blockcost import measured_partition_for
        start = time.perf_counter()
        sizes, costs, split, kept = measured_partition_for(cfg, J, input_shape, device, dtype)
        per_stage = " ".join(f"{1e3 * c:.0f}" for c in costs.stage_seconds(sizes))
        line = (f"petra_mpi: stages balanced by measured cost ({time.perf_counter() - start:.1f} "
                f"s to time {blocks_total} blocks): blocks per stage {sizes}, ms per micro-batch "
                f"{per_stage}")
        if split != sizes:  # kept blocks cost less: their stages may take more blocks
            line += f"; with the kept blocks of model.memory_budget {split}"
        print(line, file=sys.stderr, flush=True)
        chosen = split, kept
    return world.comm.bcast(chosen, root=0) if world else chosen


def resume_from(path, identity, layout, workers, device):
    """Load the checkpoint at `path` into the workers. Returns the trainer state, with the data
    position and the optimizer step counter carried over to this run's layout, and the list of
    layout changes that alter the learning dynamics (empty on the checkpoint's own layout)."""
    manifest = read_manifest(path, identity)
    state = manifest["trainer"]
    for w in workers:
        load_blocks(path, manifest, w, device)
    old = {k: manifest.get(k) for k in layout}
    carry_over(state, workers, old, layout)
    return state, layout_changes(old, layout)


def carry_over(state, workers, old, new):
    """Map the checkpoint's progress onto this layout. The data position counts each replica's
    micro-batches: replica r's batch i is batch i·R + r of the epoch, so p batches on R replicas
    are p·R of the epoch, p·R // R' on R' (the same batches when R' divides p·R). The learning-
    rate schedule is a function of the optimizer step and the steps per epoch (which depend on
    R): the step counter is rescaled so the schedule keeps its place in the run, in epochs."""
    n0, n1 = old["microbatches_per_epoch"], new["microbatches_per_epoch"]
    if (n0, old["replicas"]) != (n1, new["replicas"]):
        p = state["position"]
        state["position"] = n1 if p == n0 else min(n1, p * old["replicas"] // new["replicas"])
    s0, s1 = old["steps_per_epoch"], new["steps_per_epoch"]
    if s0 != s1:
        for w in workers:
            w.optimizer.rescale_steps(s1 / s0)


def layout_changes(old, new) -> list[str]:
    """Each difference between the checkpoint's layout and this run's, said with what it does
    to training."""
    changes = []
    if old["stages"] != new["stages"]:
        changes.append(f"stages {old['stages']} -> {new['stages']} (the gradient delays "
                       f"2(J-1-s) change with J)")
    elif old["partition"] != new["partition"]:
        changes.append(f"split {old['partition']} -> {new['partition']} (the delay each block "
                       f"sees changes)")
    if old["replicas"] != new["replicas"]:
        changes.append(f"replicas {old['replicas']} -> {new['replicas']} (effective batch, peak "
                       f"lr {old['peak_lr']:g} -> {new['peak_lr']:g} and batch-norm batches "
                       f"change; steps per epoch {old['steps_per_epoch']} -> "
                       f"{new['steps_per_epoch']}, the step counter rescaled to keep the "
                       f"schedule's place)")
    elif old["microbatches_per_epoch"] != new["microbatches_per_epoch"]:
        changes.append(f"micro-batches per epoch {old['microbatches_per_epoch']} -> "
                       f"{new['microbatches_per_epoch']}")
    for key in ("device", "dtype", "precision"):
        if old[key] != new[key]:
            changes.append(f"{key} {old[key]} -> {new[key]} (rounding differs)")
    return changes


def segment_lengths(cfg, train_batches: int, val_batches: int):
    n = train_batches if not cfg.train.limit_batches else min(train_batches, cfg.train.limit_batches)
    m = val_batches if not cfg.train.limit_eval_batches else min(val_batches,
                                                                cfg.train.limit_eval_batches)
    if n < 1:
        raise TrainingError(f"data.path {cfg.data.path}: fewer training images than one batch of "
                            f"{cfg.data.batch_size}")
    return n, m


class TrainLog:
    """Loss bookkeeping on the process of the last stage."""

    def __init__(self, cfg, worker, writer, n, epoch, position=0, replicas=1):
        """Losses and accuracies are replica 0's (a sample of the global batch); images and
        images/s count every replica's (they advance in step: the averages synchronise them).
        For a language model the count is of tokens (one label each), logged as tokens/s."""
        self.cfg, self.worker, self.writer, self.epoch = cfg, worker, writer, epoch
        self.tokens = cfg.model.arch in LM_ARCHS
        self.microbatches = n
        self.replicas = replicas
        self.loss_sum = self.correct = self.count = 0
        self.seen = position
        self.epoch_loss = self.epoch_correct = self.epoch_count = 0
        self.start = self.mark = time.perf_counter()
        self.last_logged_step = worker.optimizer.steps
        self.progress = Progress(n, f"epoch {epoch + 1}/{cfg.train.epochs}",
                                 enabled=cfg.run.progress)

    def __call__(self, b, loss, logits, labels):
        loss = loss.item()
        step = self.worker.optimizer.steps
        if not math.isfinite(loss):
            why = (f"non-finite loss ({loss}) at step {step} (epoch {self.epoch}, micro-batch {b}): "
                   f"stopping; lower optim.lr or check the data")
            self.writer.write("error", step=step, epoch=self.epoch, message=why)  # kept on disk
            raise TrainingError(why)
        hits = correct(logits, labels)
        self.loss_sum += loss * len(labels)
        self.correct += hits
        self.count += len(labels)
        self.epoch_loss += loss * len(labels)
        self.epoch_correct += hits
        self.epoch_count += len(labels)
        self.seen += 1
        now = time.perf_counter()
        rate = self.replicas * self.epoch_count / max(now - self.start, 1e-9)
        self.progress.update(self.seen, loss=self.loss_sum / self.count,
                             **{"tok_s" if self.tokens else "img_s": round(rate)})
        if step - self.last_logged_step >= self.cfg.run.log_every or self.seen == self.microbatches:
            speed = self.replicas * self.count / max(now - self.mark, 1e-9)
            self.writer.write("train", step=step, epoch=self.epoch, loss=self.loss_sum / self.count,
                              acc=self.correct / self.count, lr=self.worker.optimizer.last_lr,
                              images_per_s=speed,  # kept for readers of earlier runs
                              **({"tokens_per_s": speed} if self.tokens else {}))
            self.loss_sum = self.correct = self.count = 0
            self.mark, self.last_logged_step = now, step

    def finish(self):
        self.progress.close()
        seconds = time.perf_counter() - self.start
        images = self.replicas * self.epoch_count
        stats = {"train_loss": self.epoch_loss / max(1, self.epoch_count),
                 "train_acc": self.epoch_correct / max(1, self.epoch_count),
                 "images": images, "seconds": seconds,
                 "images_per_s": images / max(seconds, 1e-9)}
        if self.tokens:  # the same figures under their own names (images counts tokens too)
            stats.update(tokens=images, tokens_per_s=stats["images_per_s"])
        return stats


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
    J, R = num_stages(cfg, size), num_replicas(cfg, size)
    if world:
        world.split(J)  # rank = replica · J + stage
    device = pick_device(cfg, world.local_rank if world else 0)
    table = None
    if world:
        from ..comm.devices import rank_map
        table = rank_map(world, device)
    # Measured by every rank at once, just after the rank map's collective (see busy_cpus).
    mine, sets = _affinity(), (world.node_sets() if world else [_affinity()])
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


def run(cfg, world, dry_run=False, stop=None, profile=False) -> int:
    """Train on this process's stages; `world` is the MPI context (None in one process);
    `stop` is set by SIGUSR1/SIGTERM; `profile` (with dry_run) measures the blocks' costs.
    Returns the exit status: 0 when the run finished, EXIT_REQUEUE when it stopped on request."""
    startup_step("setting up the device")
    placement = find_placement(cfg, world)
    if dry_run:
        from .dryrun import report
        return report(cfg, placement.J, world, device=placement.device, dtype=placement.dtype,
                      profile=profile)
    trainer = Trainer(cfg, world, placement, stop)
    if world is None:
        end_startup()  # no neighbours wait for this process's first micro-batch
    try:
        if trainer.already_finished:  # its outputs stay as they are
            return 0
        trainer.fit()
        return trainer.finish()
    finally:
        trainer.close()


def locate_resume(cfg, world, rank):
    """The checkpoint to resume from (run.resume; rank 0 looks, every rank learns), or None."""
    resume = find_resume(cfg.run.out_dir, cfg.run.resume) if rank == 0 else None
    return world.comm.bcast(resume, root=0) if world else resume


def load_resume(cfg, world, resume, identity, layout, workers, device):
    """Load the newest checkpoint every rank can read from `resume` on (a crash may have damaged
    the newest) into the workers: (its path, the trainer's state, the layout changes)."""
    startup_step(f"loading the checkpoint {resume}")
    resume, (state, changes) = resume_readable(
        resume, lambda path: resume_from(path, identity, layout, workers, device),
        fallback=cfg.run.resume == "auto", comm=world.comm if world else None)
    return resume, state, changes


def open_loaders(cfg, world, placement):
    """(training loaders, validation loader, (training batches, validation batches, input
    shape)): the loaders on stage 0 (in one process one training loader per replica, each its
    shard), none elsewhere; the lengths the same on every rank."""
    train_loaders, val_loader, lengths = [], None, None
    if placement.stage == 0:
        shards = ([(placement.replica, placement.R)] if world else
                  [(r, placement.R) for r in range(placement.R)])
        for shard in shards:
            train_loader, val, input_shape = open_data(
                cfg, placement.device, shard, decode_threads(cfg, placement.threads, len(shards)))
            train_loaders.append(train_loader)
            if val_loader is None:
                val_loader = val
            else:
                val.close()
        lengths = (len(train_loaders[0]), len(val_loader), input_shape)
    if world:
        lengths = world.share_lengths(lengths)
    return train_loaders, val_loader, lengths


def announce(cfg, world, placement, writer, state, resume, changes, already_finished,
             microbatches_per_epoch):
    """The start (or resume) record and lines: what runs, from where, and what changed."""
    if already_finished:
        print(f"petra_mpi: {cfg.run.out_dir} holds a run of {state['epoch']} epoch(s) "
              f"that is already finished, nothing to do (use another run.out_dir, e.g. "
              f"--set run.out_dir={cfg.run.out_dir}_2, or more train.epochs to go on)",
              file=sys.stderr, flush=True)
        return
    writer.write("resume" if resume else "start", stages=placement.J, replicas=placement.R,
                 writer_rank=placement.rank, threads=placement.threads,
                 method=cfg.train.method, arch=cfg.model.arch, config=cfg.to_dict(),
                 microbatches_per_epoch=microbatches_per_epoch,
                 placement=world.placement if world else None,
                 **({"from": resume, "epoch": state["epoch"], "position": state["position"],
                     "layout_changes": changes} if resume else {}))
    if resume:
        print(f"resumed from {resume} (epoch {state['epoch'] + 1}, micro-batch "
              f"{state['position']})", file=sys.stderr, flush=True)
    if changes:
        print("petra_mpi: resumed on another layout, which changes the learning dynamics: "
              + "; ".join(changes), file=sys.stderr, flush=True)


class Trainer:
    """One process's part of a run. Every rank builds one and calls the same methods in the same
    order: the stop votes, checkpoints and evaluations inside them are collective."""

    def __init__(self, cfg, world, placement: Placement, stop=None):
        self.cfg, self.world, self.placement = cfg, world, placement
        # every replica's stage 0 reads; one rank writes every output (World.writer_rank)
        self.reads_data = placement.stage == 0
        self.writes = world.is_writer if world else True
        startup_step(f"opening the data ({cfg.data.path})" if self.reads_data else
                     "waiting for stage 0 to open the data")
        self.train_loaders, self.val_loader, lengths = open_loaders(cfg, world, placement)
        self.microbatches_per_epoch, self.eval_batches = segment_lengths(cfg, *lengths[:2])
        self.input_shape = lengths[2]
        resume = locate_resume(cfg, world, placement.rank)
        partition, kept = choose_partition(cfg, placement.J, world, placement.device,
                                           placement.dtype, self.input_shape, resume)
        self.epoch = 0  # the epoch being trained: diagnostics records carry it
        startup_step("building the stages")
        run = build_run_engine(cfg, world, placement, partition, self.input_shape,
                               self.microbatches_per_epoch, diagnostics=self._write_diagnostics,
                               kept=kept)
        self.engine, self.watchdog, self.tracers = run.engine, run.watchdog, run.tracers
        self.pipeline_workers = run.pipeline_workers  # what checkpoints and reports hold
        self.writer = MetricsWriter(cfg.run.out_dir, cfg.run.tensorboard) if self.writes else None
        self.identity, self.layout, manifest_head = describe_run(
            cfg, placement, run.stages[0].partition, self.microbatches_per_epoch,
            run.steps_per_epoch, run.lr_schedule.peak, self.input_shape[-1], kept)
        self.checkpoints = RunCheckpoints(cfg, world, placement, self.pipeline_workers,
                                          manifest_head, self.writer, run.tracer, self.watchdog)
        self.load_state_dict({"epoch": 0, "position": 0, "best_val_acc": None, "history": [],
                              "wall_time_s": 0.0})
        changes = []
        if resume:
            resume, state, changes = load_resume(cfg, world, resume, self.identity, self.layout,
                                                 run.workers, placement.device)
            self.load_state_dict(state)
        # A finished run's directory: the same command again has nothing left to train.
        self.already_finished = bool(resume) and self.state["epoch"] >= cfg.train.epochs
        if self.writer:
            announce(cfg, world, placement, self.writer, self.state, resume, changes,
                     self.already_finished, self.microbatches_per_epoch)
        self.interrupts = Interrupts(stop, cfg.run.checkpoint_every_minutes,
                                     keeps_clock=placement.rank == 0)
        self.stopping = False  # every rank agreed to stop (a signal or a due wall-time stop)
        self.start = time.perf_counter()
        startup_step("training the first micro-batch")

    def _write_diagnostics(self, record):
        self.writer.write("diag", step=self.pipeline_workers[-1].optimizer.steps,
                          epoch=self.epoch, **record)

    # ------------------------------------------------------------------ the checkpoint's content
    def state_dict(self) -> dict:
        """The trainer's part of a checkpoint (the stages' parameters and optimizer states are in
        the stage files): epoch and position, best accuracy, history and wall time so far."""
        return {**self.state, "wall_time_s": self.wall_time()}

    def load_state_dict(self, state: dict):
        self.state = state
        self.prior_wall = state["wall_time_s"]  # of the jobs before a resume

    def wall_time(self) -> float:
        return self.prior_wall + time.perf_counter() - self.start

    def save_checkpoint(self, epoch: int, position: int):
        """Write the checkpoint of (epoch, position) atomically; collective."""
        self.state.update(epoch=epoch, position=position)
        self.checkpoints.save(epoch, position, self.state_dict)
        self.interrupts.restart()  # the wall-time cadence counts from the last checkpoint

    # ------------------------------------------------------------------ the loop
    def vote(self) -> int:
        """At a drain point: every rank's stop request, agreed (stopping.agree), watched."""
        with self.watchdog.collective("stop vote"):
            return agree(self.world, self.interrupts)

    def fit(self):
        """Train from the state's epoch and position to the last epoch, or until a stop."""
        for epoch in range(self.state["epoch"], self.cfg.train.epochs):
            self.epoch = epoch
            finished, train_stats = self.train_epoch(epoch)
            if not finished or not self.end_epoch(epoch, train_stats):
                break

    def train_epoch(self, epoch):
        """Train the epoch from its position, draining at the micro-batch checkpoint cadence and
        at every segment's stop vote. Returns (whether the epoch was trained to its end, its
        training figures on the writing rank, else None); a stop mid-epoch checkpoints here."""
        cfg, n = self.cfg, self.microbatches_per_epoch
        position = self.state["position"] if epoch == self.state["epoch"] else 0
        batches = self._train_batches(epoch, position)
        log = TrainLog(cfg, self.pipeline_workers[-1], self.writer, n, epoch, position,
                       self.placement.R) if self.writes else None
        # log itself when tracing is off
        on_loss = self.pipeline_workers[-1].tracer.wrap_callback(trace.LOG, log)
        cadence = cfg.run.checkpoint_every_microbatches
        while position < n and not self.stopping:
            length = n - position if not cadence else min(n - position,
                                                          cadence - position % cadence)
            position += self.engine.train_segment(batches, length, on_loss=on_loss,
                                                  stop=self.interrupts)
            level = self.vote()  # a stop, or a due wall-time checkpoint
            self.stopping = level == STOP
            if position < n and (level or (cadence and position % cadence == 0)):
                self.save_checkpoint(epoch, position)
        if position < n:
            return False, None  # stopped mid-epoch, checkpointed above
        return True, log.finish() if self.writes else None

    def _train_batches(self, epoch, position):
        """This process's training batches from `position` (stage 0 only): one stream, or in one
        process one per replica, each replica's share at the same position."""
        if not self.reads_data:
            return None
        feeds = []
        for loader in self.train_loaders:
            loader.load_state_dict({"epoch": epoch, "position": position})
            feeds.append(_as_dtype(iter(loader), self.placement.dtype))
        return feeds if len(feeds) > 1 else feeds[0]

    def end_epoch(self, epoch, train_stats) -> bool:
        """Evaluate the trained epoch, log it and checkpoint at the epoch cadence. Returns False
        when a stop ends the run (checkpointed so that the resumed run evaluates this epoch)."""
        if self.writes and "epoch_train" in self.state:  # resumed into this epoch's evaluation
            train_stats = self.state.pop("epoch_train")
        totals = None if self.stopping else self.evaluate()
        if self.stopping:  # before or during the evaluation
            if self.writes:
                self.state["epoch_train"] = train_stats
            self.save_checkpoint(epoch, self.microbatches_per_epoch)
            return False
        if self.writes:
            log_epoch(self.cfg, self.writer, self.state, epoch,
                      self.pipeline_workers[-1].optimizer.steps,
                      train_stats, totals.result())
        level = self.vote()
        self.stopping = level == STOP
        every = self.cfg.run.checkpoint_every
        if (every and (epoch + 1) % every == 0) or epoch + 1 == self.cfg.train.epochs or level:
            self.save_checkpoint(epoch + 1, 0)
        return not self.stopping

    def evaluate(self):
        """Evaluate on the validation batches in pieces, stopping early when every rank agrees
        to stop (then self.stopping is set). Returns the summed EvalTotals placement the loss is
        computed, None elsewhere and when stopped."""
        val_batches = None
        if self.reads_data:
            self.val_loader.load_state_dict({"epoch": 0, "position": 0})
            val_batches = _as_dtype(itertools.islice(iter(self.val_loader), self.eval_batches),
                                    self.placement.dtype)
        # Replica 0 evaluates, the other replicas wait for it in the vote after each piece (the
        # last piece's is end_epoch's): every rank allows for the piece until that vote.
        def vote_then_allow():
            level = self.vote()
            self.watchdog.allow("evaluation", EVALUATION_GRACE_S)
            return level
        self.watchdog.allow("evaluation", EVALUATION_GRACE_S)
        with self.tracers[0].span(trace.EVAL):
            totals, self.stopping = evaluate_in_pieces(self.engine, val_batches, self.eval_batches,
                                                       vote_then_allow)
        return totals

    # ------------------------------------------------------------------ the end
    def finish(self) -> int:
        """Gather the memory figures, write the trace and the summary (or the stop line), and
        return the exit status: 0 when the run finished, EXIT_REQUEUE when it stopped."""
        cfg, placement, state = self.cfg, self.placement, self.state
        memory = ([stage_memory(w.stage, w.optimizer) for w in self.pipeline_workers]
                  if placement.replica == 0 else [])
        if self.world:
            memory = self.world.gather_to_writer(memory)
        self.close()
        trace.finish(self.tracers, self.world, os.path.join(cfg.run.out_dir, "trace.json"),
                     {"method": cfg.train.method, "arch": cfg.model.arch, "stages": placement.J,
                      "batch_size": cfg.data.batch_size, "accumulation": cfg.train.accumulation})
        if self.stopping and state["epoch"] < cfg.train.epochs:
            if self.writes:
                self.writer.write("stop", epoch=state["epoch"], position=state["position"],
                                  exit_status=EXIT_REQUEUE)
                self.writer.close()
                print(f"stopped on request at epoch {state['epoch'] + 1}, micro-batch "
                      f"{state['position']}: checkpoint complete, exit status {EXIT_REQUEUE} "
                      f"(requeue to resume with run.resume=auto)", file=sys.stderr, flush=True)
            if self.world:  # the ranks leave together: srun --kill-on-bad-exit ends the others
                self.world.comm.Barrier()  # once the first one exits with this status
            return EXIT_REQUEUE
        if self.writes:
            write_summary(cfg, state, placement.J, placement.R, self.microbatches_per_epoch,
                          memory, self.wall_time(), placement.rank)
            self.writer.close()
        return 0

    def close(self):
        """Stop the data loaders' background readers (again: a no-op)."""
        for loader in self.train_loaders + ([self.val_loader] if self.val_loader else []):
            loader.close()
        self.train_loaders, self.val_loader = [], None


def log_epoch(cfg, writer, state, epoch, step, train_stats, result):
    if cfg.model.arch in LM_ARCHS:  # val_loss is nats per token
        from ..data.text import bytes_per_token
        result = {**result, "val_bpb": result["val_loss"] / math.log(2)
                  / bytes_per_token(cfg.data.path)}
    best = state["best_val_acc"]
    state["best_val_acc"] = result["val_acc"] if best is None else max(best, result["val_acc"])
    writer.write("eval", epoch=epoch, step=step, **result)
    state["history"].append({"epoch": epoch, **result, **train_stats})
    print(f"epoch {epoch + 1}/{cfg.train.epochs}: train loss {train_stats['train_loss']:.4f} "
          f"acc {train_stats['train_acc']:.3f} | val loss {result['val_loss']:.4f} "
          f"acc {result['val_acc']:.3f} top5 {result['val_top5']:.3f} | "
          f"{train_stats['images_per_s']:.0f} {'tok' if cfg.model.arch in LM_ARCHS else 'img'}/s",
          file=sys.stderr, flush=True)


def write_summary(cfg, state, J, R, n, memory, wall, writer_rank=0):
    history = state["history"]
    trained = sum(h["images"] for h in history)
    summary = {"val_acc": history[-1]["val_acc"], "best_val_acc": state["best_val_acc"],
               "val_top5": history[-1]["val_top5"], "val_loss": history[-1]["val_loss"],
               "epochs": cfg.train.epochs, "wall_time_s": wall,
               "images_per_s": trained / max(sum(h["seconds"] for h in history), 1e-9),
               "stages": J, "replicas": R, "method": cfg.train.method, "arch": cfg.model.arch,
               "microbatches_per_epoch": n,  # per replica: an epoch is R times as many
               **({"tokens_per_s": trained / max(sum(h["seconds"] for h in history), 1e-9)}
                  if cfg.model.arch in LM_ARCHS else {}),
               "history": history, "memory": memory,
               "writer_rank": writer_rank}  # the rank that wrote every output of the run
    write_json_atomic(os.path.join(cfg.run.out_dir, "summary.json"), summary)
    print(f"done in {fmt_time(wall)}: val acc {summary['val_acc']:.4f} "
          f"(best {summary['best_val_acc']:.4f}); outputs in {cfg.run.out_dir}", file=sys.stderr)


def _as_dtype(batches, dtype):
    if dtype == torch.float32:
        return batches
    return ((x.to(dtype) if x.is_floating_point() else x, y) for x, y in batches)  # ids stay ids
