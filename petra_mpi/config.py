"""Run configuration: YAML files into dataclasses, `--set key.sub=value` overrides, validation.

A config file may name another one with `base: other.yaml` (relative to itself) and override some
of its keys. Unknown keys, wrong types and impossible values are errors that name the key and the
file, raised before any work starts.
"""
import dataclasses
import typing
from dataclasses import dataclass, field
from typing import Annotated, Literal
from pathlib import Path

import yaml

# No torch here (nor through these imports): every rank checks its config and the world size
# before it loads torch, which takes seconds per rank on a crowded node.
from .archs import LM_ARCHS, Arch, VIT_ARCHS, default_heads, is_import_path, num_blocks
# the schedules' table (pure data, no torch): train.method's choices are its names
from .core.schedule import SCHEDULES

Method = Literal[tuple(SCHEDULES)]


class ConfigError(ValueError):
    pass


@dataclass(frozen=True)
class AtLeast:
    """Annotated[int or float, AtLeast(n)]: the loader rejects a value below n."""
    low: int


@dataclass(frozen=True)
class OrImportPath:
    """Annotated[Literal[...], OrImportPath()]: one of the names, or an import path
    "package.module:function" (model.arch: a network of one's own, models/own.py)."""


@dataclass
class RunConfig:
    out_dir: str = "runs/default"
    """Directory for metrics.jsonl, summary.json and checkpoints/."""
    seed: int = 0
    """Seed of the weights, the sampler and the augmentation."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """auto (cuda when available), cpu or cuda."""
    dtype: Literal["float32", "float64"] = "float32"
    """float32 or float64 (float64 for exactness checks)."""
    precision: Literal["fp32", "bf16"] = "fp32"
    """fp32, or bf16: each block computes under bfloat16 autocast while the tensors between
    blocks and both coupling streams stay float32 (so rebuilding a reversible stage's input
    still cancels to float32 rounding); needs run.dtype float32."""
    threads: Annotated[int, AtLeast(0)] = 0
    """torch CPU threads per rank; 0 gives each rank its share of the node's cores."""
    keep_freed_memory: bool = True
    """glibc's malloc keeps the memory it frees instead of returning it to the OS and faulting it
    back in at the next micro-batch (mallopt; as `bench --allocator glibc-keep`): kept blocks'
    graphs, allocated in one tick and freed ticks later, cost what they should (docs/design.md).
    Nothing changes under another allocator (LD_PRELOAD) or MALLOC_* variables of your own."""
    progress: bool = True
    """Progress bar on the rank that computes the loss (one line per epoch when off)."""
    progress_interval_s: Annotated[float, AtLeast(0)] = 30.0
    """When stderr is not a terminal (a batch job's log): seconds between two progress lines;
    each epoch's end has its line too (0: a line per micro-batch). A terminal keeps the live
    bar, redrawn in place."""
    log_every: Annotated[int, AtLeast(1)] = 10
    """Write a train line to metrics.jsonl every this many optimizer steps."""
    tensorboard: bool = False
    """Also write TensorBoard events (when the tensorboard package is installed)."""
    resume: str = "auto"
    """auto (the newest complete checkpoint in out_dir/checkpoints, or a fresh start), none (a
    fresh start; an error if out_dir already holds checkpoints) or a checkpoint directory."""
    checkpoint_every: Annotated[int, AtLeast(0)] = 1
    """Checkpoint every this many epochs (0: only at the end and on SIGUSR1/SIGTERM)."""
    checkpoint_every_microbatches: Annotated[int, AtLeast(0)] = 0
    """Also drain and checkpoint every this many micro-batches within an epoch (0: never); for
    epochs that outlast a job's time limit."""
    checkpoint_every_minutes: Annotated[float, AtLeast(0)] = 0.0
    """Also drain and checkpoint when this many minutes of wall time have passed since the last
    checkpoint (0: never), so that a lost node or a preemption without warning costs at most
    that much training; rank 0's clock decides, through the stop vote."""
    keep_checkpoints: Annotated[int, AtLeast(1)] = 2
    """Complete checkpoints kept; older ones are deleted."""
    watchdog_s: typing.Optional[Annotated[float, AtLeast(0)]] = None
    """Under MPI: a rank that makes no progress (no scheduled action starts) for this many seconds
    prints its last action and pending messages and ends the job with exit status 5 (a lost node
    or a hang; docs/running.md). None: 20 times the slowest gap between two actions so far, at
    least 120 s; 0: off."""
    startup_s: Annotated[float, AtLeast(0)] = 600.0
    """Under a launcher (mpirun, srun): a rank whose start-up (MPI's start, the device, opening
    the data, building the stages, loading a checkpoint, and every stage's first micro-batch)
    takes longer than this many seconds reports where it stood and exits with status 5, like
    the watchdog (docs/running.md); 0: not watched."""
    trace: bool = False
    """Write a per-rank timeline of this job (forward, backward, step, loss, MPI waits, planned
    ticks) to out_dir/trace.json in Chrome-trace format, for Perfetto; see docs/timeline.md."""


