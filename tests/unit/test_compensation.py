"""Delay compensation (core/compensation.py, invariant 8): off is today's update bitwise; each
rule has its known answer (a delayed quadratic that diverges without it and converges with it,
the total weight of one gradient under spike compensation, the momentum rule's ages, the stages
on time that the free momentum reaches); kept
blocks with every rule on follow `delayed` with buffers and stashes under the same rules; the
state it needs is the optimizer's, so a resumed run continues bitwise."""
import collections
import copy
import dataclasses

import pytest
import torch

from petra_mpi.config import ConfigError, load_config, validate
from petra_mpi.core.compensation import (NO_COMPENSATION, DelayCompensation,
                                         lr_factor, momentum_age, momentum_by_delay,
                                         momentum_for_age, spike_weights)
from petra_mpi.core.optim import LRSchedule, StageOptimizer
from petra_mpi.core.schedule import schedule_for
from petra_mpi.engines.build import build_workers
from petra_mpi.engines.local import LocalEngine
from tests.support.nets import make_batches, stages_of

EVERY_RULE = DelayCompensation(momentum=1.0, prediction=1.0, spike=True, lr_steps=3)
# with the last stage's momentum too
EVERY_RULE_FREE = dataclasses.replace(EVERY_RULE, free_momentum=0.0)


def delayed_quadratic(compensation, delay, lr, steps=400, name="sgd", mu=0.9):
    """f(w) = w^2 / 2 from w = 1, each gradient taken at the weights of a forward `delay` steps
    earlier (those the forward saw: predicted ones under weight prediction). Returns |w|."""
    w = torch.nn.Linear(1, 1, bias=False)
    torch.nn.init.ones_(w.weight)
    opt = StageOptimizer(w, LRSchedule(lr, 10**9), mu, True, 0.0, name=name, betas=(mu, 0.999),
                         delay=delay, compensation=compensation)
    seen = collections.deque()
    for _ in range(steps):
        with opt.predicted_weights():
            seen.append(w.weight.detach().clone())
        if len(seen) > delay:
            w.weight.grad = seen.popleft()
            opt.accumulated()
            opt.step()
    return w.weight.abs().item()


@pytest.mark.parametrize("compensation,delay,lr", [
    (DelayCompensation(momentum=1.0), 8, 0.05),
    (DelayCompensation(prediction=1.0), 2, 0.1),
    (DelayCompensation(spike=True), 2, 0.1),
    (DelayCompensation(lr_steps=10**6), 2, 0.1),  # the whole run at lr / D
], ids=["momentum", "prediction", "spike", "lr"])
def test_each_rule_makes_a_diverging_delayed_quadratic_converge(compensation, delay, lr):
    """Delayed Nesterov SGD at this learning rate diverges; the rule makes it converge (a sign
    flipped or the rule removed diverges: the test fails)."""
    assert delayed_quadratic(NO_COMPENSATION, delay, lr) > 10
    assert delayed_quadratic(compensation, delay, lr) < 1e-3
    assert delayed_quadratic(compensation, 0, lr) < 1e-9  # no delay: nothing to compensate


def test_weight_prediction_under_adamw():
    """AdamW at beta1 0.9, 3 steps late: predicting the weights brings it to the minimum's
    neighbourhood where the plain delayed run still swings wide."""
    plain = delayed_quadratic(NO_COMPENSATION, 3, 0.1, steps=200, name="adamw")
    predicted = delayed_quadratic(DelayCompensation(prediction=1.0), 3, 0.1, steps=200,
                                  name="adamw")
    assert predicted < plain / 10


@pytest.mark.parametrize("nesterov", [False, True])
@pytest.mark.parametrize("delay", [0, 1, 3.5, 9])
def test_spike_gives_one_gradient_backprops_total_weight(delay, nesterov):
    """One gradient g, then zeros: momentum SGD moves the weights lr g / (1 - mu) in all; the
    spike-compensated update moves them as much whatever the delay, lr (a + b) g at once."""
    mu, lr, g = 0.9, 0.5, 1.0
    a, b = spike_weights(mu, delay, nesterov)
    w = torch.nn.Linear(1, 1, bias=False)
    torch.nn.init.zeros_(w.weight)
    opt = StageOptimizer(w, LRSchedule(lr, 10**9), mu, nesterov, 0.0, delay=delay,
                         compensation=DelayCompensation(spike=True))
    for step in range(600):
        w.weight.grad = torch.full_like(w.weight, g if step == 0 else 0.0)
        opt.accumulated()
        opt.step()
        if step == 0:
            assert w.weight.item() == pytest.approx(-lr * (a + b) * g, rel=1e-6)
    assert w.weight.item() == pytest.approx(-lr * g / (1 - mu), rel=1e-5)
    if delay:
        assert a + b > (mu if nesterov else 0) + 1  # more at once than backprop's first step


