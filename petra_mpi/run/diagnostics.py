"""Gradient-quality diagnostics (paper Appendix B), single-process engine only.

For one micro-batch every `every` optimizer steps, per stage:
- PETRA gradient: what the stage's backward really accumulated (current weights, rebuilt input);
- delayed gradient (Zhuang et al.): back-propagation through the inputs and weights each stage
  had at that micro-batch's forward (what weight stashing plus input buffers compute);
- end-to-end gradient: plain back-propagation of the same micro-batch through the current weights
  once its PETRA backward has reached stage 0 (before stage 0's optimizer step of that tick);
with their cosine similarities and norm ratios, and the relative error of the rebuilt stage input.
Batch-norm running statistics are not touched by the extra passes.
"""
import torch
import torch.nn.functional as F

from ..core.worker import WorkerHooks
from ..models import frozen_bn_stats
from ..core.schedule import Kind


class Diagnostics(WorkerHooks):
    """Hooks for every worker of a LocalEngine (build_workers(hooks=[...])): records the chosen
    micro-batches around the workers' own actions and emits one record per stage."""

    def __init__(self, every_steps: int, accumulation: int, emit=None):
        self.period, self.emit = every_steps * accumulation, emit
        self.entered = 0     # micro-batches forwarded by stage 0 so far
        self.stages = {}     # stage index -> Stage, as the workers show themselves
        self.active = {}     # micro-batch -> per-stage records (b is the segment's index)

    def before(self, worker, action, x=None, labels=None):
        s, b = worker.index, action.microbatch
        self.stages[s] = worker.stage
        if action.kind in (Kind.FORWARD, Kind.FORWARD_BACKWARD):
            if s == 0:
                if self.entered % self.period == 0:
                    self.active[b] = {}
                self.entered += 1
            if b in self.active:
                self.active[b][s] = {"x": x.detach().clone(), "labels": labels,
                                     "theta": _clone_params(worker), "rebuilt": None}
        if action.kind in (Kind.BACKWARD, Kind.FORWARD_BACKWARD) and b in self.active:
            self.active[b][s]["before"] = _grads(worker)

    def after(self, worker, action, x=None):
        s, b = worker.index, action.microbatch
        if action.kind not in (Kind.BACKWARD, Kind.FORWARD_BACKWARD) or b not in self.active:
            return
        record = self.active[b][s]
        # what this backward alone added to the accumulated gradient
        record["petra"] = [a - c for a, c in zip(_grads(worker), record.pop("before"))]
        if action.kind is Kind.BACKWARD and not worker.stage.buffered[0]:
            record["rebuilt"] = x.detach().clone()
        if s == 0:  # its backward has reached stage 0 (J = 1: the forward_backward)
            self._report(b, self.active.pop(b))

    def _report(self, b, records):
        stages = [self.stages[s] for s in range(len(self.stages))]
        labels = records[len(stages) - 1]["labels"]
        delayed = _chain_gradients(stages, [records[s]["x"] for s in range(len(stages))],
                                   labels, [records[s]["theta"] for s in range(len(stages))])
        e2e = _chain_gradients(stages, [records[0]["x"]], labels, None)
        results = []
        for s, stage in enumerate(stages):
            p, d, e = (_flat(g) for g in (records[s]["petra"], delayed[s], e2e[s]))
            rebuilt = records[s]["rebuilt"]
            x = records[s]["x"]
            results.append({
                "stage": s,
                "cos_petra_delayed": _cos(p, d), "cos_petra_e2e": _cos(p, e),
                "cos_delayed_e2e": _cos(d, e),
                "norm_petra_delayed": _ratio(p, d), "norm_petra_e2e": _ratio(p, e),
                "norm_delayed_e2e": _ratio(d, e),
                "rebuild_error": (None if rebuilt is None else
                                  ((rebuilt - x).norm() / x.norm().clamp_min(1e-30)).item()),
            })
        if self.emit is not None:
            for r in results:
                self.emit(r)
        self.last = results


def _clone_params(w):
    return [p.detach().clone() for p in w.stage.parameters()]


def _grads(w):
    return [p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p)
            for p in w.stage.parameters()]


def _chain_gradients(stages, inputs, labels, thetas):
    """Per-stage parameter gradients of the loss of one micro-batch. With one input, a plain
    forward through every stage with the current weights; with per-stage inputs and weights,
    each stage is differentiated at its own (stored) point and the input gradients chain down."""
    params = [list(s.parameters()) for s in stages]
    saved = [[p.data for p in ps] for ps in params]
    try:
        if thetas is not None:
            for ps, th in zip(params, thetas):
                for p, t in zip(ps, th):
                    p.data = t
        with frozen_bn_stats(), torch.enable_grad():
            if len(inputs) == 1:  # end to end
                x = inputs[0]
                for stage in stages:
                    for block in stage.blocks:
                        x = block(x)
                loss = F.cross_entropy(x, labels)
                flat = [p for ps in params for p in ps]
                grads = torch.autograd.grad(loss, flat, allow_unused=True)
                out, i = [], 0
                for ps in params:
                    out.append(_fill(grads[i:i + len(ps)], ps))
                    i += len(ps)
                return out
            out = [None] * len(stages)
            delta = None
            for s in reversed(range(len(stages))):
                x = inputs[s].detach().requires_grad_(s > 0)
                y = x
                for block in stages[s].blocks:
                    y = block(y)
                if s == len(stages) - 1:
                    y, upstream = F.cross_entropy(y, labels), None
                else:
                    upstream = delta
                wrt = params[s] + ([x] if s > 0 else [])
                grads = torch.autograd.grad(y, wrt, grad_outputs=upstream, allow_unused=True)
                out[s] = _fill(grads[:len(params[s])], params[s])
                delta = grads[-1] if s > 0 else None
            return out
    finally:
        for ps, data in zip(params, saved):
            for p, d in zip(ps, data):
                p.data = d


def _fill(grads, params):
    return [torch.zeros_like(p) if g is None else g for g, p in zip(grads, params)]


def _flat(grads):
    return torch.cat([g.reshape(-1).double() for g in grads]) if grads else torch.zeros(1)


def _cos(a, b):
    den = a.norm() * b.norm()
    return (a @ b / den).item() if den > 0 else None


def _ratio(a, b):
    nb = b.norm().item()
    return a.norm().item() / nb if nb > 0 else None