@dataclass
class ModelConfig:
    arch: Annotated[Arch, OrImportPath()] = "revnet18"
    """revnet18, revnet34, revnet50, resnet18, resnet34, resnet50, irevnet18, irevnet34, irevnet50
    (fully invertible RevNets: invertible downsampling, only the stem buffers its input), revvit
    (reversible vision transformer) or vit (its non-reversible twin), revlm or lm (causal
    language models); or a network of your own, the import path "package.module:function" of
    a function that takes this model section and returns its blocks in order (docs/own_model.md;
    python -m petra_mpi.check_model checks them)."""
    width: Annotated[int, AtLeast(1)] = 64
    """Base channels per stream (64 in the paper); for revvit/vit the token features per stream
    (192 for a tiny ViT)."""
    depth: int = 8
    """revvit/vit: transformer blocks (the net has depth + 2 blocks: patch embedding and head)."""
    heads: int = 0
    """revvit/vit: attention heads, dividing model.width; 0: one per 64 features (at least 1)."""
    patch: int = 4
    """revvit/vit: patch side in pixels; must divide the image side."""
    context: Annotated[int, AtLeast(1)] = 64
    """revlm/lm: context length in tokens (the position embedding's size; the training windows
    have this length)."""
    tie_weights: bool = False
    """revlm/lm: the head's projection reuses the token embedding's table. One weight copy per
    stage allows it only when the embedding and the head share a stage (J = 1)."""
    num_classes: Annotated[int, AtLeast(2)] = 10
    """Classes of the head; must match the dataset. For revlm/lm the vocabulary size (the token
    file's `num_classes`: 256 for bytes)."""
    stem: Literal["cifar", "imagenet"] = "cifar"
    """cifar (3x3 conv) or imagenet (7x7 stride-2 conv and max-pool)."""
    options: dict = field(default_factory=dict)
    """A network of your own (model.arch an import path): settings of its own that its function
    reads from this section as it likes, e.g. {levels: 2}; recorded with its checkpoints and
    exports like the other keys that describe the net. Empty for the built-in archs."""
    stages: Annotated[int, AtLeast(0)] = 0
    """Number of stages J; 0: the MPI world size, or in one process the paper's split (one stage
    per block)."""
    partition: typing.Optional[list[int]] = None
    """Blocks per stage, e.g. [3, 3, 4]; default: one block per stage when the stage count equals
    the block count, else contiguous stages balanced as model.balance says."""
    balance: Literal["measure", "estimate"] = "measure"
    """How contiguous stages are balanced when J is smaller than the block count: measure (rank 0
    times every block at start-up on the run's device, dtype and batch, then the split minimises
    the slowest stage; a resumed run keeps its checkpoint's split) or estimate (a deterministic
    cost model of multiply-accumulates and activation sizes, no timing)."""
    memory_budget: typing.Union[int, float, str] = 0
    """petra: memory per stage for kept blocks, which keep the autograd graph of some in-flight
    micro-batches instead of rebuilding them (faster backward, more memory; docs/design.md §1):
    bytes (an int), a fraction of the device's memory (a float, e.g. 0.5), or `auto` (no limit);
    0: none kept (PETRA). `--dry-run` prints the plan."""
    rebuild_last_stage: bool = False
    """petra: the last stage holds no autograd graph between its forward and its backward but
    rebuilds its reversible blocks' inputs and recomputes its buffered blocks' forward in the
    backward, as the other stages do: one more forward per micro-batch on the last stage, which
    then holds only its buffered blocks' inputs of one micro-batch instead of the graph of its
    whole part (docs/design.md §1). `--dry-run` prints both."""
    compile: bool = False
    """Run every block's sub-modules (branches, shortcuts, stem, head) through torch.compile:
    the forward, the inverse and the rebuild with its backward all call them. Each graph is
    compiled once, at its first use (start-up takes longer: minutes on a CPU); inductor generates
    C++ on CPUs (a C++ compiler must be installed) and Triton kernels on GPUs. Results equal the
    eager ones to rounding, not bitwise (fused kernels sum in another order)."""


