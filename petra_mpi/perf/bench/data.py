"""Benchmark of the training-time reader: images/s of the BatchLoader on a fixed core budget.

    python -m petra_mpi.bench data FILE|synthetic [--batch 64] [--seconds 5] [--threads 1]
                                                 [--jpeg-demo] [--crop 224]
                                                 [--decode-workers N] [--decode-pool both]
                                                 [--device cuda] [--pipeline ARCH]

32x32 ("array") data: the raw reader (sorted random batches), then the full loader (read +
prefetch thread + crop/flip + uint8->normalised float), train and eval. `synthetic` measures the
in-memory set and an HDF5 copy of it written to a temporary file, chunked like the packers write;
a FILE is timed as opened (small splits are loaded whole) and streamed from the file (the
headline `images_per_s`: what an ImageNet32-sized split gets). JPEG data (a JPEG-variant FILE, or --jpeg-demo for a
generated set of 256-pixel JPEGs): read + decode + crop alone (the prefetch thread's work, with
`--decode-workers` threads and/or processes, `--decode-pool`), then the whole loader on the CPU (flip and normalisation of
224x224 floats add ~0.5 ms per image there; on a GPU they run on the device).
`--device cuda`: the loaders deliver to the GPU (JPEG through nvJPEG when torchvision has it).
`--pipeline ARCH`: also what a PETRA pipeline of ARCH consumes at the loader's output size (its
slowest stage's measured cost per micro-batch), next to what the training loader delivers.
The process is pinned to `--threads` cores (the prefetch thread shares them) and torch uses as
many threads. The last line printed is one JSON object.
"""
import argparse
import io
import json
import os
import resource
import tempfile
import time

import h5py
import numpy as np
import torch
from PIL import Image

from petra_mpi.data import BatchLoader, open_split
from petra_mpi.data import augment as A
from petra_mpi.comm.devices import synchronize


def _pin_cores(n):
    """Restrict this process to n cores (where the OS lets us), so 'one core' means one core."""
    if not hasattr(os, "sched_setaffinity"):
        return None
    cores = sorted(os.sched_getaffinity(0))[:n]
    os.sched_setaffinity(0, cores)
    return cores


