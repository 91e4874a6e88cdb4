"""RoBERTa (and XLM-RoBERTa, CamemBERT): only the embedding LayerNorm is converted; every head is
exact; the MLM head's tied lm_head.bias / decoder.bias survive saving and stock reloading."""

import pytest
import torch

from normfold.adapters.post_ln import encoder_inputs
from post_ln_checks import (
    assert_converted_exactly,
    assert_same_outputs,
    assert_stock_reload_matches,
    block_reasons_name_previous_norm,
    build,
    convert64,
)

transformers = pytest.importorskip("transformers")

CFG = dict(vocab_size=101, max_position_embeddings=40, pad_token_id=1, bos_token_id=0, eos_token_id=2, hidden_size=32,
           num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, type_vocab_size=1, layer_norm_eps=1e-5)
CASES = [("RobertaConfig", h) for h in ("RobertaModel", "RobertaForMaskedLM", "RobertaForSequenceClassification",
                                        "RobertaForMultipleChoice", "RobertaForTokenClassification",
                                        "RobertaForQuestionAnswering")]
CASES += [("XLMRobertaConfig", "XLMRobertaForTokenClassification"), ("CamembertConfig", "CamembertForMaskedLM")]
GEN = lambda: torch.Generator().manual_seed(4)  # noqa: E731


@pytest.mark.parametrize("config,head", CASES, ids=[c[1] for c in CASES])
def test_every_head_is_exact_in_float64_stream_included(config, head):
    model = build(getattr(transformers, config), getattr(transformers, head), **CFG)
    conv, report = convert64(model)
    assert_same_outputs(model, conv, encoder_inputs(model, GEN()))
    prefix = "" if head == "RobertaModel" else "roberta."
    assert_converted_exactly(model, conv, report, [prefix + "embeddings.LayerNorm"])


def test_causal_lm_with_two_token_types():
    model = build(transformers.RobertaConfig, transformers.RobertaForCausalLM, **{**CFG, "type_vocab_size": 2,
                                                                                  "is_decoder": True})
    conv, report = convert64(model)
    inputs = encoder_inputs(model, GEN())
    assert "token_type_ids" in inputs
    assert_same_outputs(model, conv, inputs)
    assert [r.name for r in report.structure.norms] == ["roberta.embeddings.LayerNorm"]


def test_kept_reasons():
    model = build(transformers.RobertaConfig, transformers.RobertaForMaskedLM, **CFG)
    _, report = convert64(model)
    chain = ["roberta.embeddings.LayerNorm"] + [f"roberta.encoder.layer.{i}.{s}.LayerNorm" for i in range(2)
                                                for s in ("attention.output", "output")]
    block_reasons_name_previous_norm(report, chain)
    reasons = {k["name"]: k["reason"] for k in report.kept}
    assert "gelu" in reasons["lm_head.layer_norm"] and "not zero-mean" in reasons["lm_head.layer_norm"]
    assert len(reasons) == 5


def test_mlm_head_with_tied_bias_reloads_in_stock_transformers(tmp_path):
    model = build(transformers.RobertaConfig, transformers.RobertaForMaskedLM, torch.float32, **CFG)
    assert model.lm_head.bias is model.lm_head.decoder.bias  # tied by transformers
    conv, stock = assert_stock_reload_matches(model, tmp_path, encoder_inputs(model, GEN()))
    # the config no longer ties anything, so both biases must have been saved with their values
    assert torch.equal(stock.lm_head.decoder.bias, model.lm_head.decoder.bias)
    assert torch.equal(stock.lm_head.bias, model.lm_head.bias)