@dataclass
class DataConfig:
    path: str = "synthetic"
    """An HDF5 file in the schema of docs/design.md §2 (both splits), or `synthetic`."""
    batch_size: Annotated[int, AtLeast(1)] = 64
    """Images per micro-batch."""
    synthetic_train: Annotated[int, AtLeast(1)] = 10000
    """Training images of the built-in synthetic set."""
    synthetic_val: Annotated[int, AtLeast(1)] = 2000
    """Validation images of the built-in synthetic set."""
    synthetic_seed: int = 0
    """Seed of the synthetic set (train uses it, val uses it + 1), apart from run.seed so that
    runs with different seeds see the same data."""
    augment: bool = True
    """Random crop and flip on the training split."""
    crop: Annotated[int, AtLeast(0)] = 0
    """Side of the crops of JPEG-variant pictures (random-resized in training, centred in
    evaluation); 0: about 7/8 of the file's stored side (224 of 256, 28 of 32). A crop above
    the stored side upsamples every picture (a warning says so). Array files keep their size."""
    prefetch: Annotated[int, AtLeast(0)] = 2
    """Batches read ahead in the background."""
    decode_workers: Annotated[int, AtLeast(0)] = 0
    """JPEG decode workers of the reader (full-size ImageNet on the CPU); 0: the rank's CPU
    share, as its torch threads get (run.threads, else its affinity set divided among the ranks
    of its node that share it; under srun the task's --cpus-per-task)."""
    decode_pool: Literal["thread", "process"] = "thread"
    """thread or process: what runs the JPEG decode workers (see docs/gpu.md for figures)."""