def cpu_seconds():
    """CPU seconds used so far by this process (all its threads) and by every process below it
    (a process decode pool's workers, its forkserver), or None where /proc cannot tell.

    Living descendants are read from /proc (getrusage(RUSAGE_CHILDREN) counts only children
    that have exited and been waited for); those that exited are in RUSAGE_CHILDREN."""
    if not os.path.isdir("/proc/self/task"):
        return None
    parent_of, times = {}, {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as fh:
                fields = fh.read().rsplit(")", 1)[1].split()
        except OSError:  # gone meanwhile
            continue
        # after the command name: state, ppid, ..., utime and stime are the 12th and 13th
        parent_of[int(entry)] = int(fields[1])
        times[int(entry)] = int(fields[11]) + int(fields[12])
    me, below = os.getpid(), set()
    for pid in parent_of:
        chain, p = [], pid
        while p in parent_of and p not in below and p != me:
            chain.append(p)
            p = parent_of[p]
        if p == me or p in below:
            below.update(chain)
    living = sum(times[p] for p in below) / os.sysconf("SC_CLK_TCK")
    exited = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.process_time() + living + exited.ru_utime + exited.ru_stime


def _timed(step, seconds):
    """Call step() (which returns an image count) until `seconds` pass. Returns images per
    wall second, images per CPU second of this process and its worker processes (robust to
    other processes sharing the cores; None where the workers' CPU time cannot be read), and
    wall seconds per call."""
    step()  # warm-up: opens files, first permutation, allocator
    images, calls, t0, c0 = 0, 0, time.perf_counter(), cpu_seconds()
    while True:
        images += step()
        calls += 1
        dt = time.perf_counter() - t0
        if dt >= seconds:
            c1 = cpu_seconds()
            cpu_ips = None if c0 is None or c1 is None else images / max(c1 - c0, 1e-9)
            return images / dt, cpu_ips, dt / calls


def _loader_step(loader):
    """A step() that yields the next batch of a loader, moving on to the next epoch at the end."""
    state = {"it": iter(loader)}

    def step():
        try:
            x, _ = next(state["it"])
        except StopIteration:
            loader.set_epoch(loader.epoch)  # already rolled over to the next epoch
            state["it"] = iter(loader)
            x, _ = next(state["it"])
        synchronize(x.device)  # the batch counts once its device work (decode, crop) is done
        return len(x)
    return step


def _load_step(loader):
    """The prefetch thread's work alone for one batch: read, decode, crop (JPEG)."""
    state = {"b": 0}

    def step():
        b = state["b"] % len(loader)
        state["b"] += 1
        return len(loader._load(loader.epoch, b)["labels"])
    return step


def _reader_step(src, loader):
    state = {"b": 0}

    def step():
        b = state["b"] % len(loader)
        state["b"] += 1
        images, _ = src.take(loader.batch_indices(b))
        return len(images)
    return step


def _write_h5_copy(src, path):
    """An HDF5 copy of an in-memory split, chunked as the packers write 32x32 data."""
    images, labels = src.read(0, len(src))
    with h5py.File(path, "w") as f:
        f.attrs.update(schema_version=1, num_classes=src.num_classes, mean=src.mean, std=src.std,
                       source="bench copy of synthetic")
        f.create_dataset("train/images", data=images, chunks=(256,) + images.shape[1:])
        f.create_dataset("train/labels", data=labels)


def _write_jpeg_demo(path, n=256, side=256, seed=0):
    """n JPEGs with shorter side `side` and ImageNet-like aspect ratios and textures."""
    rng = np.random.default_rng(seed)
    blobs = []
    for _ in range(n):
        long = int(side * rng.uniform(1.0, 1.5))
        w, h = (long, side) if rng.random() < 0.7 else (side, long)
        yy, xx = np.mgrid[0:h, 0:w].astype(np.float32)
        f = rng.uniform(0.01, 0.08, 3)
        img = 128 + 60 * np.stack([np.sin(f[c] * (xx * np.cos(c + f[c] * 30) + yy * np.sin(c)))
                                   for c in range(3)], -1)
        img += rng.normal(0, 12, img.shape)  # texture: real photos do not compress to nothing
        buf = io.BytesIO()
        Image.fromarray(np.clip(img, 0, 255).astype(np.uint8)).save(buf, format="JPEG", quality=90)
        blobs.append(buf.getvalue())
    offsets = np.concatenate([[0], np.cumsum([len(b) for b in blobs])]).astype(np.int64)
    with h5py.File(path, "w") as f:
        f.attrs.update(schema_version=1, num_classes=1000, mean=(0.485, 0.456, 0.406),
                       std=(0.229, 0.224, 0.225), source="bench jpeg demo", image_size=side)
        f.create_dataset("train/jpeg", data=np.frombuffer(b"".join(blobs), np.uint8),
                         chunks=(64 << 10,))
        f.create_dataset("train/offsets", data=offsets)
        f.create_dataset("train/labels", data=np.zeros(n, np.int64))
    return int(offsets[-1]) / n


def _pipeline_rate(arch, width, stages, side, num_classes, batch, device, imagenet_stem):
    """(images/s the PETRA pipeline of `arch` consumes, its split): one micro-batch enters per
    tick, and a tick lasts as long as the slowest stage, timed block by block on `device`
    (blockcost.py) at the loader's output side and balanced by those times (planner.py). Each
    stage is costed on this process's threads, as if every rank had as many."""
    from petra_mpi.core.blockcost import measure_net_costs
    from petra_mpi.core.planner import plan_layout
    from petra_mpi.models import NetSpec, num_blocks
    stages = stages or num_blocks(arch)
    net = NetSpec(arch, width, num_classes, imagenet_stem, side)
    costs = measure_net_costs(net, batch, device=device)
    sizes = plan_layout(net, stages, costs=costs).split
    return batch / max(costs.stage_seconds(sizes)), sizes


def main(argv):
    a = parse_args(argv)
    report(a, run(a))


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m petra_mpi.bench data", description=__doc__.split("\n")[0])
    p.add_argument("file", help="an HDF5 dataset file, or 'synthetic'")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--seconds", type=float, default=5.0, help="per measurement")
    p.add_argument("--threads", type=int, default=1, help="cores (and torch threads) to use")
    p.add_argument("--jpeg-demo", action="store_true", help="also time a generated JPEG set")
    p.add_argument("--crop", type=int, default=224, help="JPEG output side")
    p.add_argument("--decode-workers", type=int, default=0,
                   help="JPEG decode workers (0: --threads)")
    p.add_argument("--decode-pool", choices=["thread", "process", "both"], default="both",
                   help="what runs the JPEG decode workers (both: side by side)")
    p.add_argument("--synthetic-n", type=int, default=20_000, help="train size of 'synthetic'")
    p.add_argument("--pipeline", metavar="ARCH",
                   help="also time what a PETRA pipeline of ARCH consumes (e.g. revnet50), "
                        "fed the loader's output, to compare with what the loader delivers")
    p.add_argument("--pipeline-width", type=int, default=64)
    p.add_argument("--pipeline-stages", type=int, default=0, help="0: one block per stage")
    p.add_argument("--device", default="cpu",
                   help="where the loaders deliver (cuda: JPEG decoded by nvJPEG when "
                        "torchvision has it, augmentation on the GPU)")
    return p.parse_args(argv)


class Measurements:
    """The figures (the JSON line) and the table rows of a run, filled measurement by
    measurement."""

    def __init__(self, seconds, figures):
        self.seconds, self.figures, self.rows, self.notes = seconds, figures, [], []

    def measure(self, name, step, key=None):
        ips, cpu_ips, per_call = _timed(step, self.seconds)
        if key:
            self.figures[key] = round(ips, 1)
            if cpu_ips is not None:
                self.figures[key.replace("images_per_s", "images_per_cpu_s")] = round(cpu_ips, 1)
        self.rows.append((name, ips, cpu_ips, per_call))


def run(a) -> dict:
    """Time every reader and loader the data allows; {"figures": the JSON line's object,
    "rows": (name, images/s, images/CPU-s or None, s/batch) of the table, "notes": lines}."""
    device = torch.device(a.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device is visible")
    torch.set_num_threads(a.threads)
    cores = _pin_cores(a.threads)
    m = Measurements(a.seconds, {"bench": "data", "file": a.file, "batch": a.batch,
                                 "threads": a.threads, "cores": cores, "device": str(device)})
    with tempfile.TemporaryDirectory() as tmp:
        src = open_split(a.file, "train", synthetic_sizes=(a.synthetic_n, a.synthetic_n // 5))
        for label, s in _array_streams(a, src, tmp):
            _time_array_loaders(a, m, label, s, device)
        jpeg_src = src if src.kind == "jpeg" else None
        if jpeg_src is None and a.jpeg_demo:
            path = os.path.join(tmp, "jpeg_demo.h5")
            kb = _write_jpeg_demo(path) / 1024
            m.notes.append(f"(jpeg demo: 256 generated JPEGs, shorter side 256, {kb:.0f} KiB "
                           f"each)")
            jpeg_src = open_split(path, "train")
        if jpeg_src is not None:
            _time_jpeg_loaders(a, m, jpeg_src, device)
        if a.pipeline:
            _time_pipeline(a, m, src, jpeg_src, device)
    return {"figures": m.figures, "rows": m.rows, "notes": m.notes}


def _array_streams(a, src, tmp):
    """(label, source) of the 32x32 data to time: in memory and streamed from HDF5."""
    if src.kind != "array":
        return []
    if a.file == "synthetic":
        copy = os.path.join(tmp, "synthetic.h5")
        _write_h5_copy(src, copy)
        return [("memory", src), ("hdf5", open_split(copy, "train", in_memory=False))]
    # as opened (loaded whole when small), and streamed from the file
    streams = [("memory", src)] if src.in_memory else []
    return streams + [("hdf5", open_split(a.file, "train", in_memory=False))]


def _time_array_loaders(a, m, label, s, device):
    key = "" if label == "hdf5" else "memory_"
    probe = BatchLoader(s, a.batch, train=True, seed=0)
    m.measure(f"[{label}] reader only (take of a sorted batch)", _reader_step(s, probe),
              f"{key}reader_images_per_s")
    for name, kw, k in [("train loader: read+crop+flip+normalise", dict(train=True), "images_per_s"),
                        ("train loader, no prefetch thread", dict(train=True, prefetch=0), "noprefetch_images_per_s"),
                        ("eval loader: read+normalise", dict(train=False), "eval_images_per_s")]:
        ld = BatchLoader(s, a.batch, seed=0, device=device, **kw)
        m.measure(f"[{label}] {name}", _loader_step(ld), key + k)
        ld.close()


def _time_jpeg_loaders(a, m, jpeg_src, device):
    gpu_decode = A.has_gpu_decode(device)  # as the loader decides (BatchLoader)
    m.figures["jpeg_gpu_decode"] = gpu_decode
    workers = a.decode_workers or a.threads
    pools = ["thread", "process"] if a.decode_pool == "both" else [a.decode_pool]
    for train, what, k in [(True, f"random-resized-crop {a.crop}", "jpeg"),
                           (False, f"centre crop {a.crop}", "jpeg_eval")]:
        for pool in pools:
            tag = "" if pool == "thread" else "process_"
            ld = BatchLoader(jpeg_src, min(a.batch, len(jpeg_src)), train=train, seed=0,
                             crop=a.crop, decode_threads=workers, decode_pool=pool,
                             device=device)
            m.measure(f"[jpeg] read + decode + {what} ({workers} {pool} workers)", _load_step(ld),
                      f"{k}_{tag}decode_images_per_s")
            m.measure(f"[jpeg]   loader: + flip + normalise ({device}, {pool} pool"
                      + (", nvJPEG decode)" if gpu_decode else ")"),
                      _loader_step(ld), f"{k}_{tag}images_per_s")
            ld.close()
    m.figures["jpeg_crop"] = a.crop
    m.figures["decode_workers"] = workers


def _time_pipeline(a, m, src, jpeg_src, device):
    """What the pipeline consumes next to what the training path's whole loader delivers: JPEG
    when there is one, else the 32x32 reader."""
    jpeg = jpeg_src is not None
    fed = jpeg_src if jpeg else src
    side = a.crop if jpeg else src.image_size
    keys = ("jpeg_images_per_s", "jpeg_process_images_per_s") if jpeg else ("images_per_s",)
    delivered = max(m.figures[k] for k in keys if k in m.figures)  # the faster decode pool
    rate, sizes = _pipeline_rate(a.pipeline, a.pipeline_width, a.pipeline_stages, side,
                                 fed.num_classes, a.batch, device, imagenet_stem=jpeg)
    rate = round(rate, 1)
    m.figures.update(pipeline=a.pipeline, pipeline_split=sizes, pipeline_images_per_s=rate,
                     loader_over_pipeline=delivered / rate)
    m.notes.append(f"pipeline {a.pipeline} width {a.pipeline_width}, {len(sizes)} stages "
                   f"{sizes}, micro-batch {a.batch}, {side}x{side} on {device}: consumes "
                   f"{rate:.0f} images/s; the loader delivers {delivered:.0f} "
                   f"({delivered / rate:.2f}x)")


def report(a, r: dict):
    fig = r["figures"]
    print(f"data bench: {a.file}, batch {a.batch}, {a.threads} core(s) {fig['cores']}, "
          f"{a.seconds:g} s per row, loaders deliver to {fig['device']}")
    print(f"  {'':<46s} {'images/s':>9s} {'img/cpu-s':>9s} {'ms/batch':>9s}")
    for name, ips, cpu_ips, per_call in r["rows"]:
        cpu = "-" if cpu_ips is None else f"{cpu_ips:.0f}"
        print(f"  {name:<46s} {ips:>9.0f} {cpu:>9s} {per_call * 1e3:9.2f}")
    for note in r["notes"]:
        print(f"  {note}")
    print(json.dumps(fig))
