"""Run the trainer until it has resumed from its checkpoint, save what every worker then holds,
and stop before training: the state "right after resuming" on this run's layout.

Usage: [mpirun -n N] python tests/programs/resume_dump.py DUMP_DIR CONFIG.yaml [--set key=value ...]
Writes DUMP_DIR/replica{r}/stage{s}.pt (checkpoint.save_blocks: network names) for every worker
and DUMP_DIR/resumed.json (the trainer state, the layout and its reported changes) from rank 0.
"""
import json
import os
import sys

from petra_mpi import train
from petra_mpi.run import trainer
from petra_mpi.run.checkpoint import save_blocks
from petra_mpi.config import load_config, validate
from petra_mpi.comm.world import World


class Resumed(Exception):
    """Raised on every rank once its workers hold the checkpoint: ends the run there."""


def main():
    dump, args = sys.argv[1], train.parse_args(sys.argv[2:])
    world = World.from_environment()
    cfg = load_config(args.config, args.set)
    validate(cfg, world.size if world else 1)
    resume_from = trainer.resume_from

    def resume_and_dump(path, identity, layout, workers, device):
        state, changes = resume_from(path, identity, layout, workers, device)
        for i, w in enumerate(workers):  # in one process: replica after replica
            replica = world.replica if world else i // layout["stages"]
            save_blocks(os.path.join(dump, f"replica{replica}"), w)
        if world is None or world.rank == 0:
            with open(os.path.join(dump, "resumed.json"), "w") as f:
                json.dump({"state": state, "layout": layout, "changes": changes,
                           "steps": workers[0].optimizer.steps}, f)
        raise Resumed

    trainer.resume_from = resume_and_dump  # Trainer looks it up at its start
    try:
        train.run(cfg, world)
    except Resumed:
        pass
    else:
        sys.exit("the run did not resume from a checkpoint")
    if world:
        world.barrier()


if __name__ == "__main__":
    main()