@dataclass
class TrainConfig:
    method: Method = "petra"
    """petra, backprop (no delay, one stage busy at a time) or delayed (with the buffers below):
    the schedules of core/schedule.py (SCHEDULES)."""
    epochs: Annotated[int, AtLeast(1)] = 1
    """Passes over the training split."""
    accumulation: Annotated[int, AtLeast(1)] = 1
    """k: micro-batches whose averaged gradients make one optimizer step."""
    update_batch: Annotated[int, AtLeast(0)] = 0
    """Images per optimizer update (per replica), k micro-batches of data.batch_size: with it, k
    is derived (128 with data.batch_size 16: k = 8) and must come out whole. It states the
    intent behind k: stage s applies its gradients d_s / k updates late (d_s = 2(J - 1 - s)
    micro-batches), so the same images per update in smaller micro-batches shorten the delay
    without memory (docs/running.md, "Training deep pipelines"). The learning-rate rule and the
    schedule count updates as before (lr = base · batch · k / 256, steps of k micro-batches).
    These keep counting micro-batches, not updates: train.limit_batches,
    run.checkpoint_every_microbatches (a multiple of k), the evaluation's batches (of
    data.batch_size) and the progress line; run.log_every counts updates. train.accumulation
    set beside it (the same file or the same --set's) must agree; set in an earlier layer (a
    base file below it, or the file below the --set's), it gives way, as update_batch gives way
    to an accumulation set in a later one. 0: k is train.accumulation."""
    buffer_inputs: bool = False
    """delayed: reversible stages keep their input instead of rebuilding it."""
    stash_weights: bool = False
    """delayed: each in-flight micro-batch keeps the weights of its forward."""
    limit_batches: Annotated[int, AtLeast(0)] = 0
    """Train on at most this many micro-batches per epoch and replica (0: all); for smoke runs."""
    limit_eval_batches: Annotated[int, AtLeast(0)] = 0
    """Evaluate on at most this many batches (0: all)."""
    diag_every: Annotated[int, AtLeast(0)] = 0
    """Every this many optimizer steps, log gradient-quality diagnostics per stage (cosine and
    norm ratio of PETRA, delayed and end-to-end gradients, rebuild error); 0: off."""
    replicas: Annotated[int, AtLeast(0)] = 0
    """R: data-parallel replicas of the J-stage pipeline (rank = replica · J + stage). Each
    replica's stage 0 reads its own share of every epoch, each stage averages its gradients over
    the replicas at every optimizer step, and the learning-rate rule uses the effective batch
    R · k · data.batch_size. 0: under mpirun, the world size divided by model.stages (1 when
    model.stages is 0); in one process, 1. In one process R > 1 simulates the replicas one after
    the other (a reference for tests). See docs/clusters.md for choosing J and R."""


@dataclass
class OptimConfig:
    lr: Annotated[float, AtLeast(0)] = 0.1
    """Base learning rate; with scale_lr the peak is lr · batch_size · accumulation / 256."""
    scale_lr: bool = True
    """Apply the paper's rule lr = base · batch · k / 256."""
    momentum: Annotated[float, AtLeast(0)] = 0.9
    """SGD momentum (Nesterov)."""
    nesterov: bool = True
    """Nesterov momentum."""
    weight_decay: Annotated[float, AtLeast(0)] = 5e-4
    """L2 weight decay, never on batch-norm parameters and biases."""
    warmup_epochs: Annotated[float, AtLeast(0)] = 5.0
    """Linear warm-up from 0 to the peak learning rate over this many epochs."""
    milestones: list[int] = field(default_factory=list)
    """Epochs at which the learning rate is multiplied by gamma."""
    gamma: float = 0.1
    """Step-decay factor."""
    name: Literal["sgd", "adamw"] = "sgd"
    """sgd (Nesterov momentum, the paper's) or adamw (decoupled weight decay; for transformers)."""
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    """adamw: the two moment decay rates."""
    schedule: Literal["step", "cosine"] = "step"
    """step (decays at the milestones) or cosine (after warm-up, from the peak down to 0 at the
    end of the run; milestones are then unused)."""
    delay_momentum: Annotated[float, AtLeast(0)] = 0.0
    """Momentum by delay (docs/running.md, "Training deep pipelines"): each stage's momentum
    (SGD) or beta1 (AdamW) is backprop's less the implicit momentum of its gradients' delay D
    (steps): the mean age of an update's gradients, mu / (1 - mu), is reduced by this factor
    times D. 0: off; 1: the total age is backprop's; larger: towards momentum 0."""
    delay_momentum_lr: bool = False
    """SGD with delay_momentum: multiply each stage's learning rate by (1 - its momentum) / (1 -
    optim.momentum), so that every gradient keeps the total weight lr / (1 - momentum) it has in
    backprop (AdamW's beta1 keeps it by construction)."""
    delay_prediction: Annotated[float, AtLeast(0)] = 0.0
    """Weight prediction: each stage forwards with its weights extrapolated this factor times D
    steps ahead along the optimizer's velocity (the backward still uses the current weights).
    0: off. Costs one copy of the stage's weights."""
    delay_spike: bool = False
    """Spike compensation: a gradient D steps late gets at once the momentum contributions it
    missed, and its later ones are scaled by momentum^D."""
    delay_lr_epochs: Annotated[float, AtLeast(0)] = 0.0
    """Learning rate by delay (PipeMare): over this many epochs each stage's step grows from 1 / D
    to 1 times the schedule's (stages with D <= 1 unchanged). 0: off."""
    delay_free_momentum: typing.Optional[Annotated[float, AtLeast(0)]] = None
    """The momentum (SGD) or beta1 (AdamW) of the stage whose gradients are not late (D = 0: the
    last stage of petra and delayed), in place of the optimizer's; backprop keeps its own.
    0 lets PETRA's last stage follow at once the features its late stages keep moving. null:
    the optimizer's own."""


