"""Vision transformers as flat lists of blocks: [patch embedding, transformer blocks..., head].

`revvit` is the reversible ViT of Mangalam et al. (CVPR 2022): the patch embedding is duplicated
into two token streams (x1, x2), carried as one tensor (B, N, 2D) with the streams concatenated
along the feature dimension, and each block is a pair of couplings

    y1 = x1 + Attn(LN(x2))        x2 = y2 - MLP(LN(y1))
    y2 = x2 + MLP(LN(y1))         x1 = y1 - Attn(LN(x2))      (exact inverse)

so a PETRA stage of such blocks keeps no activation between its forward and its backward.
`vit` is its non-reversible twin (standard pre-norm blocks, one stream of width D), every block
buffered, for the baseline. No batch norm, no dropout, no drop-path.
"""
import math

import torch
from torch import nn

from ..archs import DEFAULT_DEPTH, VIT_ARCHS, default_heads  # noqa: F401 (VIT_ARCHS re-exported)
from .blocks import MixedPrecision, joined



class AttentionCore(nn.Module):
    """softmax(q kᵀ / √d) v for (B, heads, N, d) tensors. A leaf module without weights, so that
    partition.block_costs can count its two matrix products through `macs`."""

    def forward(self, q, k, v):
        scores = (q @ k.transpose(-2, -1)) * (q.shape[-1] ** -0.5)
        return scores.softmax(dim=-1) @ v

    @staticmethod
    def macs(inputs, output) -> float:
        q = inputs[0]
        b_h, n, d = q.numel() // (q.shape[-2] * q.shape[-1]), q.shape[-2], q.shape[-1]
        return 2.0 * b_h * n * n * d + 4.0 * b_h * n * n  # q kᵀ, (attn) v, softmax elements


class Attention(nn.Module):
    """Multi-head self-attention over tokens (B, N, D).

    Biases on q and v but not on k (as BEiT): a key bias adds q·b to every score of a query, which
    the softmax cancels, so its gradient is exactly 0 and AdamW would step it by rounding noise
    divided by its ε (seen as 1e-11 differences between equal float64 runs)."""

    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.q_bias = nn.Parameter(torch.zeros(dim))
        self.v_bias = nn.Parameter(torch.zeros(dim))
        self.core = AttentionCore()
        self.proj = nn.Linear(dim, dim)

    def forward(self, x):
        B, N, D = x.shape
        bias = torch.cat([self.q_bias, torch.zeros_like(self.q_bias), self.v_bias])
        qkv = self.qkv(x) + bias
        q, k, v = qkv.reshape(B, N, 3, self.heads, D // self.heads).permute(2, 0, 3, 1, 4)
        out = self.core(q, k, v).transpose(1, 2).reshape(B, N, D)
        return self.proj(out)


def attention_branch(dim, heads):
    """F = Attn ∘ LN."""
    return nn.Sequential(nn.LayerNorm(dim), Attention(dim, heads))


def mlp_branch(dim, ratio=4):
    """G = MLP ∘ LN (hidden width ratio · D, GELU)."""
    return nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, ratio * dim), nn.GELU(),
                         nn.Linear(ratio * dim, dim))


