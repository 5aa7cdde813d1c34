"""Run outputs: metrics.jsonl, summary.json, a progress bar, and per-stage memory figures."""
import json
import math
import os
import sys
import time


def fmt_time(seconds: float) -> str:
    seconds = int(max(0, seconds))
    h, rest = divmod(seconds, 3600)
    return f"{h}:{rest // 60:02d}:{rest % 60:02d}" if h else f"{rest // 60}:{rest % 60:02d}"


class Progress:
    """One status line on stderr: redrawn in place on a terminal (at most 5 times a second),
    else (a log file) printed as a new line every `interval_s` seconds and once at the end, so
    that a long batch job's log holds a line per interval, not one per handful of updates."""

    def __init__(self, total: int, label: str, enabled: bool = True, stream=None,
                 interval_s: float = 30.0):
        self.total, self.label, self.enabled = total, label, enabled
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self.interval_s = 0.2 if self.tty else interval_s
        self.start = self.last_print = time.perf_counter()
        self.done = 0

    def advance(self, n: int = 1, **fields):
        self.update(self.done + n, **fields)

    def update(self, done: int, **fields):
        """`done` of `total` finished; `fields` are shown after the count."""
        self.done = done
        now = time.perf_counter()
        if self.enabled and (now - self.last_print >= self.interval_s or done >= self.total):
            self.last_print = now
            self._print(now, fields)

    def _print(self, now, fields):
        elapsed = now - self.start
        rate = self.done / elapsed if elapsed > 0 else 0.0
        eta = (self.total - self.done) / rate if rate > 0 else 0.0
        filled = int(24 * self.done / max(1, self.total))
        extra = "".join(f" {k} {v:.4g}" if isinstance(v, float) else f" {k} {v}"
                        for k, v in fields.items())
        line = (f"{self.label} [{'#' * filled}{'.' * (24 - filled)}] {self.done}/{self.total} "
                f"{rate:.4g}/s{extra} elapsed {fmt_time(elapsed)} ETA {fmt_time(eta)}")
        self.stream.write(("\r" + line + "\x1b[K") if self.tty else line + "\n")
        self.stream.flush()

    def close(self):
        if self.enabled and self.tty:
            self.stream.write("\n")
            self.stream.flush()


class MetricsWriter:
    """Appends JSON lines to metrics.jsonl, flushed at once so a killed run keeps its history."""

    def __init__(self, out_dir: str, tensorboard: bool = False):
        os.makedirs(out_dir, exist_ok=True)
        self.path = os.path.join(out_dir, "metrics.jsonl")
        self.file = open(self.path, "a", buffering=1)
        self.tb = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
                self.tb = SummaryWriter(os.path.join(out_dir, "tensorboard"))
            except ImportError:
                print("run.tensorboard: the tensorboard package is not installed; writing "
                      "metrics.jsonl only", file=sys.stderr)

    def write(self, event: str, **fields):
        record = {"event": event, "time": round(time.time(), 3)}
        record.update({k: _plain(v) for k, v in fields.items()})
        self.file.write(json.dumps(record) + "\n")
        if self.tb is not None and "step" in fields:
            suffix = f"/stage{fields['stage']}" if "stage" in fields else ""
            for key, value in fields.items():
                if isinstance(value, (int, float)) and key not in ("step", "stage", "epoch"):
                    self.tb.add_scalar(f"{event}/{key}{suffix}", value, fields["step"])

    def close(self):
        self.file.close()
        if self.tb is not None:
            self.tb.close()


def _plain(v):
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    return v


def stage_memory(stage, optimizer) -> dict:
    """Bytes held by one stage: parameters, optimizer state, input FIFO peak, stashed-weight peak,
    and the device's peak allocation when on CUDA."""
    import torch

    def nbytes(tensors):
        return sum(t.numel() * t.element_size() for t in tensors)

    opt_state = []
    if optimizer.torch_optimizer is not None:
        for state in optimizer.torch_optimizer.state.values():
            opt_state += [v for v in state.values() if torch.is_tensor(v)]
    params = list(stage.parameters())
    device = params[0].device if params else torch.device("cpu")
    return {
        "stage": stage.index,
        "blocks": len(stage.blocks),
        "reversible_blocks": sum(b.reversible for b in stage.blocks),
        "param_bytes": nbytes(params) + nbytes(stage.buffers()),
        "optimizer_bytes": nbytes(opt_state),
        "input_fifo_peak_bytes": stage.peak_fifo_bytes,
        "stash_peak_bytes": stage.peak_stash_bytes,
        "kept_peak_bytes": stage.peak_kept_bytes,  # model.memory_budget's kept graphs
        "device_peak_bytes": (torch.cuda.max_memory_allocated(device) if device.type == "cuda"
                              else None),
    }