CommFormat = Literal["none", "bf16", "fp16", "int8", "int8_channel"]  # compress.py


@dataclass
class CommConfig:
    """How the stages talk, and the compression of what they send and store (docs/design.md,
    "Compressed messages"). Formats: none, bf16, fp16, int8 (one scale per tensor) or
    int8_channel (one per channel)."""
    transport: Literal["mpi", "torch"] = "mpi"
    """What carries the messages between ranks: mpi (mpi4py; started by mpirun or srun) or torch
    (torch.distributed: gloo between CPUs, NCCL between GPUs; started by torchrun, mpirun or
    srun). Both train the same, bitwise (docs/running.md, "Over torch.distributed")."""
    forward: CommFormat = "none"
    """Activations sent forward, to the next stage."""
    rebuilt: CommFormat = "none"
    """Rebuilt inputs x̃ sent backward (only to stages that use them)."""
    gradient: CommFormat = "none"
    """Input gradients δ sent backward."""
    buffers: CommFormat = "none"
    """Inputs that buffered blocks (stem, downsampling, ResNet blocks) keep for their backward."""
    stochastic: bool = False
    """Round at random, unbiased, instead of to the nearest (training only; evaluation rounds to
    the nearest)."""


@dataclass
class Config:
    run: RunConfig = field(default_factory=RunConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    comm: CommConfig = field(default_factory=CommConfig)
    source: str = "<defaults>"
    """The file the config came from (for messages)."""

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d.pop("source")
        return d


SECTIONS = {f.name: f.type for f in dataclasses.fields(Config) if f.name != "source"}


def load_config(path, overrides=()) -> Config:
    """Read `path` (following `base:` links), apply `key.sub=value` overrides, validate."""
    path = Path(path)
    raw = _read_with_bases(path, seen=())
    overridden = {}
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"--set {item!r}: expected key.sub=value")
        key, value = item.split("=", 1)
        parts = key.strip().split(".")
        if len(parts) != 2:
            raise ConfigError(f"--set {item!r}: keys have the form section.key, e.g. train.epochs")
        raw.setdefault(parts[0], {})
        if not isinstance(raw[parts[0]], dict):
            raise ConfigError(f"--set {item!r}: {parts[0]} is not a section")
        overridden.setdefault(parts[0], {})[parts[1]] = (yaml.safe_load(value) if value.strip()
                                                         else "")
    for section, values in overridden.items():
        _merge(raw, section, values)
    where = str(path) + (" (with --set overrides)" if overrides else "")
    cfg = _build(raw, where)
    if cfg.train.update_batch and "accumulation" not in raw.get("train", {}):
        whole, rest = divmod(cfg.train.update_batch, cfg.data.batch_size)
        if whole and not rest:  # (else validate says what is wrong)
            cfg.train.accumulation = whole
    validate(cfg)
    return cfg


