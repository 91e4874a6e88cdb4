"""Block-by-block quantization of a whole model: Hessians as the linears see their inputs, every linear
quantized, GPTQ's output error below round-to-nearest's on a small GPT-2."""

from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

from normfold.quant import quantize_model  # noqa: E402
from normfold.quant.calibrate import block_of, hessians_of, quantizable_linears, weight_matrix  # noqa: E402


def _gpt2():
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=97, n_positions=32,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return transformers.GPT2LMHeadModel(cfg).eval()


def _batches(n=4):
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, 97, (4, 32), generator=g) for _ in range(n)]


def test_block_grouping():
    assert block_of("transformer.h.3.attn.c_attn") == "transformer.h.3"
    assert block_of("lm_head") == "lm_head"


def test_hessians_are_xtx_of_the_inputs():
    model = _gpt2()
    mods = quantizable_linears(model)
    name = "transformer.h.1.mlp.c_proj"
    seen = []
    h = mods[name].register_forward_pre_hook(lambda m, a: seen.append(a[0].detach().double().reshape(-1, a[0].shape[-1])))
    hs, rows = hessians_of(model, {name: mods[name]}, _batches())
    h.remove()
    x = torch.cat(seen)
    assert rows[name] == x.shape[0]
    torch.testing.assert_close(hs[name], x.T @ x, rtol=1e-12, atol=1e-9)


@pytest.mark.parametrize("kw", [dict(), dict(group_size=32), dict(act_order=True, symmetric=False)])
def test_gptq_model_error_below_rtn(kw):
    model = _gpt2()
    cal = _batches()
    with torch.no_grad():
        ref = torch.cat([model(input_ids=b).logits for b in cal])
    errs = {}
    for method in ("rtn", "gptq"):
        q = copy.deepcopy(model)
        out = quantize_model(q, cal, method=method, bits=4, **kw)
        assert set(out) == set(quantizable_linears(model))
        for name, m in quantizable_linears(q).items():  # the model now holds the dequantized weights
            torch.testing.assert_close(weight_matrix(m), out[name].dequantize(), rtol=0, atol=0)
        with torch.no_grad():
            got = torch.cat([q(input_ids=b).logits for b in cal])
        errs[method] = float((got - ref).norm() / ref.norm())
    assert errs["gptq"] < errs["rtn"]


def test_tied_head_is_untied_and_the_embedding_stays_float():
    model = _gpt2()
    assert model.lm_head.weight is model.transformer.wte.weight
    wte = model.transformer.wte.weight.detach().clone()
    out = quantize_model(model, _batches(2), method="gptq", bits=4)
    assert "lm_head" in out and model.lm_head.weight is not model.transformer.wte.weight
    assert torch.equal(model.transformer.wte.weight, wte)
    torch.testing.assert_close(model.lm_head.weight, out["lm_head"].dequantize(), rtol=0, atol=0)
