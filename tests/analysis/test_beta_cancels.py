"""β into bias-less key projections (issue 13): a norm's β read through a key projection adds the same
vector c = βW_k to every key; q·c is then constant along each row of the scores, and softmax over the keys
drops it. The analysis proves it per reader; these toys force each case where it does NOT cancel, and the
brute-force check (drop β anyway, compare outputs) shows the analysis is right both ways."""

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import normfold
from helpers import rel_err
from normfold.adapters.base import ConversionPlan, NormSite, StreamPlan
from normfold.analysis import analyze

D, H, T, V = 12, 3, 7, 23


class Attn(nn.Module):
    def __init__(self, mode: str):
        super().__init__()
        self.mode = mode
        self.ln = nn.LayerNorm(D)
        self.q, self.k, self.v = nn.Linear(D, D), nn.Linear(D, D, bias=False), nn.Linear(D, D)
        self.o = nn.Linear(D, D)
        with torch.no_grad():
            self.ln.weight.uniform_(0.5, 1.5)
            self.ln.bias.normal_(0, 0.5)
        slopes = torch.tensor([2.0 ** (-i - 1) for i in range(H)])
        self.register_buffer("alibi", slopes[:, None, None] * torch.arange(T)[None, None, :], persistent=False)
        pos = torch.arange(T)[:, None] * torch.arange(1, D // H // 2 + 1)[None, :] * 0.3
        self.register_buffer("cos", torch.cos(pos).repeat(1, 2), persistent=False)
        self.register_buffer("sin", torch.sin(pos).repeat(1, 2), persistent=False)
        self.key_scale = nn.Parameter(torch.linspace(0.5, 2.0, T))

    def heads(self, x):
        b, t, _ = x.shape
        return x.view(b, t, H, D // H).transpose(1, 2)

    def forward(self, x):
        h = self.ln(x)
        q, k, v = self.heads(self.q(h)), self.heads(self.k(h)), self.heads(self.v(h))
        if self.mode == "rope":  # keys rotated per position: R_j c differs per key j
            half = k.shape[-1] // 2
            rot = torch.cat([-k[..., half:], k[..., :half]], dim=-1)
            k = k * self.cos + rot * self.sin
        if self.mode == "keys_as_values":
            v = v + k
        if self.mode == "sdpa":
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            s = q @ k.transpose(-1, -2) / math.sqrt(D // H)
            mask = torch.full((T, T), float("-inf")).triu(1)
            s = s + mask + self.alibi  # additive: a causal mask and ALiBi's per-key bias
            if self.mode == "per_key_scale":
                s = s * self.key_scale  # varies along the keys: q·c is no longer constant per row
            y = s.softmax(-1) @ v
        y = self.o(y.transpose(1, 2).reshape(x.shape))
        if self.mode == "keys_out":  # the keys leave the model (a cache)
            return x + y, k
        return x + y


class Toy(nn.Module):
    def __init__(self, mode: str):
        super().__init__()
        self.tok = nn.Embedding(V, D)
        self.block = Attn(mode)
        self.ln_f = nn.LayerNorm(D)
        self.head = nn.Linear(D, V)

    def forward(self, ids):
        out = self.block(self.tok(ids))
        if isinstance(out, tuple):
            return self.head(self.ln_f(out[0])), out[1]
        return self.head(self.ln_f(out))


CANCELS = ["sdpa", "eager_alibi_mask"]
BREAKS = ["rope", "per_key_scale", "keys_out", "keys_as_values"]


def _model(mode):
    torch.manual_seed(0)
    return Toy(mode).double().eval()


def _ids():
    return {"ids": torch.randint(0, V, (2, T), generator=torch.Generator().manual_seed(1))}


def _drop_beta_anyway(model):
    """Brute force: fold γ and drop β's key term whatever the analysis says."""
    site = NormSite("block.ln", ("block.q", "block.k", "block.v"), beta_cancels=("block.k",))
    plan = ConversionPlan("test", [StreamPlan("s", writers=["tok", "block.o"], norms=[site])])
    from normfold.adapters import Adapter

    adapter = Adapter("test", "test", plan=lambda m: plan, example_inputs=lambda m, g: _ids())
    conv, _ = normfold.convert(model, adapter=adapter, inputs=_ids())
    return conv


def _outputs(model):
    with torch.no_grad():
        out = model(**_ids())
    return out if isinstance(out, tuple) else (out,)


@pytest.mark.parametrize("mode", CANCELS + BREAKS)
def test_analysis_finds_exactly_the_cancelling_keys(mode):
    model = _model(mode)
    report = analyze(model, _ids())
    ln = report.norm("block.ln")
    assert ln.foldable and ln.affine_foldable
    assert ln.beta_cancels == (["block.k"] if mode in CANCELS else [])
    # brute force agrees: dropping β's key term is exact iff the analysis said it cancels
    err = max(rel_err(a, b) for a, b in zip(_outputs(_drop_beta_anyway(model)), _outputs(model)))
    if mode in CANCELS:
        assert err <= 1e-12
    else:
        assert err > 1e-6


@pytest.mark.parametrize("mode", CANCELS)
def test_derived_plan_folds_beta_into_a_bias_free_key(mode):
    model = _model(mode)
    conv, report = normfold.convert(model, adapter=analyze(model, _ids()).to_adapter(), inputs=_ids())
    assert report.verification["passed"] and report.verification["fp64"]["max_rel_error"] <= 1e-9
    assert conv.block.ln.weight is None and conv.block.ln.bias is None  # no affine left in the norm
    assert conv.block.k.bias is None and report.structure.added_bias == []


def test_without_cancellation_beta_stays_in_the_norm():
    model = _model("rope")
    conv, report = normfold.convert(model, adapter=analyze(model, _ids()).to_adapter(), inputs=_ids())
    assert report.verification["passed"]
    assert conv.block.ln.bias is not None and conv.block.k.bias is None