def _merge(raw: dict, section: str, values):
    """Lay a section's values of a later layer (a config based on another, or the --set's) over
    `raw`, the earlier ones. train.accumulation and train.update_batch state k two ways: the
    one a later layer sets replaces the other; set in one layer, validate checks they agree."""
    if not (isinstance(values, dict) and isinstance(raw.get(section), dict)):
        raw[section] = values
        return
    if section == "train":
        if values.get("update_batch") and "accumulation" not in values:
            raw[section].pop("accumulation", None)
        elif "accumulation" in values and "update_batch" not in values:
            raw[section].pop("update_batch", None)
    raw[section] = {**raw[section], **values}


def _read_with_bases(path: Path, seen) -> dict:
    if not path.is_file():
        raise ConfigError(f"config file {path} not found")
    if path.resolve() in seen:
        raise ConfigError(f"{path}: `base` links form a cycle")
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {e}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections")
    base = raw.pop("base", None)
    if base is None:
        return raw
    merged = _read_with_bases(path.parent / base, seen + (path.resolve(),))
    for section, values in raw.items():
        _merge(merged, section, values)
    return merged


def _build(raw: dict, where: str) -> Config:
    sections = {}
    for name, values in raw.items():
        if name not in SECTIONS:
            raise ConfigError(f"{where}: unknown section {name!r}; known: {', '.join(SECTIONS)}")
        if not isinstance(values, dict):
            raise ConfigError(f"{where}: section {name!r} must be a mapping")
        cls = SECTIONS[name]
        hints = typing.get_type_hints(cls, include_extras=True)
        for key, value in values.items():
            if key not in hints:
                raise ConfigError(f"{where}: unknown key {name}.{key}; known: {', '.join(hints)}")
            values[key] = _check_type(value, hints[key], f"{where}: {name}.{key}")
        sections[name] = cls(**values)
    return Config(**sections, source=where)


def _check_type(value, hint, what):
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is Annotated:  # a type and its bounds, or names and an import path
        if OrImportPath() in hint.__metadata__:
            if is_import_path(value):
                return value
            try:
                return _check_type(value, args[0], what)
            except ConfigError as e:
                raise ConfigError(f"{e}, or a network of your own: an import path "
                                  f"package.module:function") from None
        value = _check_type(value, args[0], what)
        for bound in hint.__metadata__:
            if value < bound.low:
                raise ConfigError(f"{what}: must be >= {bound.low}, got {value!r}")
        return value
    if origin is Literal:  # a choice among fixed values
        if value not in args:
            raise ConfigError(f"{what}: must be one of {', '.join(map(str, args))}, got {value!r}")
        return value
    if origin is typing.Union and type(None) in args:  # Optional[...]
        if value is None:
            return None
        return _check_type(value, next(a for a in args if a is not type(None)), what)
    if origin is typing.Union:  # one of several types: the fields' validation judges the value
        if isinstance(value, args):
            return value
        raise ConfigError(f"{what}: expected {' or '.join(a.__name__ for a in args)}, "
                          f"got {value!r}")
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"{what}: expected a list, got {value!r}")
        return [_check_type(v, args[0], what) for v in value]
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if hint is float and isinstance(value, str):  # PyYAML reads 1e-4 (no dot) as a string
        try:
            return float(value)
        except ValueError:
            pass
    if hint is int and isinstance(value, bool) or not isinstance(value, hint):
        raise ConfigError(f"{what}: expected {hint.__name__}, got {value!r}")
    return value