class PatchEmbed(MixedPrecision, nn.Module):
    """Conv patchify (kernel = stride = patch) plus a learned position embedding; with streams=2
    the tokens are duplicated into the two streams of a reversible net: (B, N, streams·D)."""
    reversible = False

    def __init__(self, dim, patch, image_size, streams):
        super().__init__()
        if patch < 1 or image_size % patch:
            raise ValueError(f"model.patch {patch} must divide the image side {image_size}")
        self.streams = streams
        self.proj = nn.Conv2d(3, dim, patch, patch)
        self.pos_embed = nn.Parameter(torch.zeros(1, (image_size // patch) ** 2, dim))
        nn.init.trunc_normal_(self.pos_embed, std=0.02)

    def forward(self, x):
        tokens = self.sub(self.proj, x).flatten(2).transpose(1, 2) + self.pos_embed
        return torch.cat([tokens] * self.streams, dim=-1) if self.streams > 1 else tokens


class ReversibleViTBlock(MixedPrecision, nn.Module):
    """Two couplings: y1 = x1 + F(x2), y2 = x2 + G(y1), F = Attn∘LN, G = MLP∘LN."""
    reversible = True

    def __init__(self, dim, heads):
        super().__init__()
        self.attn, self.mlp = attention_branch(dim, heads), mlp_branch(dim)

    def forward(self, x):
        x1, x2 = x.chunk(2, dim=-1)
        y1 = x1 + self.sub(self.attn, x2)
        return joined(x, -1, torch.add, x2, self.sub(self.mlp, y1), y1, op_first=False)

    def inverse(self, y):
        y1, y2 = y.chunk(2, dim=-1)
        x2 = y2 - self.sub(self.mlp, y1)
        return joined(y, -1, torch.sub, y1, self.sub(self.attn, x2), x2)

    def backward_from_output(self, y, grad_y, need_grad_x=True):
        """Rebuild x from y with the current weights while recording the graphs of G and then F
        (one forward of each), and back-propagate δy through them: accumulates the parameter
        gradients and returns (x, δx) (δx None when not needed).

        y1 is an input of G, so its total gradient is δy1 + Gᵀδy2 (this is δx1), and
        δx2 = δy2 + Fᵀ(δy1 + Gᵀδy2)."""
        y1, y2 = y.chunk(2, dim=-1)
        g1, g2 = grad_y.chunk(2, dim=-1)
        y1_leaf = y1.detach().requires_grad_(True)
        with torch.enable_grad():
            g = self.sub(self.mlp, y1_leaf)
        x2 = y2 - g.detach()
        g.backward(g2)
        grad_x1 = g1 + y1_leaf.grad
        x2_leaf = x2.detach().requires_grad_(need_grad_x)
        with torch.enable_grad():
            f = self.sub(self.attn, x2_leaf)
        x = joined(y, -1, torch.sub, y1, f.detach(), x2)
        f.backward(grad_x1)
        grad_x = (joined(grad_y, -1, torch.add, g2, x2_leaf.grad, grad_x1, op_first=False)
                  if need_grad_x else None)
        return x, grad_x


class ViTBlock(MixedPrecision, nn.Module):
    """Standard pre-norm transformer block: x + Attn(LN(x)), then + MLP(LN(·)). Buffered."""
    reversible = False

    def __init__(self, dim, heads):
        super().__init__()
        self.attn, self.mlp = attention_branch(dim, heads), mlp_branch(dim)

    def forward(self, x):
        x = x + self.sub(self.attn, x)
        return x + self.sub(self.mlp, x)


class TokenHead(MixedPrecision, nn.Module):
    """The last block of a transformer: LN and a linear layer on tokens' features, a reversible
    net's streams averaged first (`merged`); the subclass says which tokens."""
    reversible = False

    def __init__(self, dim, outputs, streams, bias=True):
        super().__init__()
        self.streams = streams
        self.norm = nn.LayerNorm(dim)
        self.fc = nn.Linear(dim, outputs, bias=bias)

    def merged(self, x):
        return sum(x.chunk(self.streams, dim=-1)) / self.streams if self.streams > 1 else x


class ViTHead(TokenHead):
    """LN, mean pool over tokens, linear; a reversible net's two streams are averaged first."""

    def forward(self, x):
        return self.sub(lambda t: self.fc(self.norm(t).mean(dim=1)), self.merged(x))


def build_vit_blocks(arch: str, width: int, num_classes: int, *, image_size: int = 32,
                     depth: int = 0, heads: int = 0, patch: int = 4) -> list[nn.Module]:
    """[patch embedding, depth transformer blocks, head]; width is D, the features per stream."""
    depth, heads = depth or DEFAULT_DEPTH, heads or default_heads(width)
    if width % heads:
        raise ValueError(f"model.width {width} must be a multiple of model.heads {heads}")
    reversible = arch == "revvit"
    streams = 2 if reversible else 1
    block = ReversibleViTBlock if reversible else ViTBlock
    blocks = [PatchEmbed(width, patch, image_size, streams)]
    blocks += [block(width, heads) for _ in range(depth)]
    blocks.append(ViTHead(width, num_classes, streams))
    for b in blocks:
        _init(b)
    return blocks


def _init(module):
    """Truncated normal of std 1/√fan_in for every linear layer and the patchify conv.

    Not ViT's fixed std 0.02: that value suits widths of 384–768 (0.02·√768 ≈ 0.55); at width 64
    it puts every pre-activation at ~0.16, where GELU and softmax are nearly linear, so the
    branches start as an almost linear map of the patches. The synthetic gratings (random phase
    and colour sign) need even features such as energies; with std 0.02 the quickstart sat on a
    plateau at loss 2.30 for ~150 steps before it found them (docs/revvit.md)."""
    for m in module.modules():
        if isinstance(m, (nn.Linear, nn.Conv2d)):
            fan_in = m.weight[0].numel()  # in_features, or in_channels · kernel area
            nn.init.trunc_normal_(m.weight, std=math.sqrt(1.0 / fan_in))
            if m.bias is not None:
                nn.init.zeros_(m.bias)