@pytest.mark.parametrize("name", ["sgd", "adamw"])
def test_spike_at_delay_zero_is_torchs_step(name):
    torch.manual_seed(0)
    # (no batch norm after a linear layer: its bias's gradient would be rounding noise, which
    # Adam scales up to a full step)
    net = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh(), torch.nn.Linear(3, 2))
    net = net.double()
    twin = copy.deepcopy(net)
    settings = dict(name=name, betas=(0.8, 0.99), weight_decay=0.01)
    spiked = StageOptimizer(net, LRSchedule(0.1, 10**9), 0.9, True, delay=1e-12,
                            compensation=DelayCompensation(spike=True), **settings)
    plain = StageOptimizer(twin, LRSchedule(0.1, 10**9), 0.9, True, **settings)
    for _ in range(5):
        x = torch.randn(8, 4, dtype=torch.float64)
        for m, opt in ((net, spiked), (twin, plain)):
            m(x).square().mean().backward()
            opt.accumulated()
            opt.step()
    for p, q in zip(net.parameters(), twin.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-12, atol=1e-12)


def test_momentum_by_delay_keeps_the_gradients_mean_age():
    for nesterov in (False, True):
        for mu in (0.5, 0.9, 0.99):
            assert momentum_for_age(momentum_age(mu, nesterov), nesterov) == pytest.approx(mu)
            assert momentum_by_delay(mu, 0, 1.0, nesterov) == mu
            for delay in (0.5, 2, 5):
                new, age = momentum_by_delay(mu, delay, 1.0, nesterov), momentum_age(mu, nesterov)
                if delay < age:
                    assert momentum_age(new, nesterov) + delay == pytest.approx(age)
                else:  # the delay alone is older than backprop's momentum
                    assert new == 0
    # Mitliagkas et al.: a delay of D with no explicit momentum is an implicit D / (D + 1)
    assert momentum_for_age(3.0) == pytest.approx(3 / 4)
    assert momentum_by_delay(0.9, 9, 1.0) == 0.0       # the delay is all the momentum needed
    assert momentum_by_delay(0.9, 4, 2.0) < momentum_by_delay(0.9, 4, 1.0) < 0.9
    assert momentum_by_delay(0.9, 4, 0.0) == 0.9       # off


@pytest.mark.parametrize("keep_weight", [False, True])
def test_momentum_by_delay_moves_one_gradient_by_its_weight(keep_weight):
    """One gradient, then zeros, 3 steps late: the stage's lower momentum moves the weights
    lr / (1 - mu_s) in all, or backprop's lr / (1 - mu) with optim.delay_momentum_lr."""
    mu, lr, delay = 0.9, 0.5, 3
    w = torch.nn.Linear(1, 1, bias=False)
    torch.nn.init.zeros_(w.weight)
    opt = StageOptimizer(w, LRSchedule(lr, 10**9), mu, True, 0.0, delay=delay,
                         compensation=DelayCompensation(momentum=1.0, momentum_lr=keep_weight))
    reduced = momentum_by_delay(mu, delay, 1.0, nesterov=True)
    assert opt.momentum == reduced < mu
    for step in range(600):
        w.weight.grad = torch.full_like(w.weight, 1.0 if step == 0 else 0.0)
        opt.accumulated()
        opt.step()
    want = lr / (1 - mu) if keep_weight else lr / (1 - reduced)
    assert -w.weight.item() == pytest.approx(want, rel=1e-5)


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
@pytest.mark.parametrize("method", ["petra", "delayed", "backprop"])
def test_free_momentum_reaches_exactly_the_stage_on_time_of_a_late_pipeline(optimizer, method):
    """optim.delay_free_momentum: the stage whose gradients are not late in a pipeline that has
    late ones (PETRA's and delayed's last stage) takes it, in torch's own optimizer (SGD without
    Nesterov at 0, which torch requires); the late stages keep the optimizer's momentum, and so
    does every stage of backprop, which has no delay to compensate."""
    stages = stages_of("revnet18", 4, 10, 4, seed=0)
    workers = build_workers(stages, LRSchedule(0.2, 10**6), 2, momentum=0.9, optimizer=optimizer,
                            betas=(0.9, 0.99), method=method,
                            compensation=DelayCompensation(free_momentum=0.0))
    assert [w.optimizer.delay == 0 for w in workers] == ([True] * 4 if method == "backprop"
                                                         else [False] * 3 + [True])
    takes_it = [False] * 4 if method == "backprop" else [False] * 3 + [True]
    for w, free in zip(workers, takes_it):
        for group in w.optimizer.torch_optimizer.param_groups:
            if optimizer == "sgd":
                assert (group["momentum"], group["nesterov"]) == ((0.0, False) if free
                                                                   else (0.9, True))
            else:
                assert group["betas"] == ((0.0, 0.99) if free else (0.9, 0.99))
        assert w.optimizer.momentum == (0.0 if free else 0.9)


