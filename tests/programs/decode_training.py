"""Train stage 0 of a small net on GPU-decoded JPEGs and save its parameters
(tests/e2e/test_gpu.py).

Usage: python tests/programs/decode_training.py OUT.pt SYNC   (SYNC 1: torch.cuda.synchronize()
before every decode, the reference the stream-safe decode must match bitwise)
"""
import os
import sys
import tempfile

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # before cuBLAS starts

import torch  # noqa: E402

from petra_mpi.perf.bench.data import _write_jpeg_demo  # noqa: E402
from petra_mpi.data import BatchLoader, open_split  # noqa: E402
from petra_mpi.data import augment
from petra_mpi.core.planner import plan_layout  # noqa: E402
from petra_mpi.engines.build import StageSpec, build_stages, build_workers  # noqa: E402
from petra_mpi.models import NetSpec  # noqa: E402
from petra_mpi.engines.local import LocalEngine  # noqa: E402
from petra_mpi.core.optim import LRSchedule  # noqa: E402


def main(out, sync):
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.benchmark = False
    augment.SYNC_BEFORE_DECODE = sync
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "jpeg.h5")
        _write_jpeg_demo(path, n=192, side=96)
        src = open_split(path, "train")
        loader = BatchLoader(src, 16, train=True, seed=0, device="cuda", crop=32, prefetch=2)
        assert loader._gpu_decode, "torchvision GPU decode not in use"
        net = NetSpec("revnet18", 8, 1000)
        stages = build_stages(StageSpec(net, device="cuda"), plan_layout(net, 3))
        workers = build_workers(stages, LRSchedule(0.2, 10**6), 1, weight_decay=5e-4)
        n = len(loader)
        LocalEngine(workers, "petra").train_segment(iter(loader), n)
        loader.close()
    torch.cuda.synchronize()
    torch.save([p.detach().cpu() for p in stages[0].parameters()], out)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2] == "1")
