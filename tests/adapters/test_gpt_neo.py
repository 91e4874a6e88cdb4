"""GPT-Neo specifics: q/k/v without bias keep ln_1's affine, local/global attention, token types, eps."""

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
from transformers import GPTNeoConfig, GPTNeoForCausalLM, GPTNeoForSequenceClassification  # noqa: E402

CFG = dict(vocab_size=61, max_position_embeddings=32, hidden_size=24, num_layers=2, num_heads=3,
           attention_types=[[["global", "local"], 1]], window_size=4, pad_token_id=0)
INPUTS = ids(61, seq=12)  # longer than the local window


def test_structure_and_kept_affine_where_readers_have_no_bias():
    model = make(GPTNeoConfig, GPTNeoForCausalLM, **CFG)
    conv, report = assert_exact(model, INPUTS)
    assert layernorms(conv) == [] and report.kept == []
    norms = rmsnorms(conv)
    assert len(norms) == 2 * 2 + 1
    for i in range(2):
        blk = conv.transformer.h[i]
        # q/k/v_proj have no bias: β cannot be folded, so ln_1 keeps its whole affine
        assert blk.ln_1.weight is not None and blk.ln_1.bias is not None
        assert blk.attn.attention.q_proj.bias is None
        # c_fc has a bias: ln_2's γ and β are folded into it
        assert blk.ln_2.weight is None and blk.ln_2.bias is None
    assert conv.lm_head.weight is conv.transformer.wte.weight  # kept tied to the original table (stock head)
    assert torch.equal(conv.lm_head.weight, model.lm_head.weight) and type(conv.lm_head) is torch.nn.Linear
    assert report.stock_reloadable and report.structure.recenter_after == ["transformer.wte"]  # stock LN re-centres
    _, report_u = assert_exact(model, INPUTS, untie=True)
    assert report_u.stock_reloadable
    assert_norm_inputs_zero_mean(conv, INPUTS)
    assert_stream_zero_mean(conv, INPUTS)


def test_allow_new_bias_folds_ln_1_into_qkv():
    model = make(GPTNeoConfig, GPTNeoForCausalLM, **CFG)
    conv, report = assert_exact(model, INPUTS, allow_new_bias=True)
    blk = conv.transformer.h[0]
    assert blk.ln_1.weight is None and blk.ln_1.bias is None
    assert blk.attn.attention.q_proj.bias is not None
    assert "transformer.h.0.attn.attention.k_proj" in report.structure.added_bias
    assert not report.stock_reloadable


def test_token_type_ids_go_through_the_centred_table():
    model = make(GPTNeoConfig, GPTNeoForCausalLM, **CFG)
    inputs = dict(INPUTS, token_type_ids=torch.randint(0, 61, INPUTS["input_ids"].shape,
                                                       generator=torch.Generator().manual_seed(9)))
    assert_exact(model, inputs)


@pytest.mark.parametrize("eps", [1e-5, 1e-6, 1e-12])
def test_eps_is_carried_to_every_norm(eps):
    model = make(GPTNeoConfig, GPTNeoForSequenceClassification, layer_norm_epsilon=eps, **CFG)
    conv, _ = assert_exact(model, INPUTS)
    assert {m.eps for m in rmsnorms(conv).values()} == {eps}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision(dtype):
    assert_half_precision(make(GPTNeoConfig, GPTNeoForCausalLM, dtype=torch.float32, **CFG), INPUTS, dtype)