def test_free_momentum_changes_the_last_stage_and_through_it_every_stage():
    """Under PETRA the rule changes the last stage's update; the gradients the late stages
    receive then change with it, so every stage moves off the plain run (the rule removed: the
    runs are equal and the test fails)."""
    plain, _ = train()
    free, workers = train(compensation=DelayCompensation(free_momentum=0.0))
    changed = [any(not torch.equal(a, b) for a, b in zip(x.parameters(), y.parameters()))
               for x, y in zip(free, plain)]
    assert all(changed), changed
    assert workers[-1].optimizer.torch_optimizer.param_groups[0]["momentum"] == 0.0


def test_learning_rate_by_delay_goes_from_one_over_d_to_one():
    assert lr_factor(4, 0, 100) == pytest.approx(1 / 4)
    assert lr_factor(4, 50, 100) == pytest.approx(1 / 2)
    assert lr_factor(4, 100, 100) == 1.0 and lr_factor(4, 0, 0) == 1.0
    assert lr_factor(1, 0, 100) == 1.0  # no longer than one step late: unchanged
    assert schedule_for("petra", 10, 2).delay_in_updates(0) == 9
    assert schedule_for("backprop", 10, 2).delay_in_updates(0) == 0


def state(stages):
    return [t.detach().clone() for s in stages for t in (*s.parameters(), *s.buffers())]


def train(method="petra", k=2, compensation=NO_COMPENSATION, optimizer="sgd", n=7, J=4,
          segments=2, stages=None, **stage_kw):
    """RevNet18 width 4, float64, two segments of n micro-batches."""
    stages = stages or stages_of("revnet18", 4, 10, J, seed=0, dtype=torch.float64, **stage_kw)
    workers = build_workers(stages, LRSchedule(0.2, 10**6), k, momentum=0.9, weight_decay=5e-4,
                            optimizer=optimizer, method=method, compensation=compensation)
    engine = LocalEngine(workers, method)
    for seed in range(1, segments + 1):
        engine.train_segment(iter(make_batches(n, seed=seed, dtype=torch.float64)), n)
    return stages, workers