def validate(cfg: Config, world_size: int | None = None, blocks: int | None = None):
    """The checks that involve several fields (the loader has checked each field's type, choices
    and bounds); `world_size` (the ranks) when known. `blocks`: the net's block count, known
    without building it for the built-in archs; a network of one's own (an import path) is
    checked against its count once built (run/model_check.py), and until then without it."""
    w = cfg.source

    def need(ok, key, msg):
        if not ok:
            raise ConfigError(f"{w}: {key}: {msg}")

    need(cfg.run.precision == "fp32" or cfg.run.dtype == "float32", "run.precision",
         "bf16 needs run.dtype float32 (the storage dtype of the tensors between blocks)")
    need(cfg.train.replicas <= 1 or not cfg.train.diag_every, "train.diag_every",
         "the diagnostics need a single replica: drop train.replicas")
    blocks = _validate_model(cfg, world_size, blocks, need)
    if cfg.train.update_batch:
        k, rest = divmod(cfg.train.update_batch, cfg.data.batch_size)
        need(k and not rest, "train.update_batch", f"{cfg.train.update_batch} images per update "
             f"is not a whole number of micro-batches of data.batch_size {cfg.data.batch_size}")
        need(k == cfg.train.accumulation, "train.update_batch",
             f"{cfg.train.update_batch} images per update in micro-batches of "
             f"{cfg.data.batch_size} is k = {k}, but train.accumulation is "
             f"{cfg.train.accumulation}: set one of them, or both alike")
    need(cfg.run.checkpoint_every_microbatches % cfg.train.accumulation == 0,
         "run.checkpoint_every_microbatches", "must be a multiple of train.accumulation (a "
         "checkpoint drains the pipeline and flushes the accumulated gradients)")
    budget = cfg.model.memory_budget
    need(budget == "auto" or type(budget) is int and budget >= 0
         or type(budget) is float and 0 < budget <= 1, "model.memory_budget",
         f"must be 0 (PETRA), a number of bytes, a fraction of the device's memory in (0, 1] or "
         f"auto, got {budget!r}")
    need(budget == 0 or cfg.train.method == "petra", "model.memory_budget",
         f"kept blocks belong to method petra, not {cfg.train.method}: set it to 0")
    need(not cfg.model.rebuild_last_stage or cfg.train.method == "petra",
         "model.rebuild_last_stage", f"belongs to method petra (the paper's baselines keep the "
         f"last stage's graph), not {cfg.train.method}: set it to false")
    if cfg.train.method != "delayed":
        need(not (cfg.train.buffer_inputs or cfg.train.stash_weights), "train.buffer_inputs",
             "buffer_inputs and stash_weights belong to method delayed")
    need(len(cfg.optim.betas) == 2 and all(0 <= b < 1 for b in cfg.optim.betas), "optim.betas",
         "must be two numbers in [0, 1)")
    free = cfg.optim.delay_free_momentum
    need(free is None or free < 1, "optim.delay_free_momentum", "must be in [0, 1) or null")
    if world_size is not None and world_size > 1:
        _validate_world(cfg, world_size, blocks, need)

def _validate_model(cfg: Config, world_size: int | None, blocks: int | None, need) -> int | None:
    """The checks among the model keys; returns the net's block count (None for a network of
    one's own not yet built)."""
    if cfg.model.arch in VIT_ARCHS or cfg.model.arch in LM_ARCHS:  # the transformers
        need(cfg.model.depth >= 1, "model.depth", "must be >= 1")
        need(cfg.model.heads >= 0, "model.heads", "must be >= 0 (0: one per 64 features)")
        heads = cfg.model.heads or default_heads(cfg.model.width)
        need(cfg.model.width % heads == 0, "model.heads",
             f"{heads} heads must divide model.width {cfg.model.width}")
    if cfg.model.arch in VIT_ARCHS:
        need(cfg.model.patch >= 1, "model.patch", "must be >= 1")
    if cfg.model.arch in LM_ARCHS:
        need(not cfg.model.tie_weights or num_stages(cfg, world_size or 1) == 1,
             "model.tie_weights", "needs the embedding and the head on one stage (J = 1): with "
             "one weight copy per stage a table cannot live on two stages")
    own = is_import_path(cfg.model.arch)
    need(own or not cfg.model.options, "model.options",
         f"belongs to a network of your own (model.arch an import path), not {cfg.model.arch}")
    blocks = blocks or (None if own else num_blocks(cfg.model.arch, cfg.model.depth))
    need(blocks is None or 0 <= cfg.model.stages <= blocks, "model.stages",
         f"{cfg.model.arch} has {blocks} blocks: use 1 to {blocks} stages (0: automatic)")
    if cfg.model.partition is not None:
        p = cfg.model.partition
        need(min(p, default=0) >= 1 and (blocks is None or sum(p) == blocks), "model.partition",
             f"needs positive block counts summing to {blocks} ({cfg.model.arch}), got {p}")
        need(cfg.model.stages in (0, len(p)), "model.partition",
             f"has {len(p)} stages but model.stages is {cfg.model.stages}")
    return blocks


