"""A run's checkpoints: what one must share with the run that resumes it (its identity), what it
may differ in (its layout, reported when it does), and the collective, atomic write of one."""
from .checkpoint import (LAYOUT_FREE, block_files, checkpoint_dir, invalidate, prune, save_blocks,
                         write_manifest)
from ..config import model_kwargs
from .watchdog import CHECKPOINT_GRACE_S
from ..core import trace


def describe_run(cfg, placement, partition, microbatches_per_epoch, steps_per_epoch, peak_lr,
                 image_size, kept=None):
    """(identity, layout, manifest head) of a run; kept: its kept plan (layout.choose_layout;
    None: PETRA), recorded with model.memory_budget, under which a resumed run trains it again,
    and model.rebuild_last_stage (a resumed run follows its own, and says when it changed)."""
    # What a checkpoint must share with this run: the model, the data and the recipe (the
    # sampler position and the learning-rate schedule depend on the batch size, k, the seed).
    identity = {"arch": cfg.model.arch, "width": cfg.model.width,
                "num_classes": cfg.model.num_classes, "stem": cfg.model.stem,
                "method": cfg.train.method, "buffer_inputs": cfg.train.buffer_inputs,
                "stash_weights": cfg.train.stash_weights, "batch_size": cfg.data.batch_size,
                "accumulation": cfg.train.accumulation, "seed": cfg.run.seed,
                "data": cfg.data.path, "optimizer": cfg.optim.name,
                "lr_schedule": cfg.optim.schedule, **model_kwargs(cfg)}
    # What it may differ in: reported at start-up when it does.
    layout = {"stages": placement.J, "partition": partition, "kept": kept,
              "memory_budget": cfg.model.memory_budget,
              "rebuild_last_stage": cfg.model.rebuild_last_stage, "replicas": placement.R,
              "microbatches_per_epoch": microbatches_per_epoch,
              "steps_per_epoch": steps_per_epoch, "peak_lr": peak_lr,
              "device": placement.device.type, "dtype": cfg.run.dtype,
              "precision": cfg.run.precision}
    # The arguments of models.build_network: the plain model an export builds.
    network = {"arch": cfg.model.arch, "width": cfg.model.width,
               "num_classes": cfg.model.num_classes,
               "imagenet_stem": cfg.model.stem == "imagenet", "image_size": image_size,
               **model_kwargs(cfg)}
    head = {**identity, **layout, "format": LAYOUT_FREE, "network": network,
            "block_files": block_files(partition), "config": cfg.to_dict()}
    return identity, layout, head


class RunCheckpoints:
    """Writes the run's checkpoints: every rank of replica 0 its stages' files, the writing rank
    the manifest (which makes the checkpoint complete) and the pruning."""

    def __init__(self, cfg, world, placement, pipeline_workers, manifest_head, writer, tracer,
                 watchdog):
        self.cfg, self.world, self.placement = cfg, world, placement
        self.pipeline_workers, self.manifest_head = pipeline_workers, manifest_head
        self.writer, self.tracer, self.watchdog = writer, tracer, watchdog

    def save(self, epoch: int, position: int, trainer_state):
        """Write the checkpoint of (epoch, position) atomically; collective. trainer_state(): the
        trainer's part, read once the stage files are in place."""
        with self.tracer.span(trace.CHECKPOINT), \
                self.watchdog.collective("checkpoint", CHECKPOINT_GRACE_S):
            self._write(epoch, position, trainer_state)

    def _write(self, epoch, position, trainer_state):
        world, cfg = self.world, self.cfg
        path = checkpoint_dir(cfg.run.out_dir, epoch, position)
        if self.placement.rank == 0:
            invalidate(path)
        if world:
            world.barrier()
        files = ([save_blocks(path, w) for w in self.pipeline_workers]
                 if self.placement.replica == 0 else [])
        if world:
            files = world.gather_to_writer(files)  # also: every stage file is in place
        if self.writer:
            write_manifest(path, self.manifest_head, trainer_state(), dict(files))
            prune(cfg.run.out_dir, cfg.run.keep_checkpoints)
            self.writer.write("checkpoint", path=path, epoch=epoch, position=position)
        if world:
            world.barrier()  # the checkpoint is complete when any rank returns