@pytest.mark.parametrize("name", ["sgd", "adamw"])
def test_off_is_torchs_own_step_bitwise(name):
    """Compensation off, on a stage with a delay: every step is exactly what torch's SGD (or
    AdamW) does with the same groups and learning rates, and the forward's weights are the
    parameters themselves."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh(), torch.nn.Linear(3, 2))
    twin = copy.deepcopy(net)
    schedule = LRSchedule(0.1, 3, warmup_epochs=1, milestones=(2,))
    ours = StageOptimizer(net, schedule, 0.9, True, 0.01, name=name, betas=(0.8, 0.99), delay=4.5,
                          compensation=DelayCompensation())
    decay = [twin[0].weight, twin[2].weight]
    groups = [{"params": decay, "weight_decay": 0.01},
              {"params": [twin[0].bias, twin[2].bias], "weight_decay": 0.0}]
    theirs = (torch.optim.SGD(groups, lr=0.0, momentum=0.9, nesterov=True) if name == "sgd"
              else torch.optim.AdamW(groups, lr=0.0, betas=(0.8, 0.99)))
    for step in range(8):
        x = torch.randn(8, 4)
        before = [p.data_ptr() for p in net.parameters()]
        with ours.predicted_weights():
            assert [p.data_ptr() for p in net.parameters()] == before
        for m in (net, twin):
            m(x).square().mean().backward()
        ours.accumulated()
        ours.step()
        for group in theirs.param_groups:
            group["lr"] = schedule(step)
        theirs.step()
        theirs.zero_grad(set_to_none=True)
        for p, q in zip(net.parameters(), twin.parameters()):
            assert torch.equal(p, q), step
    assert ours.prediction_scratch is None and ours.momentum == (0.9 if name == "sgd" else 0.8)


def test_off_is_the_default_and_nothing_without_delay_changes():
    stages, workers = train(compensation=DelayCompensation())
    default, _ = train()
    assert all(torch.equal(a, b) for a, b in zip(state(stages), state(default)))
    # and with every rule on (the free momentum too) but no delay (backprop), nothing changes
    backprop, _ = train("backprop", compensation=EVERY_RULE_FREE)
    plain, _ = train("backprop")
    assert all(torch.equal(a, b) for a, b in zip(state(backprop), state(plain)))
    compensated, _ = train(compensation=EVERY_RULE)
    assert not all(torch.equal(a, b) for a, b in zip(state(compensated), state(default)))


@pytest.mark.parametrize("optimizer", ["sgd", pytest.param("adamw", marks=pytest.mark.extended)])
def test_kept_blocks_keeping_everything_follow_delayed_under_every_rule(optimizer):
    """Invariant 7 with compensation on: a plan keeping every micro-batch trains exactly as
    `delayed` with both buffers, both under weight prediction (the kept graph and the stash hold
    the predicted weights the forward used), spike, momentum and learning rate by delay."""
    windows = [2 * (3 - s) for s in range(4)]
    blocks = [len(s.blocks) for s in stages_of("revnet18", 4, 10, 4, seed=0)]
    kept = [[w] * n for w, n in zip(windows, blocks)]
    kept[-1] = [0] * blocks[-1]
    got, _ = train(compensation=EVERY_RULE_FREE, optimizer=optimizer, kept=kept)
    want, _ = train("delayed", compensation=EVERY_RULE_FREE, optimizer=optimizer,
                    buffer_inputs=True, stash_weights=True)
    for g, w in zip(state(got), state(want)):
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-13)
    petra, _ = train(compensation=EVERY_RULE_FREE, optimizer=optimizer)
    assert max((g - p).abs().max().item() for g, p in zip(state(got), state(petra))) > 1e-6


def test_prediction_swaps_in_a_copy_and_restores_the_weights():
    stages, workers = train(compensation=DelayCompensation(prediction=1.0), segments=1)
    opt = workers[0].optimizer
    before = [p.data_ptr() for p in opt.params]
    values = [p.detach().clone() for p in opt.params]
    with opt.predicted_weights():
        inside = [p.detach().clone() for p in opt.params]
    assert [p.data_ptr() for p in opt.params] == before
    assert all(torch.equal(p, v) for p, v in zip(opt.params, values))
    assert any(not torch.equal(i, v) for i, v in zip(inside, values))
    assert opt.prediction_horizon == 3.0  # d_0 = 6 micro-batches at k = 2
    assert workers[-1].optimizer.prediction_horizon == 0  # the last stage has no delay


def test_resume_mid_run_continues_bitwise():
    """The state the rules need is the optimizer's (momentum buffers, Adam's moments, the step
    counter): a run rebuilt from its state_dicts after one segment ends where one run does."""
    one, _ = train(compensation=EVERY_RULE_FREE, optimizer="adamw")
    first, workers = train(compensation=EVERY_RULE_FREE, optimizer="adamw", segments=1)
    saved = [(copy.deepcopy(s.state_dict()), copy.deepcopy(w.optimizer.state_dict()))
             for s, w in zip(first, workers)]
    fresh = stages_of("revnet18", 4, 10, 4, seed=0, dtype=torch.float64)
    resumed_workers = build_workers(fresh, LRSchedule(0.2, 10**6), 2, momentum=0.9,
                                    weight_decay=5e-4, optimizer="adamw",
                                    compensation=EVERY_RULE_FREE)
    for stage, worker, (s, o) in zip(fresh, resumed_workers, saved):
        stage.load_state_dict(s)
        worker.optimizer.load_state_dict(o)
    LocalEngine(resumed_workers, "petra").train_segment(
        iter(make_batches(7, seed=2, dtype=torch.float64)), 7)
    assert all(torch.equal(a, b) for a, b in zip(state(fresh), state(one)))


def test_a_resumed_run_takes_its_own_momentum_not_the_checkpoints():
    """torch's load_state_dict would restore each group's momentum from the checkpoint: a run
    resumed with another optim.delay_free_momentum (or momentum) must use the new one."""
    _, workers = train(segments=1)
    saved = [copy.deepcopy(w.optimizer.state_dict()) for w in workers]
    fresh = build_workers(stages_of("revnet18", 4, 10, 4, seed=0, dtype=torch.float64),
                          LRSchedule(0.2, 10**6), 2, momentum=0.9, weight_decay=1e-3,
                          compensation=DelayCompensation(free_momentum=0.0))
    for worker, o in zip(fresh, saved):
        worker.optimizer.load_state_dict(o)
    groups = [w.optimizer.torch_optimizer.param_groups for w in fresh]
    assert [g[0]["momentum"] for g in groups] == [0.9, 0.9, 0.9, 0.0]
    assert groups[-1][0]["nesterov"] is False and groups[0][0]["weight_decay"] == 1e-3
    assert "momentum_buffer" in fresh[0].optimizer.torch_optimizer.state[
        fresh[0].optimizer.params[0]]  # the state itself is the checkpoint's


def test_config_keys_reach_the_stages():
    cfg = load_config("configs/quickstart.yaml", ["optim.delay_momentum=1",
                                                  "optim.delay_prediction=0.5",
                                                  "optim.delay_lr_epochs=2",
                                                  "optim.delay_free_momentum=0.25"])
    comp = DelayCompensation.from_config(cfg.optim, steps_per_epoch=25)
    assert comp == DelayCompensation(momentum=1.0, momentum_lr=False, prediction=0.5, spike=False,
                                     lr_steps=50, free_momentum=0.25)
    assert not DelayCompensation.from_config(load_config("configs/quickstart.yaml").optim,
                                             steps_per_epoch=25).active
    with pytest.raises(ConfigError, match="delay_free_momentum"):
        validate(load_config("configs/quickstart.yaml", ["optim.delay_free_momentum=1"]))


def test_dry_run_prints_each_stages_delay_and_compensation(capsys):
    from petra_mpi.run.dryrun import report
    cfg = load_config("configs/quickstart.yaml", ["optim.delay_momentum=1",
                                                  "optim.delay_prediction=0.5",
                                                  "optim.delay_lr_epochs=1",
                                                  "optim.delay_free_momentum=0",
                                                  "model.width=4", "data.batch_size=8"])
    report(cfg, 4)
    lines = capsys.readouterr().out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("delays"))
    assert "(on;" in lines[start]
    rows = [line.split() for line in lines[start + 2:start + 6]]
    # k = 2: d_s = 6, 4, 2, 0 micro-batches, D = 3, 2, 1, 0 steps
    assert [(int(r[0]), int(r[1]), float(r[2])) for r in rows] == [
        (0, 6, 3.0), (1, 4, 2.0), (2, 2, 1.0), (3, 0, 0.0)]
    for r, D in zip(rows, (3, 2, 1, 0)):
        want = momentum_by_delay(0.9, D, 1.0, True) if D else 0.0  # the last: the free momentum
        assert float(r[3]) == pytest.approx(want, abs=5e-4)
        assert float(r[4]) == pytest.approx(0.5 * D)
        assert float(r[5]) == pytest.approx(1 / D if D > 1 else 1.0, abs=5e-4)


def test_dry_run_prints_each_stages_delay_in_updates(capsys):
    """Stage s applies its gradients d_s / k updates late, not ceil(d_s / k) nor d_s: 128 images
    per update in micro-batches of 16 (k = 8) at J = 10 puts stage 0 2.25 updates late."""
    from petra_mpi.run.dryrun import report
    cfg = load_config("configs/quickstart.yaml", ["model.stages=0", "model.width=4",
                                                  "data.batch_size=16",
                                                  "train.update_batch=128"])
    report(cfg, 10)
    lines = capsys.readouterr().out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("delays"))
    assert "k = 8" in lines[start]
    rows = [line.split() for line in lines[start + 2:start + 12]]
    assert [(int(r[1]), float(r[2])) for r in rows] == [(d, d / 8) for d in range(18, -1, -2)]
    assert float(rows[0][2]) == 2.25
