"""GPT-BigCode specifics: multi-query attention's narrow fused c_attn, cross-attention rejected."""

import pytest
import torch

import normfold
from decoder_checks import (
    assert_exact,
    assert_half_precision,
    assert_norm_inputs_zero_mean,
    assert_stream_zero_mean,
    ids,
    layernorms,
    make,
    rmsnorms,
)

transformers = pytest.importorskip("transformers")
from transformers import GPTBigCodeConfig, GPTBigCodeForCausalLM, GPTBigCodeModel  # noqa: E402

from normfold.errors import UnsupportedConversionError  # noqa: E402

CFG = dict(vocab_size=83, n_positions=32, n_embd=32, n_layer=2, n_head=4, pad_token_id=0)
INPUTS = ids(83)


@pytest.mark.parametrize("mqa", [True, False], ids=["mqa", "mha"])
def test_fused_c_attn_is_folded(mqa):
    model = make(GPTBigCodeConfig, GPTBigCodeForCausalLM, multi_query=mqa, **CFG)
    c_attn = model.transformer.h[0].attn.c_attn
    assert c_attn.weight.shape[0] == (32 + 2 * 8 if mqa else 3 * 32)
    conv, report = assert_exact(model, INPUTS)
    assert layernorms(conv) == [] and len(rmsnorms(conv)) == 2 * 2 + 1
    ln = conv.transformer.h[0].ln_1
    assert ln.weight is None and ln.bias is None
    g, b = model.transformer.h[0].ln_1.weight, model.transformer.h[0].ln_1.bias
    new = conv.transformer.h[0].attn.c_attn
    assert torch.allclose(new.weight, c_attn.weight * g) and torch.allclose(new.bias, c_attn.bias + c_attn.weight @ b)
    assert conv.lm_head.weight is conv.transformer.wte.weight  # kept tied to the original table
    assert_norm_inputs_zero_mean(conv, INPUTS)
    assert_stream_zero_mean(conv, INPUTS)


def test_cross_attention_is_rejected_with_a_reason():
    model = make(GPTBigCodeConfig, GPTBigCodeModel, multi_query=False, add_cross_attention=True, **CFG)
    with pytest.raises(UnsupportedConversionError, match="add_cross_attention"):
        normfold.convert(model)


@pytest.mark.parametrize("eps", [1e-6, 1e-12])
def test_eps_is_carried(eps):
    conv, _ = assert_exact(make(GPTBigCodeConfig, GPTBigCodeModel, layer_norm_epsilon=eps, **CFG), INPUTS)
    assert {m.eps for m in rmsnorms(conv).values()} == {eps}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision(dtype):
    assert_half_precision(make(GPTBigCodeConfig, GPTBigCodeForCausalLM, dtype=torch.float32, **CFG), INPUTS, dtype)
