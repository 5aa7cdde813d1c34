"""Blocks PETRA cannot train, each refused by `python -m petra_mpi.check_model` with one line
naming it (docs/own_model.md; examples/broken.yaml). The network is [stem, a sound coupling,
the faulty block, head]; model.options.fault picks the fault of block 2:

    dropout         a coupling with dropout in a branch: the rebuild meets another mask
    batchnorm       torch.nn.BatchNorm2d in a branch: it updates its running statistics in
                    PETRA's forward, and again in the backward
    inverse         a coupling whose inverse subtracts the branch of the wrong half
    not_invertible  declared reversible, but its forward drops half of its input
    gradient        a coupling whose own backward_from_output forgets a term of the gradient

`not_a_network` returns something else than a list of blocks.
"""
import torch
from torch import nn

from petra_mpi.models import AdditiveCoupling, BatchNorm2d, ReversibleBlock


def branch(channels, norm=BatchNorm2d, dropout=0.0):
    layers = [nn.Conv2d(channels, channels, 3, 1, 1, bias=False), norm(channels), nn.ReLU()]
    return nn.Sequential(*layers, *([nn.Dropout(dropout)] if dropout else []))


class WrongInverse(ReversibleBlock):
    """RevNet's coupling (y1, y2) = (x2 + F(x1), x1), with F of y1 taken off instead of F of y2."""

    def inverse(self, y):
        y1, y2 = y.chunk(2, dim=1)
        return torch.cat([y2, y1 - self.f(y1)], dim=1)


class DropsHalf(nn.Module):
    """(y1, y2) = (F(x1), x1): x2 is lost, whatever the inverse says."""
    reversible = True

    def __init__(self, channels):
        super().__init__()
        self.f = branch(channels)

    def forward(self, x):
        x1, _ = x.chunk(2, dim=1)
        return torch.cat([self.f(x1), x1], dim=1)

    def inverse(self, y):
        y1, y2 = y.chunk(2, dim=1)
        return torch.cat([y2, y1 - self.f(y2)], dim=1)


class ForgetfulBackward(AdditiveCoupling):
    """An additive coupling whose backward leaves out what flows back to x2 through G."""

    def backward_from_output(self, y, grad_y, need_grad_x=True):
        x, grad_x = super().backward_from_output(y, grad_y, need_grad_x)
        if grad_x is not None:
            grad_x1, _ = grad_x.chunk(2, dim=1)
            grad_x = torch.cat([grad_x1, grad_y.chunk(2, dim=1)[1]], dim=1)
        return x, grad_x


def faulty_block(fault, c):
    if fault == "dropout":
        return AdditiveCoupling(branch(c, dropout=0.1), branch(c))
    if fault == "batchnorm":
        return AdditiveCoupling(branch(c, norm=nn.BatchNorm2d), branch(c))
    if fault == "inverse":
        return WrongInverse(branch(c))
    if fault == "not_invertible":
        return DropsHalf(c)
    if fault == "gradient":
        return ForgetfulBackward(branch(c), branch(c))
    raise ValueError(f"model.options.fault must be dropout, batchnorm, inverse, not_invertible "
                     f"or gradient, got {fault!r}")


class Head(nn.Module):
    def __init__(self, channels, num_classes):
        super().__init__()
        self.fc = nn.Linear(channels, num_classes)

    def forward(self, x):
        return self.fc(x.mean(dim=(2, 3)))


def build(model):
    c = model.width
    return [nn.Sequential(nn.Conv2d(3, 2 * c, 3, 1, 1), BatchNorm2d(2 * c)),
            AdditiveCoupling(branch(c), branch(c)),
            faulty_block(model.options.get("fault", "dropout"), c),
            Head(2 * c, model.num_classes)]


def not_a_network(model):
    return {"stem": nn.Conv2d(3, 2 * model.width, 3)}
