"""Causal language models as flat lists of blocks: [token embedding, decoder blocks..., head].

`revlm` is a reversible decoder: the embedding (tokens + positions) is duplicated into two
streams (x1, x2), carried as one tensor (B, T, 2D), and each block is a pair of couplings

    y1 = x1 + Attn(LN(x2))        x2 = y2 - MLP(LN(y1))
    y2 = x2 + MLP(LN(y1))         x1 = y1 - Attn(LN(x2))      (exact inverse)

with causal attention (a token sees itself and the tokens before it), so a PETRA stage of such
blocks keeps no activation between its forward and its backward. `lm` is its non-reversible twin
(standard pre-norm blocks, one stream), every block buffered. No dropout anywhere: a reversible
block's rebuild must recompute exactly what its forward computed.

The head averages the two streams, normalises and projects to the vocabulary, and returns the
logits flattened to (B·T, V), so that the per-token cross-entropy against targets flattened to
(B·T,) is the ordinary classification loss of the engine and of the evaluation.
"""
import torch
from torch import nn

from ..archs import LM_ARCHS
from .blocks import MixedPrecision
from .vit import (Attention, AttentionCore, ReversibleViTBlock, TokenHead, ViTBlock, _init,
                  mlp_branch)


class CausalAttentionCore(AttentionCore):
    """softmax(q kᵀ / √d + causal mask) v: query i attends to keys 0 … i."""

    def forward(self, q, k, v):
        n = q.shape[-2]
        scores = (q @ k.transpose(-2, -1)) * (q.shape[-1] ** -0.5)
        future = torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1)
        return scores.masked_fill(future, float("-inf")).softmax(dim=-1) @ v


def causal_attention_branch(dim, heads):
    """F = causal Attn ∘ LN."""
    attention = Attention(dim, heads)
    attention.core = CausalAttentionCore()
    return nn.Sequential(nn.LayerNorm(dim), attention)


class ReversibleDecoderBlock(ReversibleViTBlock):
    """The RevViT coupling pair (inverse and one-forward-per-branch backward inherited) with a
    causal attention branch."""

    def __init__(self, dim, heads):
        nn.Module.__init__(self)
        self.attn, self.mlp = causal_attention_branch(dim, heads), mlp_branch(dim)


class DecoderBlock(ViTBlock):
    """Pre-norm decoder block x + Attn(LN(x)), then + MLP(LN(·)), causal. Buffered."""

    def __init__(self, dim, heads):
        nn.Module.__init__(self)
        self.attn, self.mlp = causal_attention_branch(dim, heads), mlp_branch(dim)


class TokenEmbed(MixedPrecision, nn.Module):
    """Token ids (B, T) -> token + position embeddings (B, T, streams·D), the streams copies of
    each other. Buffered: its input is the raw ids, which cost little to keep."""
    reversible = False
    input_dtype = torch.long  # what a shape probe of its stage must feed it

    def __init__(self, vocab, dim, context, streams):
        super().__init__()
        self.streams, self.context = streams, context
        self.tok = nn.Embedding(vocab, dim)
        self.pos_embed = nn.Parameter(torch.zeros(1, context, dim))
        # Unit scale, not GPT-2's 0.02: the branches' outputs are of unit scale from the start,
        # and a stream of 0.02 under them is rebuilt with the rounding of the whole stream,
        # 3e-3 to 6e-3 relative after 24 blocks in fp32 against 1.5e-6 at unit scale (docs/lm.md).
        nn.init.normal_(self.tok.weight, std=1.0)
        nn.init.normal_(self.pos_embed, std=1.0)

    def forward(self, tokens):
        T = tokens.shape[1]
        if T > self.context:
            raise ValueError(f"a sequence of {T} tokens is longer than model.context {self.context}")
        x = self.tok(tokens) + self.pos_embed[:, :T]
        return torch.cat([x] * self.streams, dim=-1) if self.streams > 1 else x


class LMHead(TokenHead):
    """Streams averaged, LN, linear to the vocabulary; logits flattened to (B·T, V)."""

    def __init__(self, dim, vocab, streams):
        super().__init__(dim, vocab, streams, bias=False)

    def forward(self, x):
        logits = self.sub(lambda t: self.fc(self.norm(t)), self.merged(x))
        return logits.reshape(-1, logits.shape[-1])


def build_lm_blocks(arch: str, width: int, vocab: int, *, depth: int, heads: int, context: int,
                    tie_weights: bool = False) -> list[nn.Module]:
    """[embedding, depth decoder blocks, head]; width is D, the features per stream.

    tie_weights: the head's projection is the token embedding's table (one tensor). With one
    weight copy per stage that only exists when the embedding and the head are on the same stage,
    i.e. J = 1 (config.validate refuses it otherwise)."""
    if arch not in LM_ARCHS:
        raise ValueError(f"unknown language model {arch!r}; choose one of {list(LM_ARCHS)}")
    if depth < 1 or heads < 1 or width % heads:
        raise ValueError(f"model.width {width} must be a multiple of model.heads {heads} "
                         f"(depth {depth} >= 1)")
    reversible = arch == "revlm"
    streams = 2 if reversible else 1
    block = ReversibleDecoderBlock if reversible else DecoderBlock
    blocks = [TokenEmbed(vocab, width, context, streams)]
    blocks += [block(width, heads) for _ in range(depth)]
    blocks.append(LMHead(width, vocab, streams))
    for b in blocks[1:]:
        _init(b)
    if tie_weights:
        blocks[-1].fc.weight = blocks[0].tok.weight
    return blocks
