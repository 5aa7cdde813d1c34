"""Per-stage optimizer: SGD with Nesterov momentum (the paper's) or AdamW (decoupled weight decay,
for transformers); no weight decay on normalisation parameters, biases and position embeddings;
gradients averaged over the accumulated backwards; linear warm-up, then step decays or a cosine
decay to 0 at the end of the run; delay compensation by the stage's known delay
(compensation.py)."""
import contextlib
import math
from dataclasses import dataclass

import torch

from .compensation import NO_COMPENSATION, DelayCompensation, lr_factor, spike_weights


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
                 betas=(0.9, 0.999), delay: float = 0.0,
                 compensation: DelayCompensation = NO_COMPENSATION):
        """delay: D, the mean staleness of this stage's gradients in optimizer steps
        (TickSchedule.delay_in_updates); compensation: what the optimizer does with it."""
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
        self.delay, self.compensation = delay, compensation
        # momentum by delay (the explicit momentum left once the delay's implicit one is counted)
        # or the free momentum of a stage on time: compensation.stage_momentum. With momentum_lr,
        # SGD's step grows so that each gradient keeps its total weight lr / (1 - mu), as Adam's
        # averaged first moment does whatever beta1.
        reduced = compensation.stage_momentum(momentum, delay, nesterov)
        self.momentum_lr_scale = ((1 - reduced) / (1 - momentum)
                                  if compensation.momentum_lr and name == "sgd" and momentum < 1
                                  else 1.0)
        momentum = reduced
        betas = (compensation.stage_momentum(betas[0], delay), betas[1])
        self.momentum = momentum if name == "sgd" else betas[0]  # what the dry run shows
        self.prediction_scratch = None  # weight prediction's one copy of the weights
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
            lr = self.last_lr = self.lr()
            for group in self.torch_optimizer.param_groups:
                group["lr"] = lr
            if self.compensation.spike and self.delay:
                (_spike_sgd_step if self.name == "sgd" else _spike_adamw_step)(
                    self.torch_optimizer, self.delay)
            else:
                self.torch_optimizer.step()
            self.torch_optimizer.zero_grad(set_to_none=True)
        self.steps += 1
        self.pending = 0

    def lr(self, step: int | None = None) -> float:
        """This stage's learning rate at optimizer step `step` (default: the next one): the
        schedule's, times momentum by delay's and the learning-rate-by-delay factors."""
        step = self.steps if step is None else step
        return (self.lr_schedule(step) * self.momentum_lr_scale
                * lr_factor(self.delay, step, self.compensation.lr_steps))

    @property
    def prediction_horizon(self) -> float:
        """Steps ahead that weight prediction extrapolates the forward's weights (0: off, and
        for SGD without momentum, which has no velocity to follow)."""
        if self.name == "sgd" and not self.momentum:
            return 0.0
        return self.compensation.prediction * self.delay

    @contextlib.contextmanager
    def predicted_weights(self):
        """Inside: the stage's parameters hold the weights predicted prediction_horizon steps
        ahead (weight prediction), written into one scratch copy; outside: the current ones,
        untouched. Without prediction, or before the first step, nothing changes."""
        horizon = self.prediction_horizon
        if not horizon or self.torch_optimizer is None or self.steps == 0:
            yield
            return
        if self.prediction_scratch is None:
            self.prediction_scratch = [torch.empty_like(p) for p in self.params]
        _predict(self.torch_optimizer, self.prediction_scratch, horizon * self.lr())
        current = [p.data for p in self.params]
        for p, predicted in zip(self.params, self.prediction_scratch):
            p.data = predicted
        try:
            yield
        finally:
            for p, c in zip(self.params, current):
                p.data = c

    def state_dict(self):
        """The torch optimizer's state under its name ("sgd" or "adamw"), and the counters."""
        torch_state = self.torch_optimizer.state_dict() if self.torch_optimizer else None
        return {self.name: torch_state, "steps": self.steps, "pending": self.pending}

    def load_state_dict(self, state):
        if self.name not in state:
            other = next((n for n in OPTIMIZERS if n in state), "?")
            raise ValueError(f"the checkpoint holds {other} state, this run uses {self.name}")
        if self.torch_optimizer is not None:
            # torch takes each group's settings from the checkpoint too; this run's (momentum,
            # betas, weight decay, as its config and delay compensation set them) win
            settings = [{k: v for k, v in g.items() if k != "params"}
                        for g in self.torch_optimizer.param_groups]
            self.torch_optimizer.load_state_dict(state[self.name])
            for group, own in zip(self.torch_optimizer.param_groups, settings):
                group.update(own)
        self.steps, self.pending = state["steps"], state["pending"]

    def rescale_steps(self, factor: float):
        """Keep the learning-rate schedule's place, in epochs, when a resumed run has `factor`
        times the checkpoint's steps per epoch (another number of replicas)."""
        self.steps = round(self.steps * factor)


