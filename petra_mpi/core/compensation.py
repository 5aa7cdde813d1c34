"""Delay compensation: each stage knows how late its gradients are, and its optimizer may use it.

Stage s applies the gradient of a micro-batch d_s micro-batches after that micro-batch's forward
(PETRA: d_s = 2(J - 1 - s); backprop: 0); over the k micro-batches of one optimizer step the
gradient is on average D_s = d_s / k optimizer steps stale (exactly: sum_j floor((j - d_s) / k)
over j < k is -d_s). D_s is the schedule's (TickSchedule.delay_in_updates).
Every rule below is a function of D_s, the optimizer's own state and its step counter, so it
changes the update only: not the schedule, the messages or the single copy of the weights, and
a checkpoint of the optimizer's state already holds all it needs.

- momentum by delay (`optim.delay_momentum` = c): a gradient D steps late already acts like
  momentum (Mitliagkas et al. 2016, "Asynchrony begets momentum": a staleness of mean D is an
  implicit momentum D / (D + 1)). Measured as the mean age of the gradients in one update, heavy
  ball and Adam's beta1 have age mu / (1 - mu), Nesterov mu^2 / (1 - mu), and a delay adds D to
  it. The stage's explicit momentum is the one whose age is backprop's minus c * D (0 when that
  is negative): c = 1 keeps the total age at backprop's, a larger c leans towards momentum 0.
  Lowering SGD's momentum lowers each gradient's total weight lr / (1 - mu) too (as Mitliagkas et
  al. tune it, at a fixed learning rate); with `optim.delay_momentum_lr` the stage's learning rate
  is multiplied by (1 - mu_s) / (1 - mu) to keep that weight, as Adam's averaged first moment
  keeps it whatever beta1. No extra memory.
- weight prediction (`optim.delay_prediction` = c; SpecTrain, Chen et al. 2018; linear weight
  prediction, Kosson et al. 2021): the forward of a micro-batch runs with the weights
  extrapolated c * D steps ahead along the optimizer's velocity (SGD: lr * momentum buffer,
  AdamW: lr * its step direction plus the decay), the weights its gradient will meet. The
  backward keeps PETRA's rule: it rebuilds and differentiates with the current weights, which
  are close to the predicted ones the output was computed with, so the rebuild inverts nearly
  the same function. One extra copy of the weights (the buffer the prediction is written into).
  SGD without momentum has no velocity to follow: nothing is predicted there.
- spike compensation (`optim.delay_spike`; Kosson et al. 2021): a gradient that arrives D steps
  late missed D steps of its momentum's contributions; it is applied at once (the spike) and its
  later contributions are scaled by mu^D, so its total weight is backprop's. SGD:
  p -= lr * (mu^D v + (1 - mu^D) / (1 - mu) g) (Nesterov: lr * (mu^(D+1) v + (1 + mu (1 -
  mu^D) / (1 - mu)) g)); AdamW: the first moment used is beta1^D m + (1 - beta1^D) g. No extra
  memory.
- learning rate by delay (`optim.delay_lr_epochs` = E; PipeMare, Yang et al. 2021): for the
  first E epochs a stage's step is scaled by D^-(1 - t / T) (t steps taken, T = E epochs of
  steps), from 1 / D at the start to 1 at T; stages with D <= 1 are unchanged. No extra memory.
- momentum of the stage on time (`optim.delay_free_momentum` = mu_0): a stage whose gradients
  are not late (D = 0: PETRA's last stage, which computes the loss) uses momentum / beta1 mu_0
  in place of the optimizer's. Measured, not derived: on the reversible LM at J = 4, beta1 = 0
  on the last stage alone took plain PETRA from +0.29 nats over backprop to +0.02, where
  beta1 = 0 on every stage gave +0.14 and on every late stage +0.61 (docs/lm.md). The reading:
  the late stages move the features the last stage classifies by gradients computed against
  its older weights, and a last stage that averages its gradients over ~1 / (1 - mu) steps
  follows that moving input too slowly. It is the one rule that is not the identity at D = 0,
  so it applies only where some stage is late: backprop (`for_method`) keeps the optimizer's
  momentum, and a recipe's backprop baseline stays the recipe. No extra memory.
"""
import math
from dataclasses import dataclass, replace


