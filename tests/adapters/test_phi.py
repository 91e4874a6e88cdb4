"""Phi specifics: parallel block from one norm, partial rotary, lm_head bias, qk_layernorm."""

import pytest
import torch

import normfold
from decoder_checks import (
    assert_exact,
    assert_half_precision,
    assert_norm_inputs_zero_mean,
    assert_stream_zero_mean,
    ids,
    kept_reasons,
    layernorms,
    make,
    rmsnorms,
)
from helpers import rel_err, run_flat

transformers = pytest.importorskip("transformers")
from transformers import PhiConfig, PhiForCausalLM, PhiForSequenceClassification  # noqa: E402

CFG = dict(vocab_size=79, max_position_embeddings=32, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
           num_attention_heads=4, pad_token_id=0)
INPUTS = ids(79)


@pytest.mark.parametrize("factor", [0.25, 0.5, 1.0])
def test_partial_rotary_structure(factor):
    model = make(PhiConfig, PhiForCausalLM, partial_rotary_factor=factor, **CFG)
    assert model.model.layers[0].self_attn.rotary_ndims == int(8 * factor)
    conv, report = assert_exact(model, INPUTS)
    assert layernorms(conv) == [] and len(rmsnorms(conv)) == 2 + 1 and report.kept == []
    ln = conv.model.layers[0].input_layernorm
    assert ln.weight is None and ln.bias is None  # q/k/v_proj and fc1 all have biases
    rec = next(r for r in report.structure.norms if r.name == "model.layers.0.input_layernorm")
    assert sorted(p.rsplit(".", 1)[1] for p in rec.folded_into) == ["fc1", "k_proj", "q_proj", "v_proj"]
    assert conv.model.final_layernorm.weight is not None  # final norm keeps its affine by default
    assert_norm_inputs_zero_mean(conv, INPUTS)
    assert_stream_zero_mean(conv, INPUTS)


def test_qk_layernorm_is_kept_with_a_reason():
    model = make(PhiConfig, PhiForCausalLM, qk_layernorm=True, **CFG)
    conv, report = assert_exact(model, INPUTS)
    kept = kept_reasons(report)
    assert set(kept) == set(layernorms(conv)) == {f"model.layers.{i}.self_attn.{q}_layernorm"
                                                  for i in range(2) for q in "qk"}
    assert all("not the residual stream" in r for r in kept.values())
    q_ln = conv.model.layers[1].self_attn.q_layernorm
    assert torch.equal(q_ln.weight, model.model.layers[1].self_attn.q_layernorm.weight)
    assert len(rmsnorms(conv)) == 3 and report.stock_reloadable


def test_fold_final_into_lm_head_bias():
    model = make(PhiConfig, PhiForCausalLM, **CFG)
    conv, report = normfold.convert(model, fold_final=True, verify=False)
    assert conv.model.final_layernorm.weight is None and conv.model.final_layernorm.bias is None
    assert report.structure.added_bias == [] and report.stock_reloadable
    assert rel_err(run_flat(conv, INPUTS)["logits"], run_flat(model, INPUTS)["logits"]) <= 1e-9


def test_tied_lm_head_with_bias_and_eps():
    model = make(PhiConfig, PhiForCausalLM, tie_word_embeddings=True, layer_norm_eps=1e-6, **CFG)
    assert model.lm_head.weight is model.model.embed_tokens.weight and model.lm_head.bias is not None
    conv, _ = assert_exact(model, INPUTS)
    assert conv.lm_head.weight is conv.model.embed_tokens.weight  # kept tied: the stock head, its own bias kept
    assert torch.equal(conv.lm_head.bias, model.lm_head.bias)
    untied, _ = assert_exact(model, INPUTS, untie=True)
    assert untied.lm_head.weight is not untied.model.embed_tokens.weight
    assert {m.eps for m in rmsnorms(conv).values()} == {1e-6}


def test_sequence_classification_head():
    assert_exact(make(PhiConfig, PhiForSequenceClassification, **CFG), INPUTS)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision(dtype):
    assert_half_precision(make(PhiConfig, PhiForCausalLM, dtype=torch.float32, qk_layernorm=True, **CFG), INPUTS, dtype)
