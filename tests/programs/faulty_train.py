"""Run the real trainer with one rank made to fail or stall mid-run (for the fault and watchdog
tests): its forward of one micro-batch raises, sleeps far longer than any test's
run.watchdog_s, or kills its own process with SIGKILL as an OOM killer would (fail, stall,
kill), or it sleeps in its first stop vote at a drain instead of voting
(stall-vote, MICROBATCH unused): the other ranks then wait inside that collective. At the end
of the run (MICROBATCH unused; RANK the writing rank): stall-end sleeps instead of writing the
summary, with no grace beyond run.watchdog_s for the end; late-summary writes it 2 s late, and
every rank writes to OUT_DIR/summary_at_exit.RANK whether summary.json was there as it left.
hold-vote (MICROBATCH an epoch, counted from 1): at its first stop vote of that epoch (the one
after the epoch's training, when it trains in one segment), RANK writes OUT_DIR/at_the_vote and
waits until it is killed instead of voting: the other ranks wait for it in that stop vote.

Usage: mpirun -n J python tests/programs/faulty_train.py
       (fail|stall|kill|stall-vote|stall-end|late-summary|hold-vote) RANK MICROBATCH CONFIG
       [--set ...]
"""
import os
import signal
import sys
import time

from mpi4py import MPI

from petra_mpi import train
from petra_mpi.run import trainer
from petra_mpi.core.worker import StageWorker

fault, fault_rank, fault_b = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
assert fault in ("fail", "stall", "kill", "stall-vote", "stall-end", "late-summary",
                 "hold-vote"), fault
rank = MPI.COMM_WORLD.Get_rank()
if fault in ("stall-end", "late-summary"):
    write_summary, pause = trainer.write_summary, 3600 if fault == "stall-end" else 2

    def late_summary(*args, **kwargs):
        time.sleep(pause)
        write_summary(*args, **kwargs)

    if rank == fault_rank:
        trainer.write_summary = late_summary
    trainer.END_GRACE_S = 0.0
if fault == "late-summary":
    status = train.main(sys.argv[4:])
    out_dir = next(a.split("=", 1)[1] for a in sys.argv if a.startswith("run.out_dir="))
    with open(os.path.join(out_dir, f"summary_at_exit.{rank}"), "w") as f:
        f.write(str(os.path.exists(os.path.join(out_dir, "summary.json"))))
    sys.exit(status)
if rank == fault_rank and fault == "hold-vote":
    vote = trainer.Trainer.vote

    def hold_at_the_vote(self):
        if self.epoch + 1 == fault_b:
            open(os.path.join(self.cfg.run.out_dir, "at_the_vote"), "w").close()
            while True:
                time.sleep(3600)
        return vote(self)

    trainer.Trainer.vote = hold_at_the_vote
if MPI.COMM_WORLD.Get_rank() == fault_rank and fault == "stall-vote":
    def agree(world, interrupts):
        time.sleep(3600)

    trainer.agree = agree
elif MPI.COMM_WORLD.Get_rank() == fault_rank and fault in ("fail", "stall", "kill"):
    original = StageWorker.forward

    def forward(self, b, x):
        if b == fault_b:
            if fault == "fail":
                raise RuntimeError(f"injected failure at micro-batch {b}")
            if fault == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(3600)
        return original(self, b, x)

    StageWorker.forward = forward
sys.exit(train.main(sys.argv[4:]))