@dataclass(frozen=True)
class DelayCompensation:
    """The settings shared by all stages (config: optim.delay_*); all off by default."""
    momentum: float = 0.0
    """c of momentum by delay; 0: off."""
    momentum_lr: bool = False
    """SGD under momentum by delay: keep each gradient's total weight (the lr grows)."""
    prediction: float = 0.0
    """c of weight prediction (the horizon is c * D steps); 0: off."""
    spike: bool = False
    """Spike compensation."""
    lr_steps: int = 0
    """T of the learning rate by delay, in optimizer steps; 0: off."""
    free_momentum: float | None = None
    """The momentum of the stage on time (D = 0) in a pipeline with late stages; None: the
    optimizer's."""

    @property
    def active(self) -> bool:
        return bool(self.momentum or self.prediction or self.spike or self.lr_steps
                    or self.free_momentum is not None)

    @classmethod
    def from_config(cls, optim, steps_per_epoch: int):
        lr_steps = (max(1, math.ceil(optim.delay_lr_epochs * steps_per_epoch))
                    if optim.delay_lr_epochs else 0)  # (on stays on, however short)
        return cls(optim.delay_momentum, optim.delay_momentum_lr, optim.delay_prediction,
                   optim.delay_spike, lr_steps, optim.delay_free_momentum)

    def for_method(self, method: str) -> "DelayCompensation":
        """The rules as `method` applies them. Every rule is the identity at D = 0 but the free
        momentum, so backprop, with no late stage to compensate, drops that one too."""
        return replace(self, free_momentum=None) if method == "backprop" else self

    def stage_momentum(self, mu: float, delay: float, nesterov: bool = False) -> float:
        """The momentum (or beta1) of a stage whose gradients are `delay` steps late."""
        if not delay and self.free_momentum is not None:
            return self.free_momentum
        return momentum_by_delay(mu, delay, self.momentum, nesterov)


NO_COMPENSATION = DelayCompensation()


def momentum_age(mu: float, nesterov: bool = False) -> float:
    """The mean age, in steps, of the gradients in one momentum update."""
    return (mu * mu if nesterov else mu) / (1.0 - mu)


def momentum_for_age(age: float, nesterov: bool = False) -> float:
    """The momentum whose updates have mean age `age` (the inverse of momentum_age)."""
    if age <= 1e-9:  # (rounding: a delay equal to backprop's age leaves nothing)
        return 0.0
    if nesterov:  # mu^2 + age mu - age = 0
        return (math.sqrt(age * age + 4 * age) - age) / 2
    return age / (1.0 + age)


def momentum_by_delay(mu: float, delay: float, c: float, nesterov: bool = False) -> float:
    """The explicit momentum of a stage whose gradients are `delay` steps late: backprop's
    mean age less c * delay. c = 0 (off) or delay = 0 returns mu itself."""
    if not c or not delay or not mu:
        return mu
    return momentum_for_age(momentum_age(mu, nesterov) - c * delay, nesterov)


def lr_factor(delay: float, step: int, lr_steps: int) -> float:
    """PipeMare's per-stage factor D^-(1 - step / T) for the first T steps (1 when off)."""
    if not lr_steps or delay <= 1 or step >= lr_steps:
        return 1.0
    return delay ** -(1.0 - step / lr_steps)


def spike_weights(mu: float, delay: float, nesterov: bool = False) -> tuple[float, float]:
    """(a, b) of the spike-compensated SGD update p -= lr * (a * v + b * g), v the momentum
    buffer after this step's gradient g (for Nesterov a includes the look-ahead's mu)."""
    decay = mu ** delay
    if nesterov:
        return mu * decay, 1.0 + mu * (1.0 - decay) / (1.0 - mu)
    return decay, (1.0 - decay) / (1.0 - mu) if mu < 1 else delay
