"""DistilBERT: only the embedding LayerNorm is converted (learned and sinusoidal positions); every
head is exact; vocab_layer_norm and the block norms are kept with their reasons."""

import pytest
import torch

from normfold.adapters.post_ln import encoder_inputs
from post_ln_checks import (
    assert_converted_exactly,
    assert_only_edited,
    assert_rows_centred,
    assert_tied_head_keeps_the_original_matrix,
    assert_same_outputs,
    assert_stock_reload_matches,
    block_reasons_name_previous_norm,
    build,
    convert64,
)

transformers = pytest.importorskip("transformers")
from transformers import DistilBertConfig  # noqa: E402

CFG = dict(vocab_size=97, max_position_embeddings=32, dim=32, n_layers=2, n_heads=4, hidden_dim=64)
HEADS = ["DistilBertModel", "DistilBertForMaskedLM", "DistilBertForSequenceClassification",
         "DistilBertForMultipleChoice", "DistilBertForTokenClassification", "DistilBertForQuestionAnswering"]
GEN = lambda: torch.Generator().manual_seed(5)  # noqa: E731


@pytest.mark.parametrize("head", HEADS)
def test_every_head_is_exact_in_float64_stream_included(head):
    model = build(DistilBertConfig, getattr(transformers, head), **CFG)
    conv, report = convert64(model)
    inputs = encoder_inputs(model, GEN())
    assert "token_type_ids" not in inputs
    assert_same_outputs(model, conv, inputs)
    prefix = "" if head == "DistilBertModel" else "distilbert."
    assert_converted_exactly(model, conv, report, [prefix + "embeddings.LayerNorm"])


def test_kept_reasons_and_edits():
    model = build(DistilBertConfig, transformers.DistilBertForMaskedLM, **CFG)
    conv, report = convert64(model)
    chain = ["distilbert.embeddings.LayerNorm"] + [f"distilbert.transformer.layer.{i}.{n}" for i in range(2)
                                                   for n in ("sa_layer_norm", "output_layer_norm")]
    block_reasons_name_previous_norm(report, chain)
    reasons = {k["name"]: k["reason"] for k in report.kept}
    assert "vocab_transform" in reasons["vocab_layer_norm"]
    assert_only_edited(model, conv, {"distilbert.embeddings."})
    # the projector stays tied to the original word table (a Recenter after it centres its output)
    assert_tied_head_keeps_the_original_matrix(conv.vocab_projector, conv.distilbert.embeddings.word_embeddings,
                                               model.vocab_projector.weight)


def test_sinusoidal_positions_are_centred_and_survive_a_stock_reload(tmp_path):
    model = build(DistilBertConfig, transformers.DistilBertModel, torch.float32,
                  **{**CFG, "sinusoidal_pos_embds": True})
    conv, stock = assert_stock_reload_matches(model, tmp_path, encoder_inputs(model, GEN()), key="last_hidden_state")
    pos = conv.embeddings.position_embeddings.weight
    assert_rows_centred(pos)
    assert torch.equal(stock.embeddings.position_embeddings.weight, pos)  # loaded, not recomputed
