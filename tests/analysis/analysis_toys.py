"""Hand-written models (no adapter exists for them) that exercise one rule of the analysis each."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Block(nn.Module):
    """A Pre-LN block: x + attn(ln_1(x)); x + mlp(ln_2(x))."""

    def __init__(self, d: int, heads: int, dropout: float = 0.0):
        super().__init__()
        self.heads = heads
        self.ln_1, self.ln_2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))
        self.fc, self.proj = nn.Linear(d, 3 * d), nn.Linear(3 * d, d)
        self.drop = nn.Dropout(dropout)

    def attn(self, h):
        b, t, d = h.shape
        q, k, v = (f(h).view(b, t, self.heads, d // self.heads).transpose(1, 2) for f in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(b, t, d))

    def forward(self, x):
        x = x + self.drop(self.attn(self.ln_1(x)))
        return x + self.drop(self.proj(F.gelu(self.fc(self.ln_2(x)))))


class PreLN(nn.Module):
    """A small Pre-LN language model: token table + learned position parameter, blocks, final norm, head.

    tie: the head reuses the token table (nn.Linear whose weight is the embedding's);
    stem: a GELU "stem" on the embeddings (its output is not zero-mean, so nothing folds)."""

    def __init__(self, vocab=31, d=12, layers=2, heads=3, seq=16, tie=False, stem=False, dropout=0.0):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.randn(seq, d) * 0.1)
        self.stem = nn.Linear(d, d) if stem else None
        self.blocks = nn.ModuleList(Block(d, heads, dropout) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        if tie:
            self.head.weight = self.tok.weight

    def forward(self, ids):
        x = self.tok(ids) + self.pos[: ids.shape[1]]
        if self.stem is not None:
            x = F.gelu(self.stem(x))
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.ln_f(x))


class PostLN(nn.Module):
    """Post-LN: x = ln(x + f(x)), the norms sit on the stream with their affine."""

    def __init__(self, vocab=31, d=12, layers=2):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.ln_e = nn.LayerNorm(d)
        self.fcs = nn.ModuleList(nn.Linear(d, d) for _ in range(layers))
        self.lns = nn.ModuleList(nn.LayerNorm(d) for _ in range(layers))

    def forward(self, ids):
        x = self.ln_e(self.tok(ids))
        for fc, ln in zip(self.fcs, self.lns):
            x = ln(x + fc(x))
        return x


class Sandwich(nn.Module):
    """Norms without affine / with constant γ feed zero-mean outputs onward; a writer whose output also
    feeds a GELU cannot be centred; a 2-D LayerNorm does not fold."""

    def __init__(self, d=8, affine_free=True):
        super().__init__()
        self.inp = nn.Linear(5, d)
        self.ln_a = nn.LayerNorm(d, elementwise_affine=not affine_free)
        self.w = nn.Linear(d, d)
        self.ln_b = nn.LayerNorm(d)
        self.side = nn.Linear(d, d)
        self.ln_c = nn.LayerNorm(d)
        self.ln_2d = nn.LayerNorm((4, d))

    def forward(self, x):
        a = self.ln_a(self.inp(x))          # foldable: inp is a writer only the norm sees
        b = self.ln_b(a + self.w(a))        # foldable iff ln_a's output is zero-mean
        s = self.side(b)
        c = self.ln_c(b + s) + F.gelu(s)    # side's output also reaches a GELU: not centrable
        return self.ln_2d(c)


def realistic_norms(model: nn.Module, seed: int = 0) -> nn.Module:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.LayerNorm) and m.weight is not None:
                m.weight.copy_(1 + 0.5 * torch.randn(m.weight.shape, generator=g))
                m.bias.copy_(0.5 * torch.randn(m.bias.shape, generator=g))
            if isinstance(m, nn.Embedding):
                m.weight.add_(2.0 * torch.randn(m.weight.shape[0], 1, generator=g))
    return model
