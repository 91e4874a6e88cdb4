"""GPT-NeoX / Pythia specifics: parallel and sequential residual, fused QKV, attention_bias."""

import pytest
import torch

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
from transformers import GPTNeoXConfig, GPTNeoXForCausalLM, GPTNeoXForTokenClassification  # noqa: E402

CFG = dict(vocab_size=67, max_position_embeddings=32, hidden_size=24, num_hidden_layers=3, num_attention_heads=3,
           intermediate_size=40, pad_token_id=0)
INPUTS = ids(67)


@pytest.mark.parametrize("parallel", [True, False], ids=["parallel", "sequential"])
def test_both_residual_forms_convert_exactly(parallel):
    model = make(GPTNeoXConfig, GPTNeoXForCausalLM, use_parallel_residual=parallel, **CFG)
    conv, report = assert_exact(model, INPUTS)
    assert layernorms(conv) == [] and len(rmsnorms(conv)) == 2 * 3 + 1 and report.kept == []
    # post_attention_layernorm reads x (parallel) or x + attn (sequential): zero-mean either way
    assert_norm_inputs_zero_mean(conv, INPUTS)
    assert_stream_zero_mean(conv, INPUTS)


def test_residual_form_matters():
    # The two forms compute different functions; converting one must not reproduce the other.
    a = make(GPTNeoXConfig, GPTNeoXForCausalLM, use_parallel_residual=True, **CFG)
    b = make(GPTNeoXConfig, GPTNeoXForCausalLM, use_parallel_residual=False, **CFG)
    b.load_state_dict(a.state_dict())
    conv_a, _ = assert_exact(a, INPUTS)
    with torch.no_grad():
        la, lb = conv_a(**INPUTS).logits, b(**INPUTS).logits
    assert (la - lb).abs().max() > 1e-3


@pytest.mark.parametrize("bias", [True, False])
def test_fused_qkv_folding_depends_on_attention_bias(bias):
    model = make(GPTNeoXConfig, GPTNeoXForCausalLM, attention_bias=bias, **CFG)
    conv, report = assert_exact(model, INPUTS)
    ln, qkv = conv.gpt_neox.layers[0].input_layernorm, conv.gpt_neox.layers[0].attention.query_key_value
    orig_ln = model.gpt_neox.layers[0].input_layernorm
    assert qkv.weight.shape == (3 * 24, 24)
    if bias:  # γ scales the fused QKV's input columns, β goes into its bias
        assert ln.weight is None and ln.bias is None
        assert torch.allclose(qkv.weight, model.gpt_neox.layers[0].attention.query_key_value.weight * orig_ln.weight)
    else:  # no bias to absorb β: the norm keeps its affine, the projection is untouched
        assert ln.weight is not None and ln.bias is not None
        assert torch.equal(qkv.weight, model.gpt_neox.layers[0].attention.query_key_value.weight)
    # the MLP input projection always has a bias
    assert conv.gpt_neox.layers[0].post_attention_layernorm.weight is None


def test_tied_embeddings_stay_tied_and_eps_carried():
    model = make(GPTNeoXConfig, GPTNeoXForTokenClassification, tie_word_embeddings=True, layer_norm_eps=1e-6, **CFG)
    conv, _ = assert_exact(model, INPUTS)
    assert {m.eps for m in rmsnorms(conv).values()} == {1e-6}
    lm = make(GPTNeoXConfig, GPTNeoXForCausalLM, tie_word_embeddings=True, **CFG)
    assert lm.lm_head.weight is lm.gpt_neox.embed_in.weight
    conv, report = assert_exact(lm, INPUTS)
    assert conv.lm_head.weight is conv.gpt_neox.embed_in.weight and conv.config.tie_word_embeddings is True
    assert report.structure.untied == [] and report.structure.recenter_after == ["gpt_neox.embed_in"]
    assert type(conv.lm_head) is torch.nn.Linear and torch.equal(conv.lm_head.weight, lm.lm_head.weight)
    conv, report = assert_exact(lm, INPUTS, untie=True)  # the plain form
    assert conv.lm_head.weight is not conv.gpt_neox.embed_in.weight and conv.config.tie_word_embeddings is False
    assert "lm_head.weight" in report.structure.untied


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision(dtype):
    assert_half_precision(make(GPTNeoXConfig, GPTNeoXForCausalLM, dtype=torch.float32, **CFG), INPUTS, dtype)