def _validate_world(cfg: Config, world_size: int, blocks: int, need):
    """The checks of a config against the ranks running it (more than one)."""
    need(not cfg.train.diag_every, "train.diag_every",
         "the diagnostics need every stage in one process: run them without mpirun")
    asked = len(cfg.model.partition) if cfg.model.partition else cfg.model.stages
    R = cfg.train.replicas
    need(not asked or world_size % asked == 0, "model.stages",
         f"the config asks for {asked} stages but {world_size} ranks are running, which is "
         f"not a multiple of {asked}: run mpirun -n {asked} (or {asked} x the replicas), or "
         f"drop model.stages/model.partition")
    need(not R or world_size % R == 0, "train.replicas",
         f"{R} replicas cannot share {world_size} ranks equally: run mpirun -n R x J (a "
         f"multiple of {R}), or drop train.replicas")
    need(not (asked and R) or asked * R == world_size, "train.replicas",
         f"{R} replicas of {asked} stages need {asked * R} ranks, but {world_size} are "
         f"running: run mpirun -n {asked * R}, or drop one of train.replicas/model.stages")
    J = num_stages(cfg, world_size)
    need(blocks is None or J <= blocks, "world size",
         f"{world_size} ranks cannot each hold a stage of {cfg.model.arch}, which has "
         f"{blocks} blocks: run 1 to {blocks} ranks (one rank per stage), or set "
         f"model.stages (or train.replicas) to run data-parallel replicas of a shorter "
         f"pipeline")


def num_stages(cfg: Config, world_size: int = 1, blocks: int | None = None) -> int:
    """J: under MPI what the config asks for (model.partition, model.stages, or the world size
    over train.replicas), else the world size; in one process what the config asks for, else one
    stage per block (`blocks`: the net's count, which a network of one's own needs).
    validate(cfg, world_size) has checked that the world size fits."""
    asked = len(cfg.model.partition) if cfg.model.partition else cfg.model.stages
    if world_size > 1:
        return asked or world_size // max(1, cfg.train.replicas)
    return asked or blocks or num_blocks(cfg.model.arch, cfg.model.depth)


def num_replicas(cfg: Config, world_size: int = 1) -> int:
    """R: the world size over J under MPI; train.replicas (default 1) in one process."""
    if world_size > 1:
        return world_size // num_stages(cfg, world_size)
    return max(1, cfg.train.replicas)


# The keys of the model section beyond arch, width, num_classes and stem that a network of one's
# own may read: they describe the net (the others, its layout, must not change its blocks).
OWN_NET_KEYS = ("depth", "heads", "patch", "context", "tie_weights", "options")


def model_kwargs(cfg: Config) -> dict:
    """The model keys beyond arch/width/classes/stem that the net needs (NetSpec.model_kw), and
    that a checkpoint must share: depth, heads and patch for revvit/vit, depth, heads, context and
    tie_weights for revlm/lm, nothing for the CNNs, OWN_NET_KEYS for a network of one's own."""
    if is_import_path(cfg.model.arch):
        return {key: getattr(cfg.model, key) for key in OWN_NET_KEYS}
    if cfg.model.arch in LM_ARCHS:
        return {"depth": cfg.model.depth, "heads": cfg.model.heads,
                "context": cfg.model.context, "tie_weights": cfg.model.tie_weights}
    if cfg.model.arch not in VIT_ARCHS:
        return {}
    return {"depth": cfg.model.depth, "heads": cfg.model.heads, "patch": cfg.model.patch}

