"""Explicit Recenter points of the generic machinery: `recenter_after` (a forward hook on a module's
output) and `recenter_before` (a forward pre-hook on a module's stream input, for streams built
by functional code), through convert, the report and `io.apply_structure`."""

import pytest
import torch
from torch import nn

import normfold
from helpers import rel_err
from normfold.adapters import Adapter, ConversionPlan, NormSite, StreamPlan
from normfold.io import apply_structure
from normfold.nn.hooks import add_input_recenter, has_input_recenter
from normfold.report import ConversionReport, Structure


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.up = nn.Linear(d, 2 * d)
        self.down = nn.Linear(2 * d, d)

    def forward(self, x, scale=1.0):
        return x + scale * self.down(torch.relu(self.up(self.ln(x))))


class StemModel(nn.Module):
    """x0 = gelu(stem(features)) + pos: a functional non-linearity builds the stream (like Whisper)."""

    def __init__(self, d=12, n=3):
        super().__init__()
        self.stem = nn.Linear(5, d)
        self.pos = nn.Parameter(torch.randn(7, d) + 2.0)
        self.blocks = nn.ModuleList(Block(d) for _ in range(n))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, 4)

    def forward(self, features):
        x = nn.functional.gelu(self.stem(features)) + self.pos
        for blk in self.blocks:
            x = blk(x)
        return {"logits": self.head(self.ln_f(x))}


def _plan(model, recenter=True):
    n = len(model.blocks)
    stream = StreamPlan(name="s", writers=[f"blocks.{i}.down" for i in range(n)],
                        norms=[NormSite(f"blocks.{i}.ln", (f"blocks.{i}.up",)) for i in range(n)]
                        + [NormSite("ln_f", ("head",), final=True)],
                        recenter_before=["blocks.0"] if recenter else [])
    return ConversionPlan(adapter="toy", streams=[stream])


def _model():
    torch.manual_seed(0)
    model = StemModel().double().eval()
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.LayerNorm):
                m.weight.add_(0.5 * torch.randn_like(m.weight))
                m.bias.add_(0.5 * torch.randn_like(m.bias))
    return model


FEATURES = torch.randn(2, 7, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(1))


class Identity(nn.Module):
    def forward(self, hidden_states, extra=None):
        return hidden_states


def test_input_recenter_hook_positional_and_keyword():
    x = torch.randn(3, 6, dtype=torch.float64) + 4.0
    mod = Identity()
    add_input_recenter(mod)
    add_input_recenter(mod)  # idempotent: one hook
    assert has_input_recenter(mod) and len(mod._forward_pre_hooks) == 1
    expected = x - x.mean(-1, keepdim=True)
    assert torch.allclose(mod(x, extra=1), expected, rtol=0, atol=1e-15)
    assert torch.allclose(mod(hidden_states=x), expected, rtol=0, atol=1e-15)
    blk = Block(6).double()
    add_input_recenter(blk)
    with pytest.raises(TypeError, match="recenter"):
        blk(x=x)  # neither a positional tensor nor hidden_states=: the hook refuses instead of guessing


def test_recenter_before_makes_a_functional_stem_exact():
    model = _model()
    adapter = Adapter(name="toy", display_name="toy", plan=_plan,
                      example_inputs=lambda m, g: {"features": FEATURES})
    conv, report = normfold.convert(model, adapter=adapter)
    # stock-reloadable: in the stock model (LayerNorms again) the Recenter is a no-op, LN(x) = LN(x − mean x)
    assert report.structure.recenter_before == ["blocks.0"] and report.stock_reloadable
    stock = StemModel().double().eval()
    stock.load_state_dict(normfold.io.export_state_dict(conv, report))
    assert rel_err(stock(FEATURES)["logits"], model(FEATURES)["logits"]) <= 1e-12
    assert has_input_recenter(conv.blocks[0]) and not has_input_recenter(model.blocks[0])
    assert rel_err(conv(FEATURES)["logits"], model(FEATURES)["logits"]) <= 1e-12
    assert report.verification["passed"]
    # without the Recenter the stem's GELU output reaches RMSNorm with a nonzero mean: not exact
    no_rc = Adapter(name="toy", display_name="toy", plan=lambda m: _plan(m, recenter=False))
    wrong, _ = normfold.convert(model, adapter=no_rc, verify=False)
    assert rel_err(wrong(FEATURES)["logits"], model(FEATURES)["logits"]) > 1e-3


def test_structure_round_trips_and_is_replayed():
    model = _model()
    adapter = Adapter(name="toy", display_name="toy", plan=_plan)
    conv, report = normfold.convert(model, adapter=adapter, verify=False)
    back = ConversionReport.from_dict(report.to_dict())
    assert back.structure.recenter_before == ["blocks.0"]
    assert Structure.from_dict({}).recenter_before == []  # reports written before the field existed
    fresh = StemModel().double().eval()
    apply_structure(fresh, back.structure)
    fresh.load_state_dict(conv.state_dict())
    assert has_input_recenter(fresh.blocks[0])
    assert torch.equal(fresh(FEATURES)["logits"], conv(FEATURES)["logits"])


class PreNormModel(StemModel):
    """x0 = pre(stem(features) + pos): a LayerNorm on the stream (like CLIP's pre_layrnorm)."""

    def __init__(self, d=12, n=2):
        super().__init__(d, n)
        self.pre = nn.LayerNorm(d)

    def forward(self, features):
        x = self.pre(self.stem(features) + self.pos)
        for blk in self.blocks:
            x = blk(x)
        return {"logits": self.head(self.ln_f(x))}


def test_recenter_after_a_norm_that_is_itself_swapped():
    # the hook must land on the RMSNorm that replaces `pre`, not on the discarded LayerNorm
    torch.manual_seed(0)
    model = PreNormModel().double().eval()
    with torch.no_grad():
        model.pre.weight.add_(torch.randn_like(model.pre.weight))

    def plan(m):
        p = _plan(m, recenter=False)
        s = p.streams[0]
        s.writers += ["stem", "pos"]
        s.norms.append(NormSite("pre"))
        s.recenter_after.append("pre")
        return p

    conv, report = normfold.convert(model, adapter=Adapter(name="toy", display_name="toy", plan=plan), verify=False)
    from normfold.nn import RMSNorm
    from normfold.nn.hooks import has_output_recenter

    assert isinstance(conv.pre, RMSNorm) and has_output_recenter(conv.pre)
    assert report.structure.recenter_after == ["pre"]
    assert rel_err(conv(FEATURES)["logits"], model(FEATURES)["logits"]) <= 1e-12
