"""The float64 check of the reverse conversions (--to layernorm from a normfold model) on float32 inputs.

A float32 Pre-RMSNorm model's stream is zero-mean only up to the rounding of its stored, centred
writers (a per-token mean of ~0.1 ulp of the stream's rms). Its RMSNorms carry that residue along;
the LayerNorms of the reverse conversion remove it, and a head tied to the table multiplies it by the
table's row means (the embedding offsets). So the float64 check of a float32 input cannot reach 1e-9:
it measured 7e-9 on a plain tiny GPT-2 and 7e-5 with offsets of 200 / 100 in the embedding tables,
while the reverse algebra itself is exact (the same comparison against the input with its norm inputs
centred exactly agrees to 1e-15). The check's tolerance adds twice that measured effect of the
input's own rounding; these tests pin both that such models pass and that a real mistake still fails.
"""

from __future__ import annotations

import importlib

import pytest
import torch

import normfold
from helpers import perturb_norms
from normfold.compress import reverse

transformers = pytest.importorskip("transformers")


def _gpt2(offset: float, dtype=torch.float32):
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=64, n_positions=32,
                                  bos_token_id=0, eos_token_id=0)
    model = transformers.GPT2LMHeadModel(cfg).eval()
    with torch.no_grad():  # a large common mean in both tables (centred away by the forward conversion)
        model.transformer.wte.weight += offset
        model.transformer.wpe.weight += offset / 2
    return model.to(dtype)


@pytest.mark.parametrize("offset", [0.0, 50.0, 200.0])
@pytest.mark.parametrize("via", ["rmsnorm", "crmsnorm"])
def test_reverse_of_float32_model_passes_its_float64_check(offset, via):
    model = _gpt2(offset)
    conv, _ = normfold.convert(model, to=via, verify=False)
    back, report = normfold.convert(conv, to="layernorm")
    fp64 = report.verification["fp64"]
    assert fp64["passed"], fp64
    assert fp64["max_rel_error"] <= fp64["tolerance"]
    assert fp64["tolerance"] <= 1e-3  # the input's rounding, not a blanket pass
    if via == "rmsnorm":
        assert fp64["input_rounding"] > 0
    # and the result computes the original function (float64 run of both, logits)
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        want = model.double()(input_ids=ids).logits
        got = back.double()(input_ids=ids).logits
    assert ((got - want).abs().max() / want.abs().max()).item() <= 1e-3


def test_float64_inputs_keep_the_exact_tolerance():
    conv, _ = normfold.convert(_gpt2(0.0, torch.float64), to="rmsnorm", verify=False)
    _, report = normfold.convert(conv, to="layernorm")
    assert report.verification["fp64"]["tolerance"] == 1e-9 and report.verification["fp64"]["passed"]


def test_a_wrong_reverse_still_fails_the_float64_check(monkeypatch):
    """The tolerance is the input's measured rounding effect, far below a real mistake: a tied head whose
    row means are not given back to the table fails (the final norm's β makes Σz non-zero, so the
    row means matter). The conversion makes the older tied form (centred table, nn.TiedHead) that checkpoints
    written before the Recenter form carry."""
    monkeypatch.setattr(importlib.import_module("normfold.conversion"), "recentre_tied_tables",
                        lambda model, plan, options: plan)
    conv, report = normfold.convert(perturb_norms(_gpt2(50.0)), to="rmsnorm", verify=False)
    assert report.structure.tied_heads
    _, ok = normfold.convert(conv, to="layernorm")
    assert ok.verification["fp64"]["passed"], ok.verification["fp64"]

    def untie_without_means(model, structure):
        from normfold.nn import TiedHead

        for name, head in [(n, m) for n, m in model.named_modules() if isinstance(m, TiedHead)]:
            with torch.no_grad():
                head.mean.zero_()
        real(model, structure)

    real = reverse.untie_heads
    monkeypatch.setattr(reverse, "untie_heads", untie_without_means)
    _, report = normfold.convert(conv, to="layernorm")
    assert not report.verification["fp64"]["passed"]
