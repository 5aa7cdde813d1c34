"""Networks of one's own as a user writes them: a package written into a temporary folder at test
time and named by model.arch as an import path (models/own.py), for pictures ("NAME.net:build")
and for tokens, a causal language model ("NAME.net:build_lm")."""
import sys
from pathlib import Path

PACKAGE = "own_net_pkg"

NET = '''
import torch
import torch.nn.functional as F
from torch import nn

from petra_mpi.models import AdditiveCoupling, BatchNorm2d, ReversibleBlock
from petra_mpi.models.lm import causal_attention_branch
from petra_mpi.models.vit import mlp_branch


def branch(c):
    return nn.Sequential(nn.Conv2d(c, c, 3, 1, 1, bias=False), BatchNorm2d(c), nn.ReLU(),
                         nn.Conv2d(c, c, 3, 1, 1))


class ChannelScale(nn.Module):
    """y = x · exp(a), one a per channel: reversible with an inverse alone (the stage rebuilds
    the input with it and differentiates the forward again)."""
    reversible = True

    def __init__(self, channels):
        super().__init__()
        self.log_scale = nn.Parameter(0.1 * torch.randn(1, channels, 1, 1))

    def forward(self, x):
        return x * torch.exp(self.log_scale)

    def inverse(self, y):
        return y * torch.exp(-self.log_scale)


class Head(nn.Module):
    def __init__(self, c, classes):
        super().__init__()
        self.norm, self.fc = BatchNorm2d(c), nn.Linear(c, classes)

    def forward(self, x):
        return self.fc(F.relu(self.norm(x)).mean(dim=(2, 3)))


def build(model):
    """[stem (a plain Sequential: an ordinary block), additive coupling, channel scale, RevNet
    coupling, an ordinary block that halves the resolution, head]."""
    c = model.width
    return [nn.Sequential(nn.Conv2d(3, 2 * c, 3, 1, 1, bias=False), BatchNorm2d(2 * c), nn.ReLU()),
            AdditiveCoupling(branch(c), branch(c)),
            ChannelScale(2 * c),
            ReversibleBlock(branch(c)),
            nn.Sequential(nn.Conv2d(2 * c, 4 * c, 3, 2, 1), BatchNorm2d(4 * c)),
            Head(4 * c, model.num_classes)]


class Embed(nn.Module):
    input_dtype = torch.long  # the first block of a language model reads token ids

    def __init__(self, vocab, dim, context):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, dim), nn.Parameter(torch.randn(1, context, dim))

    def forward(self, ids):
        x = self.tok(ids) + self.pos[:, :ids.shape[1]]
        return torch.cat([x, x], dim=-1)


class LMHead(nn.Module):
    def __init__(self, dim, vocab):
        super().__init__()
        self.norm, self.fc = nn.LayerNorm(dim), nn.Linear(dim, vocab)

    def forward(self, x):
        x1, x2 = x.chunk(2, dim=-1)
        logits = self.fc(self.norm((x1 + x2) / 2))
        return logits.reshape(-1, logits.shape[-1])  # one row per token, as the loss takes them


def build_lm(model):
    """[embedding, model.depth causal couplings, head]: a causal language model of one's own."""
    dim, heads = model.width, model.heads or 1
    return ([Embed(model.num_classes, dim, model.context)]
            + [AdditiveCoupling(causal_attention_branch(dim, heads), mlp_branch(dim), dim=-1)
               for _ in range(model.depth)]
            + [LMHead(dim, model.num_classes)])
'''


def write_package(root: Path) -> str:
    """root/PACKAGE, a package holding net.py; returns the package's name (put root on the
    Python path to import it)."""
    package = root / PACKAGE
    package.mkdir(parents=True, exist_ok=True)
    (package / "__init__.py").write_text("")
    (package / "net.py").write_text(NET)
    return PACKAGE


def forget_package():
    """Drop the package's modules from this process (the next test writes it afresh)."""
    for name in [n for n in sys.modules if n == PACKAGE or n.startswith(PACKAGE + ".")]:
        del sys.modules[name]


PICTURES = f"{PACKAGE}.net:build"
LANGUAGE = f"{PACKAGE}.net:build_lm"
