"""Per-stage optimizer: SGD with Nesterov momentum (the paper's) or AdamW (decoupled weight decay,
for transformers); no weight decay on normalisation parameters, biases and position embeddings;
gradients averaged over the accumulated backwards; linear warm-up, then step decays or a cosine
decay to 0 at the end of the run."""
import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LRSchedule:
    """lr(step) for optimizer step `step` (0-based), identical on every stage."""
    peak: float
    steps_per_epoch: int
    warmup_epochs: float = 0.0
    milestones: tuple = ()
    gamma: float = 0.1
    kind: str = "step"
    """step (milestones) or cosine (from the peak after warm-up down to 0 at total_steps)."""
    total_steps: int = 0
    """Optimizer steps of the whole run (cosine only)."""

    def __call__(self, step: int) -> float:
        warmup_steps = self.warmup_epochs * self.steps_per_epoch
        if step < warmup_steps:  # linear from 0: the first step already moves
            return self.peak * (step + 1) / warmup_steps
        if self.kind == "cosine":
            progress = min(1.0, (step - warmup_steps) / max(1.0, self.total_steps - warmup_steps))
            return self.peak * 0.5 * (1.0 + math.cos(math.pi * progress))
        epoch = step // max(1, self.steps_per_epoch)
        return self.peak * self.gamma ** sum(epoch >= m for m in self.milestones)


def peak_lr(base_lr: float, batch_size: int, accumulation: int, scale: bool) -> float:
    """The paper's rule lr = base · batch · k / 256 (Goyal et al.), or base itself."""
    return base_lr * batch_size * accumulation / 256 if scale else base_lr


OPTIMIZERS = ("sgd", "adamw")
NO_DECAY_NAMES = ("pos_embed",)  # parameters named so take no weight decay, whatever their shape


def constant_lr(lr: float = 0.01) -> LRSchedule:
    """The same learning rate at every step: what benchmarks train with (they time the steps;
    what the weights learn does not matter)."""
    return LRSchedule(lr, 10**9)


class StageOptimizer:
    """Owns one stage's SGD or AdamW; the engine calls step() when the tick schedule says so."""

    def __init__(self, module: torch.nn.Module, lr_schedule: LRSchedule, momentum: float = 0.9,
                 nesterov: bool = True, weight_decay: float = 0.0, *, name: str = "sgd",
                 betas=(0.9, 0.999)):
        if name not in OPTIMIZERS:
            raise ValueError(f"unknown optimizer {name!r}; choose one of {OPTIMIZERS}")
        decay, no_decay = [], []
        for pname, p in module.named_parameters():
            # norm weights/biases, all biases, position embeddings
            skip = p.ndim <= 1 or pname.rsplit(".", 1)[-1] in NO_DECAY_NAMES
            (no_decay if skip else decay).append(p)
        groups = [g for g in ({"params": decay, "weight_decay": weight_decay},
                              {"params": no_decay, "weight_decay": 0.0}) if g["params"]]
        self.params = decay + no_decay
        self.lr_schedule = lr_schedule
        self.name = name
        # the torch optimizer, SGD or AdamW; None for a stage without parameters
        if not self.params:
            self.torch_optimizer = None
        elif name == "sgd":
            self.torch_optimizer = torch.optim.SGD(groups, lr=lr_schedule(0), momentum=momentum,
                                                   nesterov=nesterov and momentum > 0)
        else:  # decoupled weight decay: p ← p − lr·wd·p beside the Adam step
            self.torch_optimizer = torch.optim.AdamW(groups, lr=lr_schedule(0), betas=tuple(betas))
        self.steps = 0       # optimizer steps taken
        self.pending = 0     # backwards accumulated since the last step
        self.last_lr = lr_schedule(0)

    def accumulated(self):
        self.pending += 1

    @torch.no_grad()
    def step(self):
        """Average the pending gradients, step, and clear them."""
        if self.pending == 0:
            return
        if self.torch_optimizer is not None:
            for p in self.params:
                if p.grad is not None and self.pending > 1:
                    p.grad.div_(self.pending)
            lr = self.last_lr = self.lr_schedule(self.steps)
            for group in self.torch_optimizer.param_groups:
                group["lr"] = lr
            self.torch_optimizer.step()
            self.torch_optimizer.zero_grad(set_to_none=True)
        self.steps += 1
        self.pending = 0

    def state_dict(self):
        """The torch optimizer's state under its name ("sgd" or "adamw"), and the counters."""
        torch_state = self.torch_optimizer.state_dict() if self.torch_optimizer else None
        return {self.name: torch_state, "steps": self.steps, "pending": self.pending}

    def load_state_dict(self, state):
        if self.name not in state:
            other = next((n for n in OPTIMIZERS if n in state), "?")
            raise ValueError(f"the checkpoint holds {other} state, this run uses {self.name}")
        if self.torch_optimizer is not None:
            self.torch_optimizer.load_state_dict(state[self.name])
        self.steps, self.pending = state["steps"], state["pending"]

    def rescale_steps(self, factor: float):
        """Keep the learning-rate schedule's place, in epochs, when a resumed run has `factor`
        times the checkpoint's steps per epoch (another number of replicas)."""
        self.steps = round(self.steps * factor)
