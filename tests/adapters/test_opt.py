"""OPT specifics: pre-LN sizes (with and without project_in/out), OPT-350m style post-LN, and the
paper-002 Table 7 count for OPT-125m."""

import json

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
from helpers import run_flat

transformers = pytest.importorskip("transformers")
from transformers import OPTConfig, OPTForCausalLM, OPTForSequenceClassification, OPTModel  # noqa: E402

from normfold.errors import UnsupportedConversionError  # noqa: E402

CFG = dict(vocab_size=71, max_position_embeddings=32, hidden_size=24, num_hidden_layers=2, num_attention_heads=3,
           ffn_dim=40, word_embed_proj_dim=24, pad_token_id=1, bos_token_id=2, eos_token_id=2)
POST_LN = dict(CFG, do_layer_norm_before=False, word_embed_proj_dim=16)  # OPT-350m's layout
INPUTS = ids(71)


def test_opt_125m_layout_all_25_layernorms_convert_exactly():
    # Paper 002 Table 7 lists OPT with 25 LayerNorms of which 1 is foldable "with centered embedding".
    # OPT-125m is pre-LN with 12 layers: 2 norms per layer + the final norm = 25, and every one of them
    # reads a zero-mean stream once the embeddings and the branch output projections are centred.
    cfg = dict(CFG, hidden_size=16, num_attention_heads=2, ffn_dim=32, word_embed_proj_dim=16, num_hidden_layers=12)
    model = make(OPTConfig, OPTForCausalLM, **cfg)
    assert len(layernorms(model)) == 25
    conv, report = assert_exact(model, INPUTS)
    assert report.to_dict()["layernorms"]["converted"] == 25 and report.kept == []
    assert_norm_inputs_zero_mean(conv, INPUTS)


def test_pre_ln_structure():
    model = make(OPTConfig, OPTForCausalLM, **CFG)
    conv, report = assert_exact(model, INPUTS)
    assert layernorms(conv) == []
    layer = conv.model.decoder.layers[0]
    assert layer.self_attn_layer_norm.weight is None and layer.final_layer_norm.weight is None
    assert "model.decoder.embed_positions" in report.centered and "model.decoder.embed_tokens" not in report.centered
    # the tied table stays the original (a Recenter after it centres its output); the head is the stock Linear
    assert conv.lm_head.weight is conv.model.decoder.embed_tokens.weight and type(conv.lm_head) is torch.nn.Linear
    assert torch.equal(conv.lm_head.weight, model.lm_head.weight)
    assert report.structure.recenter_after == ["model.decoder.embed_tokens"] and not report.structure.tied_heads
    assert report.stock_reloadable  # the Recenter is for normfold's RMSNorms: stock LayerNorms re-centre
    assert_stream_zero_mean(conv, INPUTS)


def test_project_in_out_leave_the_tied_table_alone():
    model = make(OPTConfig, OPTForCausalLM, **dict(CFG, hidden_size=32, num_attention_heads=4, word_embed_proj_dim=16))
    conv, report = assert_exact(model, INPUTS)
    dec = conv.model.decoder
    # project_in writes the stream, so it is centred; the 16-wide table it reads is not touched
    assert "model.decoder.project_in" in report.centered and "model.decoder.embed_tokens" not in report.centered
    assert dec.project_in.weight.sum(0).abs().max() <= 1e-12
    assert torch.equal(dec.embed_tokens.weight, model.model.decoder.embed_tokens.weight)
    assert conv.lm_head.weight is dec.embed_tokens.weight and report.structure.untied == []
    final = next(r for r in report.structure.norms if r.name == "model.decoder.final_layer_norm")
    assert final.weight and final.bias and final.folded_into == []  # affine kept: project_out has no bias
    conv2, report2 = assert_exact(model, INPUTS, fold_final=True, allow_new_bias=True)
    assert "model.decoder.project_out" in report2.structure.added_bias


def test_no_bias_keeps_beta_in_the_norms():
    model = make(OPTConfig, OPTForSequenceClassification, enable_bias=False, **CFG)
    conv, _ = assert_exact(model, INPUTS)
    ln = conv.model.decoder.layers[1].final_layer_norm
    assert ln.weight is not None and ln.bias is not None and conv.model.decoder.layers[1].fc1.bias is None
    assert {m.eps for m in rmsnorms(conv).values()} == {1e-5}  # OPT's LayerNorms use torch's default eps


def test_post_ln_with_affine_converts_nothing_and_says_why(tmp_path, capsys):
    model = make(OPTConfig, OPTForCausalLM, **POST_LN)
    conv, report = normfold.convert(model)
    assert report.structure.norms == [] and len(layernorms(conv)) == 4
    reasons = kept_reasons(report)
    assert set(reasons) == set(layernorms(model))
    assert all("post-LN" in r for r in reasons.values())
    assert "previous layer" in reasons["model.decoder.layers.1.self_attn_layer_norm"]
    assert "embeddings" in reasons["model.decoder.layers.0.self_attn_layer_norm"]
    assert "fc1" in reasons["model.decoder.layers.0.final_layer_norm"]
    assert any("none is converted" in n for n in report.notes)
    assert report.verification["passed"]
    ref, got = run_flat(model, INPUTS), run_flat(conv, INPUTS)
    assert all(torch.equal(ref[k], got[k]) for k in ref)
    # the CLI writes the (unchanged) model with the report
    from normfold.cli import main

    model.float().save_pretrained(tmp_path / "src")
    code = main(["convert", str(tmp_path / "src"), "--out", str(tmp_path / "out"), "-q"])
    assert code == 0, capsys.readouterr().err
    rep = json.loads((tmp_path / "out" / "normfold.json").read_text())
    assert rep["layernorms"]["converted"] == 0 and len(rep["layernorms"]["kept"]) == 4


def test_post_ln_without_affine_converts_all_but_the_first_norm():
    model = make(OPTConfig, OPTModel, layer_norm_elementwise_affine=False, **POST_LN)
    conv, report = assert_exact(model, INPUTS)
    assert layernorms(conv) == ["decoder.layers.0.self_attn_layer_norm"]
    assert "embeddings" in kept_reasons(report)["decoder.layers.0.self_attn_layer_norm"]
    assert len(rmsnorms(conv)) == 3 and all(m.weight is None for m in rmsnorms(conv).values())
    # layer 0's attention output is not centred (its norm stays a LayerNorm); later ones are
    assert "decoder.layers.0.self_attn.out_proj" not in report.centered
    assert "decoder.layers.1.self_attn.out_proj" in report.centered
    assert report.stock_reloadable
    assert_norm_inputs_zero_mean(conv, INPUTS)


def test_pre_ln_norms_without_affine():
    model = make(OPTConfig, OPTForCausalLM, layer_norm_elementwise_affine=False, **CFG)
    conv, report = assert_exact(model, INPUTS)
    assert layernorms(conv) == [] and len(rmsnorms(conv)) == 5
    assert all(m.weight is None and m.bias is None for m in rmsnorms(conv).values())
    assert all(not r.stock_weight and not r.stock_bias for r in report.structure.norms)


def test_pre_ln_without_final_norm_is_rejected():
    model = make(OPTConfig, OPTForCausalLM, _remove_final_layer_norm=True, **CFG)
    assert model.model.decoder.final_layer_norm is None
    with pytest.raises(UnsupportedConversionError, match="no final LayerNorm"):
        normfold.convert(model)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision(dtype):
    assert_half_precision(make(OPTConfig, OPTForCausalLM, dtype=torch.float32, **CFG), INPUTS, dtype)
