"""Per-stage optimizer: SGD with Nesterov momentum, no weight decay on batch-norm parameters and
biases, gradients averaged over the accumulated backwards, linear warm-up then step decays."""
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

    def __call__(self, step: int) -> float:
        warmup_steps = self.warmup_epochs * self.steps_per_epoch
        if step < warmup_steps:  # linear from 0: the first step already moves
            return self.peak * (step + 1) / warmup_steps
        epoch = step // max(1, self.steps_per_epoch)
        return self.peak * self.gamma ** sum(epoch >= m for m in self.milestones)


def peak_lr(base_lr: float, batch_size: int, accumulation: int, scale: bool) -> float:
    """The paper's rule lr = base · batch · k / 256 (Goyal et al.), or base itself."""
    return base_lr * batch_size * accumulation / 256 if scale else base_lr


class StageOptimizer:
    """Owns one stage's SGD; the engine calls step() when the schedule says so."""

    def __init__(self, module: torch.nn.Module, schedule: LRSchedule, momentum: float = 0.9,
                 nesterov: bool = True, weight_decay: float = 0.0):
        decay, no_decay = [], []
        for p in module.parameters():
            (no_decay if p.ndim <= 1 else decay).append(p)  # BN weights/biases and all biases
        groups = [g for g in ({"params": decay, "weight_decay": weight_decay},
                              {"params": no_decay, "weight_decay": 0.0}) if g["params"]]
        self.params = decay + no_decay
        self.schedule = schedule
        self.sgd = torch.optim.SGD(groups, lr=schedule(0), momentum=momentum,
                                   nesterov=nesterov and momentum > 0) if self.params else None
        self.steps = 0       # optimizer steps taken
        self.pending = 0     # backwards accumulated since the last step
        self.last_lr = schedule(0)

    def accumulated(self):
        self.pending += 1

    @torch.no_grad()
    def step(self):
        """Average the pending gradients, step, and clear them."""
        if self.pending == 0:
            return
        if self.sgd is not None:
            for p in self.params:
                if p.grad is not None and self.pending > 1:
                    p.grad.div_(self.pending)
            lr = self.last_lr = self.schedule(self.steps)
            for group in self.sgd.param_groups:
                group["lr"] = lr
            self.sgd.step()
            self.sgd.zero_grad(set_to_none=True)
        self.steps += 1
        self.pending = 0

    def state_dict(self):
        return {"sgd": self.sgd.state_dict() if self.sgd else None, "steps": self.steps,
                "pending": self.pending}

    def load_state_dict(self, state):
        if self.sgd is not None:
            self.sgd.load_state_dict(state["sgd"])
        self.steps, self.pending = state["steps"], state["pending"]