@torch.no_grad()
def _predict(optimizer, out, reach: float):
    """out[i] = params[i] - reach * velocity (reach: horizon times the learning rate). SGD's
    velocity is its momentum buffer (its step is lr times the buffer once the buffer is steady,
    Nesterov or not); AdamW's its step direction m^ / (sqrt(v^) + eps) plus the decay. A
    parameter without optimizer state yet is copied."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    settings = {id(p): group for group in optimizer.param_groups for p in group["params"]}
    for p, o in zip(params, out):
        state, group = optimizer.state.get(p, {}), settings[id(p)]
        if "momentum_buffer" in state and state["momentum_buffer"] is not None:
            torch.add(p, state["momentum_buffer"], alpha=-reach, out=o)
        elif "exp_avg" in state:
            beta1, beta2 = group["betas"]
            t = float(state["step"])
            o.copy_(state["exp_avg_sq"]).div_(1 - beta2 ** t).sqrt_().add_(group["eps"])
            o.reciprocal_().mul_(state["exp_avg"]).mul_(-reach / (1 - beta1 ** t))
            o.add_(p, alpha=1 - reach * group["weight_decay"])
        else:
            o.copy_(p)


@torch.no_grad()
def _spike_sgd_step(optimizer, delay: float):
    """torch's SGD step (weight decay, momentum, Nesterov) with spike compensation:
    p -= lr * (a * v + b * g), compensation.spike_weights."""
    for group in optimizer.param_groups:
        mu, lr, decay = group["momentum"], group["lr"], group["weight_decay"]
        a, b = spike_weights(mu, delay, group["nesterov"])
        for p in group["params"]:
            if p.grad is None:
                continue
            g = p.grad.add(p, alpha=decay) if decay else p.grad
            if not mu:
                p.add_(g, alpha=-lr)
                continue
            state = optimizer.state[p]
            v = state.get("momentum_buffer")
            if v is None:  # as torch: the first buffer is the gradient itself
                v = state["momentum_buffer"] = g.detach().clone()
            else:
                v.mul_(mu).add_(g)
            p.add_(v, alpha=-lr * a).add_(g, alpha=-lr * b)


@torch.no_grad()
def _spike_adamw_step(optimizer, delay: float):
    """torch's AdamW step with spike compensation on the first moment: the bias-corrected
    moment used is beta1^D m^ + (1 - beta1^D) g (the state keeps torch's m and v)."""
    for group in optimizer.param_groups:
        (beta1, beta2), lr, eps = group["betas"], group["lr"], group["eps"]
        fresh = 1 - beta1 ** delay
        for p in group["params"]:
            if p.grad is None:
                continue
            g, state = p.grad, optimizer.state[p]
            if not state:
                state["step"] = torch.tensor(0.0)
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["step"] += 1
            t = float(state["step"])
            m, v = state["exp_avg"], state["exp_avg_sq"]
            p.mul_(1 - lr * group["weight_decay"])
            m.lerp_(g, 1 - beta1)
            v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
            first = m * ((1 - fresh) / (1 - beta1 ** t)) + g * fresh
            p.addcdiv_(first, (v / (1 - beta2 ** t)).sqrt_().add_(eps), value=-lr)
