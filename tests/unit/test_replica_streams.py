"""Stochastic rounding draws from a random stream per sender, seeded from the run's seed, the
stage, the replica and the direction (docs/design.md): the FIFO entries that buffered blocks keep
(comm.buffers) too, so two replicas never round their FIFOs with the same random numbers."""
import torch

from tests.support.paths import QUICK
from petra_mpi import train
from petra_mpi.comm.compress import Compression
from petra_mpi.engines import local
from tests.support.nets import stages_of

STOCHASTIC = Compression(buffers="int8", stochastic=True, seed=5)


def test_build_stages_seeds_each_replicas_fifo_stream():
    seeds = {}
    for replica in (0, 1):
        for stage in stages_of("revnet18", 4, 10, 3, seed=0, compression=STOCHASTIC,
                                  replica=replica):
            codec = stage.buffer_codec
            assert codec.stochastic and codec.fmt == "int8"
            assert codec.seed == STOCHASTIC.codec("buffers", stage.index, replica).seed
            seeds[(replica, stage.index)] = codec.seed
    assert len(set(seeds.values())) == 6, seeds  # every stage of every replica its own


def test_one_process_replicas_round_their_fifos_with_their_own_streams(tmp_path, monkeypatch):
    """The trainer with two replicas in one process: each worker's FIFO stream is that of its
    own stage and replica, like the streams of the messages it sends."""
    engines = []

    class Recorded(local.LocalEngine):
        def __init__(self, *args, **kw):
            super().__init__(*args, **kw)
            engines.append(self)

    monkeypatch.setattr(local, "LocalEngine", Recorded)
    threads = torch.get_num_threads()
    try:
        code = train.main(["configs/quickstart.yaml", *QUICK, "--set", f"run.out_dir={tmp_path}",
                           "--set", "model.stages=2", "--set", "train.replicas=2",
                           "--set", "train.limit_batches=2", "--set", "data.synthetic_val=16",
                           "--set", "comm.buffers=int8", "--set", "comm.stochastic=true",
                           "--set", "run.threads=1", "--set", "model.balance=estimate"])
    finally:
        torch.set_num_threads(threads)
    assert code == 0
    (engine,) = engines
    compression = Compression(buffers="int8", stochastic=True, seed=0)  # quickstart: run.seed 0
    assert len(engine.workers) == 4
    for i, w in enumerate(engine.workers):
        stage, replica = i % 2, i // 2
        assert w.stage.buffer_codec.seed == compression.codec("buffers", stage, replica).seed, i
