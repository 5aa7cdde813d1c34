"""The trainer: builds a run (placement.py, loaders.py, the stages, engine, outputs, resume)
and trains it.

`Trainer(cfg, world, placement, stop)` builds everything; `fit` trains epoch after epoch
(`train_epoch`, then `end_epoch`: `evaluate`, the metrics line, `save_checkpoint` at its cadence)
until the run ends or a stop is agreed; `finish` writes the summary and says the exit status;
`close` releases the data loaders. The loop is the same for both engines: every replica's stage 0
reads its share of the data, the last stage computes the loss, and replica 0's last stage
(World.writer_rank) writes every run output: metrics.jsonl, summary.json, trace.json and the
checkpoint manifests.

Start-up, one function per step, in the order every rank calls them; under MPI each is a
collective: `find_placement` (the world split into stages and replicas, the rank map),
`open_loaders` (the epoch's lengths from rank 0), `locate_resume` (the checkpoint rank 0 found),
`choose_layout` (the split and kept plan rank 0 chose), `assemble_run` (the tracers' common
clock, the MPI engine's streams), `load_resume` (every rank can read the checkpoint, or all fall
back to an older one).
"""
import dataclasses
import itertools
import math
import os
import sys
import time

from .checkpoint import find_resume, load_blocks, read_manifest, resume_readable
from ..engines.evaluation import correct
from ..files import write_json_atomic
from .errors import TrainingError
from ..models import NetSpec
from .loaders import open_loaders, segment_lengths, training_batches, validation_batches
from .metrics import MetricsWriter, Progress, fmt_time, stage_memory
from .placement import Placement, find_placement
from ..engines.stopping import (EVAL_CHECK_BATCHES, EXIT_STOPPED, STOP, Interrupts, agree,
                                stop_status)
from .checkpointing import RunCheckpoints, describe_run
from .layout import choose_layout, layout_changes
from .assemble import assemble_run
from .watchdog import END_GRACE_S, EVALUATION_GRACE_S, end_startup, startup_step
from ..core import trace


def counts_tokens(cfg) -> bool:
    """Whether the run's samples are token windows (a language model: its figures count
    tokens), not images."""
    return NetSpec.of_config(cfg).takes_tokens


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
        if vote() >= STOP:
            return None, True


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


class TrainLog:
    """Loss bookkeeping on the process of the last stage."""

    def __init__(self, cfg, worker, writer, n, epoch, position=0, replicas=1):
        """Losses and accuracies are replica 0's (a sample of the global batch); images and
        images/s count every replica's (they advance in step: the averages synchronise them).
        For a language model the count is of tokens (one label each), logged as tokens/s."""
        self.cfg, self.worker, self.writer, self.epoch = cfg, worker, writer, epoch
        self.tokens = counts_tokens(cfg)
        self.microbatches = n
        self.replicas = replicas
        self.loss_sum = self.correct = self.count = 0
        self.seen = position
        self.epoch_loss = self.epoch_correct = self.epoch_count = 0
        self.start = self.mark = time.perf_counter()
        self.last_logged_step = worker.optimizer.steps
        self.progress = Progress(n, f"epoch {epoch + 1}/{cfg.train.epochs}",
                                 enabled=cfg.run.progress,
                                 interval_s=cfg.run.progress_interval_s)

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


def run(cfg, world, dry_run=False, stop=None, profile=False) -> int:
    """Train on this process's stages; `world` holds the ranks (None in one process);
    `stop` is set by SIGUSR1/SIGTERM; `profile` (with dry_run) measures the blocks' costs.
    Returns the exit status: 0 when the run finished, stopping.stop_status when it stopped on
    request."""
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
        if not trainer.already_finished:  # (else its outputs stay, a lost summary rewritten)
            trainer.fit()
        return trainer.finish()
    finally:
        trainer.close()
        trainer.watchdog.close()  # its thread holds the engine, and through it the transport


def locate_resume(cfg, world, rank):
    """The checkpoint to resume from (run.resume; rank 0 looks, every rank learns), or None."""
    resume = find_resume(cfg.run.out_dir, cfg.run.resume) if rank == 0 else None
    return world.bcast(resume) if world else resume


def load_resume(cfg, world, resume, identity, layout, workers, device):
    """Load the newest checkpoint every rank can read from `resume` on (a crash may have damaged
    the newest) into the workers: (its path, the trainer's state, the layout changes)."""
    startup_step(f"loading the checkpoint {resume}")
    resume, (state, changes) = resume_readable(
        resume, lambda path: resume_from(path, identity, layout, workers, device),
        fallback=cfg.run.resume == "auto", world=world)
    return resume, state, changes


