"""Two branches F and G made into a reversible block (the couplings of RevNet, RevViT, memcnn's
AdditiveCoupling and normalising flows' affine couplings), for networks of one's own
(docs/own_model.md): the input is cut in two halves (x1, x2) along `dim` and

    additive:  y1 = x1 + F(x2)                  x2 = y2 - G(y1)
               y2 = x2 + G(y1)                  x1 = y1 - F(x2)
    affine:    y1 = x1 · exp(s1) + t1,  (s1, t1) = F(x2) cut in two along dim, s1 squashed by tanh
               y2 = x2 · exp(s2) + t2,  (s2, t2) = G(y1)   (inverse: x = (y - t) · exp(-s))

F and G may be any modules that are deterministic in training mode (no dropout; batch norm as
models.BatchNorm2d, which leaves its running statistics to the backward); for the affine coupling
they return twice the channels of their input half. The backward from the output runs each
branch once, under autograd, to rebuild the input and back-propagate through it.
"""
import torch
from torch import nn

from .blocks import MixedPrecision


class AdditiveCoupling(MixedPrecision, nn.Module):
    """y1 = x1 + F(x2), y2 = x2 + G(y1), the halves cut along `dim` (1: channels of a picture's
    feature map; -1: features of tokens)."""
    reversible = True

    def __init__(self, f: nn.Module, g: nn.Module, dim: int = 1):
        super().__init__()
        self.f, self.g, self.dim = f, g, dim

    def branch_f(self, x2):
        """F in the block's compute precision (MixedPrecision), in x2's dtype."""
        return self.sub(self.f, x2)

    def branch_g(self, y1):
        return self.sub(self.g, y1)

    @staticmethod
    def couple(x, h):
        """One half's output from its input x and its branch's output h."""
        return x + h

    @staticmethod
    def uncouple(y, h):
        """couple's inverse: the half's input from its output y and h."""
        return y - h

    def forward(self, x):
        x1, x2 = x.chunk(2, dim=self.dim)
        y1 = self.couple(x1, self.branch_f(x2))
        return torch.cat([y1, self.couple(x2, self.branch_g(y1))], dim=self.dim)

    def inverse(self, y):
        y1, y2 = y.chunk(2, dim=self.dim)
        x2 = self.uncouple(y2, self.branch_g(y1))
        return torch.cat([self.uncouple(y1, self.branch_f(x2)), x2], dim=self.dim)

    def backward_from_output(self, y, grad_y, need_grad_x=True):
        """Rebuild x from y with the current weights while recording the graphs of G and then F
        (one forward of each), and back-propagate δy through them: accumulates the parameter
        gradients and returns (x, δx) (δx None when not needed). y1 feeds G, so its gradient
        is δy1 plus what comes back through G; that is the gradient of y1 = couple(x1, F(x2))."""
        y1, y2 = y.chunk(2, dim=self.dim)
        g1, g2 = grad_y.chunk(2, dim=self.dim)
        x2, grad_x2, grad_y1 = self._rebuild_half(self.branch_g, y1, y2, g2, True)
        grad_y1 = g1 + grad_y1
        x1, grad_x1, grad_x2_f = self._rebuild_half(self.branch_f, x2, y1, grad_y1, need_grad_x)
        x = torch.cat([x1, x2], dim=self.dim)
        grad_x = (torch.cat([grad_x1, grad_x2 + grad_x2_f], dim=self.dim) if need_grad_x
                  else None)
        return x, grad_x

    def _rebuild_half(self, branch, source, y, grad_y, need_grad_source):
        """One half: its input x from its output y and its branch's output on `source`, that
        branch run once under autograd, then δy back-propagated through y = couple(x, branch(
        source)). Returns (x, δx, δsource); the branch's parameter gradients accumulate."""
        source = source.detach().requires_grad_(need_grad_source)
        with torch.enable_grad():
            h = branch(source)
            x = self.uncouple(y.detach(), h.detach()).requires_grad_(True)
            self.couple(x, h).backward(grad_y)
        return x.detach(), x.grad, source.grad


class AffineCoupling(AdditiveCoupling):
    """Each half y = x · exp(s) + t, (s, t) its branch's output cut in two along `dim`, with s
    squashed by tanh (scales between 1/e and e keep the inverse well conditioned)."""

    def couple(self, x, h):
        s, t = h.chunk(2, dim=self.dim)
        return x * torch.exp(torch.tanh(s)) + t

    def uncouple(self, y, h):
        s, t = h.chunk(2, dim=self.dim)
        return (y - t) * torch.exp(-torch.tanh(s))
