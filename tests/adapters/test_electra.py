"""ELECTRA: the embedding LayerNorm is converted; with embedding_size != hidden_size its γ/β fold
into embeddings_project (an affine-free RMSNorm); block norms and the generator's head norm are
kept with their reasons; discriminator and generator heads are exact."""

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
from transformers import ElectraConfig  # noqa: E402

PROJECTED = dict(vocab_size=89, max_position_embeddings=32, embedding_size=16, hidden_size=32, num_hidden_layers=2,
                 num_attention_heads=4, intermediate_size=64)
SQUARE = {**PROJECTED, "embedding_size": 24, "hidden_size": 24, "num_attention_heads": 3, "layer_norm_eps": 1e-6}
HEADS = ["ElectraModel", "ElectraForPreTraining", "ElectraForMaskedLM", "ElectraForSequenceClassification",
         "ElectraForMultipleChoice", "ElectraForTokenClassification", "ElectraForQuestionAnswering"]
GEN = lambda: torch.Generator().manual_seed(6)  # noqa: E731


@pytest.mark.parametrize("cfg", [PROJECTED, SQUARE], ids=["projected", "square"])
@pytest.mark.parametrize("head", HEADS)
def test_every_head_is_exact_in_float64(head, cfg):
    model = build(ElectraConfig, getattr(transformers, head), **cfg)
    conv, report = convert64(model)
    assert_same_outputs(model, conv, encoder_inputs(model, GEN()))
    prefix = "" if head == "ElectraModel" else "electra."
    assert_converted_exactly(model, conv, report, [prefix + "embeddings.LayerNorm"])


def test_projected_embedding_norm_folds_into_the_projection():
    model = build(ElectraConfig, transformers.ElectraForPreTraining, **PROJECTED)
    conv, report = convert64(model)
    norm, proj = conv.electra.embeddings.LayerNorm, conv.electra.embeddings_project
    assert norm.weight is None and norm.bias is None
    ln, p0 = model.electra.embeddings.LayerNorm, model.electra.embeddings_project
    # independent reference: Linear(γ⊙n + β) = n·diag(γ)Wᵀ + (Wβ + b)
    assert torch.allclose(proj.weight, p0.weight * ln.weight[None, :], rtol=0, atol=1e-15)
    assert torch.allclose(proj.bias, p0.bias + p0.weight @ ln.bias, rtol=0, atol=1e-14)
    assert report.structure.norms[0].folded_into == ["electra.embeddings_project"]
    assert "electra.embeddings_project" not in report.centered  # block 0 reads its output directly
    reasons = {k["name"]: k["reason"] for k in report.kept}
    assert "embeddings_project" in reasons["electra.encoder.layer.0.attention.output.LayerNorm"]
    chain = [f"electra.encoder.layer.{i}.{s}.LayerNorm" for i in range(2) for s in ("attention.output", "output")]
    block_reasons_name_previous_norm(report, chain)


def test_square_embedding_norm_keeps_its_affine():
    model = build(ElectraConfig, transformers.ElectraModel, **SQUARE)
    conv, report = convert64(model)
    norm = conv.embeddings.LayerNorm
    assert torch.equal(norm.weight, model.embeddings.LayerNorm.weight) and norm.eps == 1e-6
    reasons = {k["name"]: k["reason"] for k in report.kept}
    assert "embeddings.LayerNorm" in reasons["encoder.layer.0.attention.output.LayerNorm"]


def test_generator_head_norm_is_kept_and_the_generator_reloads_in_stock_transformers(tmp_path):
    model = build(ElectraConfig, transformers.ElectraForMaskedLM, torch.float32, **PROJECTED)
    conv, stock = assert_stock_reload_matches(model, tmp_path, encoder_inputs(model, GEN()))
    _, report = convert64(model)
    reasons = {k["name"]: k["reason"] for k in report.kept}
    assert "generator_predictions.activation" in reasons["generator_predictions.LayerNorm"]
    assert conv.generator_lm_head.weight is not conv.electra.embeddings.word_embeddings.weight


def test_causal_lm_decoder_config():
    model = build(ElectraConfig, transformers.ElectraForCausalLM, **{**SQUARE, "is_decoder": True})
    conv, report = convert64(model)
    assert_same_outputs(model, conv, encoder_inputs(model, GEN()))
    assert [r.name for r in report.structure.norms] == ["electra.embeddings.LayerNorm"]