def announce(cfg, world, placement, writer, state, resume, changes, already_finished,
             microbatches_per_epoch):
    """The start (or resume) record and lines: what runs, from where, and what changed (on the
    writing rank: `writer` None elsewhere)."""
    if writer is None:
        return
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
        layout = choose_layout(cfg, placement.J, world, placement.device, placement.dtype,
                               self.input_shape, resume)
        self.epoch = 0  # the epoch being trained: diagnostics records carry it
        startup_step("building the stages")
        parts = assemble_run(cfg, world, placement, layout, self.input_shape,
                             self.microbatches_per_epoch, diagnostics=self._write_diagnostics)
        self.engine, self.watchdog, self.tracers = parts.engine, parts.watchdog, parts.tracers
        self.pipeline_workers = parts.pipeline_workers  # what checkpoints and reports hold
        self.writer = MetricsWriter(cfg.run.out_dir, cfg.run.tensorboard) if self.writes else None
        self.identity, self.layout, manifest_head = describe_run(
            cfg, placement, parts.stages[0].partition, self.microbatches_per_epoch,
            parts.steps_per_epoch, parts.lr_schedule.peak, self.input_shape[-1], layout.kept)
        self.checkpoints = RunCheckpoints(cfg, world, placement, self.pipeline_workers,
                                          manifest_head, self.writer, parts.tracer, self.watchdog)
        self.load_state_dict({"epoch": 0, "position": 0, "best_val_acc": None, "history": [],
                              "wall_time_s": 0.0})
        changes = []
        if resume:
            resume, state, changes = load_resume(cfg, world, resume, self.identity, self.layout,
                                                 parts.workers, placement.device)
            self.load_state_dict(state)
        # A finished run's directory: the same command again has nothing left to train.
        self.already_finished = bool(resume) and self.state["epoch"] >= cfg.train.epochs
        announce(cfg, world, placement, self.writer, self.state, resume, changes,
                 self.already_finished, self.microbatches_per_epoch)
        self.interrupts = Interrupts(stop, cfg.run.checkpoint_every_minutes,
                                     keeps_clock=placement.rank == 0)
        self.stopping = False  # every rank agreed to stop (a signal or a due wall-time stop)
        self.stopped_by = 0  # the highest vote agreed: STOP_TERM when a rank got SIGTERM
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
            level = agree(self.world, self.interrupts)
        self.stopped_by = max(self.stopped_by, level)
        return level

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
        batches = (training_batches(self.train_loaders, epoch, position, self.placement.dtype)
                   if self.reads_data else None)
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
            self.stopping = level >= STOP
            if position < n and (level or (cadence and position % cadence == 0)):
                self.save_checkpoint(epoch, position)
        if position < n:
            return False, None  # stopped mid-epoch, checkpointed above
        return True, log.finish() if self.writes else None

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
        self.stopping = level >= STOP
        every = self.cfg.run.checkpoint_every
        if (every and (epoch + 1) % every == 0) or epoch + 1 == self.cfg.train.epochs or level:
            self.save_checkpoint(epoch + 1, 0)
        return not self.stopping

    def evaluate(self):
        """Evaluate on the validation batches in pieces, stopping early when every rank agrees
        to stop (then self.stopping is set). Returns the summed EvalTotals on the rank where the
        loss is computed, None elsewhere and when stopped."""
        val_batches = (validation_batches(self.val_loader, self.eval_batches,
                                          self.placement.dtype) if self.reads_data else None)
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
        return the exit status: 0 when the run finished (or had already), stop_status when it
        stopped. Watched, as every collective: a rank stuck here (a writer on a stalled file
        system) ends with the watchdog's status rather than hold the job until its time limit."""
        cfg, placement = self.cfg, self.placement
        with self.watchdog.collective("end of the run", END_GRACE_S):
            self.close()
            if self.world:  # every rank here first: the gathers below keep the GIL as they wait
                self.world.barrier()
            memory = ([stage_memory(w.stage, w.optimizer) for w in self.pipeline_workers]
                      if placement.replica == 0 else [])
            if self.world:
                memory = self.world.gather_to_writer(memory)
            if not self.already_finished:
                trace.finish(self.tracers, self.world, os.path.join(cfg.run.out_dir, "trace.json"),
                             {"method": cfg.train.method, "arch": cfg.model.arch,
                              "stages": placement.J, "batch_size": cfg.data.batch_size,
                              "accumulation": cfg.train.accumulation})
            status = self._final_outputs(memory)
            if self.world:  # the ranks leave together, once the outputs are written: srun ends
                self.world.barrier()  # the others once the first one exits
        return status

    def _final_outputs(self, memory) -> int:
        """The writing rank's stop record and line, or the summary (that of a finished run too,
        when it was lost); the exit status."""
        cfg, placement, state = self.cfg, self.placement, self.state
        if self.stopping and state["epoch"] < cfg.train.epochs:
            status = stop_status(self.stopped_by)
            if self.writes:
                report_stop(self.writer, state, status)
            return status
        lost = not os.path.exists(os.path.join(cfg.run.out_dir, "summary.json"))
        if self.writes and (lost or not self.already_finished):
            write_summary(cfg, state, placement.J, placement.R, self.microbatches_per_epoch,
                          memory, self.wall_time(), placement.rank)
        if self.writes:
            self.writer.close()
        return 0

    def close(self):
        """Stop the data loaders' background readers (again: a no-op)."""
        for loader in self.train_loaders + ([self.val_loader] if self.val_loader else []):
            loader.close()
        self.train_loaders, self.val_loader = [], None


def log_epoch(cfg, writer, state, epoch, step, train_stats, result):
    if counts_tokens(cfg):  # val_loss is nats per token
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
          f"{train_stats['images_per_s']:.0f} {'tok' if counts_tokens(cfg) else 'img'}/s",
          file=sys.stderr, flush=True)


def report_stop(writer, state, status):
    """The writing rank's stop record and line, once the stop's checkpoint is complete."""
    writer.write("stop", epoch=state["epoch"], position=state["position"], exit_status=status)
    writer.close()
    signal, then = (("(SIGTERM) ", "not for a requeue; the same command resumes it")
                    if status == EXIT_STOPPED else ("", "requeue to resume with run.resume=auto"))
    print(f"stopped on request {signal}at epoch {state['epoch'] + 1}, micro-batch "
          f"{state['position']}: checkpoint complete, exit status {status} ({then})",
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
                  if counts_tokens(cfg) else {}),
               "history": history, "memory": memory,
               "writer_rank": writer_rank}  # the rank that wrote every output of the run
    write_json_atomic(os.path.join(cfg.run.out_dir, "summary.json"), summary)
    print(f"done in {fmt_time(wall)}: val acc {summary['val_acc']:.4f} "
          f"(best {summary['best_val_acc']:.4f}); outputs in {cfg.run.out_dir}", file=sys.stderr)

