"""Targets with their own executor (`Variant.executor` / `Variant.claims`): how the reverse conversions are
registered. `normfold.convert` hands a model a registered target claims to that target's executor, whatever
`to` asks, and runs every other target through the plan (`conversion.convert_by_plan`)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import normfold
from normfold import conversion
from normfold.compress.reverse import carries_normfold_norms, run_reverse

transformers = pytest.importorskip("transformers")


def _gpt2():
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=64, n_positions=32,
                                  bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(cfg).eval()


def test_the_reverse_conversions_are_the_layernorm_target_with_their_own_executor():
    variant = conversion.VARIANTS["layernorm"]
    assert variant.executor is run_reverse and variant.claims is carries_normfold_norms
    model = _gpt2()
    assert conversion.variant_for(conversion.conversion_options(None, to="rmsnorm"), model).name == "rmsnorm"
    converted, _ = normfold.convert(model, verify=False)
    # a normfold model goes to the reverse conversions whatever `to` asks
    for to in ("rmsnorm", "crmsnorm", "layernorm"):
        assert conversion.variant_for(conversion.conversion_options(None, to=to), converted) is variant


def test_a_registered_target_that_claims_a_model_gets_it(monkeypatch):
    class Marked(nn.Linear):
        pass

    seen = []

    def executor(model, variant, options, **keywords):
        seen.append((variant.name, options.to, sorted(keywords)))
        return model, "report"

    mine = conversion.Variant("mine", "a toy target with its own executor", apply=None, executor=executor,
                              claims=lambda m: any(isinstance(x, Marked) for x in m.modules()))
    monkeypatch.setitem(conversion.VARIANTS, "mine", mine)
    model = nn.Sequential(Marked(4, 4))
    assert normfold.convert(model, to="rmsnorm") == (model, "report")
    assert seen == [("mine", "rmsnorm", ["adapter", "auto", "discard_original", "fast", "fp64_tol", "inplace",
                                         "inputs", "progress", "verify"])]
    # a model it does not claim is converted by the plan as before
    plain = _gpt2()
    out, report = normfold.convert(plain)
    assert report.variant == "rmsnorm" and report.verification["passed"] and not seen[1:]
    with torch.no_grad():
        ids = torch.randint(0, 64, (1, 8))
        assert torch.allclose(out(ids).logits, plain(ids).logits, atol=1e-4)
