"""GPT-J specifics: one norm read by both parallel branches, untied lm_head with a bias."""

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
from helpers import rel_err, run_flat

transformers = pytest.importorskip("transformers")
from transformers import GPTJConfig, GPTJForCausalLM, GPTJForQuestionAnswering  # noqa: E402

CFG = dict(vocab_size=59, n_positions=32, n_embd=24, n_layer=2, n_head=3, rotary_dim=4, pad_token_id=0)
INPUTS = ids(59)


def test_structure_one_norm_two_branches():
    model = make(GPTJConfig, GPTJForCausalLM, **CFG)
    assert model.lm_head.bias is not None and model.lm_head.weight is not model.transformer.wte.weight
    conv, report = assert_exact(model, INPUTS)
    assert layernorms(conv) == [] and len(rmsnorms(conv)) == 2 + 1
    ln = conv.transformer.h[0].ln_1
    # q/k/v have no bias, so β stays in the norm (and with it γ); fc_in is left untouched
    assert ln.weight is not None and ln.bias is not None
    assert torch.equal(conv.transformer.h[0].mlp.fc_in.weight, model.transformer.h[0].mlp.fc_in.weight)
    # the writers were centred: out_proj and fc_out rows sum to zero over the stream axis
    for w in (conv.transformer.h[0].attn.out_proj.weight, conv.transformer.h[1].mlp.fc_out.weight):
        assert w.sum(0).abs().max() <= 1e-12
    assert torch.equal(conv.lm_head.bias, model.lm_head.bias)  # final norm keeps its affine by default
    assert_norm_inputs_zero_mean(conv, INPUTS)
    assert_stream_zero_mean(conv, INPUTS)


def test_allow_new_bias_folds_ln_1_into_all_four_readers():
    model = make(GPTJConfig, GPTJForCausalLM, **CFG)
    conv, report = assert_exact(model, INPUTS, allow_new_bias=True)
    rec = next(r for r in report.structure.norms if r.name == "transformer.h.1.ln_1")
    assert sorted(r.rsplit(".", 1)[1] for r in rec.folded_into) == ["fc_in", "k_proj", "q_proj", "v_proj"]
    assert not rec.weight and not rec.bias


def test_fold_final_into_lm_head_with_bias_stays_stock_reloadable(tmp_path):
    model = make(GPTJConfig, GPTJForCausalLM, **CFG)
    conv, report = normfold.convert(model, fold_final=True, verify=False)
    assert conv.transformer.ln_f.weight is None and conv.transformer.ln_f.bias is None
    assert report.structure.added_bias == [] and report.stock_reloadable  # lm_head already has a bias
    ref, got = run_flat(model, INPUTS), run_flat(conv, INPUTS)
    assert rel_err(got["logits"], ref["logits"]) <= 1e-9
    out = normfold.save(conv, report, tmp_path / "out")
    stock = GPTJForCausalLM.from_pretrained(out).eval()
    assert rel_err(run_flat(stock, INPUTS)["logits"], ref["logits"]) <= 1e-9


def test_norms_without_bias_fold_gamma_into_bias_free_readers():
    # With no β to place, γ alone folds into q/k/v even though they have no bias.
    model = make(GPTJConfig, GPTJForCausalLM, **CFG)
    for blk in model.transformer.h:
        old = blk.ln_1
        blk.ln_1 = torch.nn.LayerNorm(24, eps=old.eps, bias=False, dtype=torch.float64)
        blk.ln_1.weight.data.copy_(old.weight)
    conv, report = assert_exact(model, INPUTS)
    ln = conv.transformer.h[0].ln_1
    assert ln.weight is None and ln.bias is None and conv.transformer.h[0].attn.q_proj.bias is None
    rec = next(r for r in report.structure.norms if r.name == "transformer.h.0.ln_1")
    assert not rec.stock_bias and len(rec.folded_into) == 4 and report.structure.added_bias == []


def test_qa_head_and_eps():
    model = make(GPTJConfig, GPTJForQuestionAnswering, layer_norm_epsilon=1e-12, **CFG)
    conv, _ = assert_exact(model, INPUTS)
    assert {m.eps for m in rmsnorms(conv).values()} == {1e-12}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision(dtype):
    assert_half_precision(make(GPTJConfig, GPTJForCausalLM, dtype=torch.float32, **CFG), INPUTS, dtype)
