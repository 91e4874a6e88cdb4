"""BERT: exactly the embedding LayerNorm becomes an RMSNorm; every block and head norm is kept with
its reason; every head's outputs (pooled output, NSP, MLM, stream) are unchanged."""

import pytest
import torch
from torch import nn

import normfold
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
from transformers import BertConfig  # noqa: E402

CFG = dict(vocab_size=99, max_position_embeddings=32, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
           intermediate_size=48)
HEADS = ["BertModel", "BertForPreTraining", "BertForMaskedLM", "BertForNextSentencePrediction",
         "BertForSequenceClassification", "BertForMultipleChoice", "BertForTokenClassification",
         "BertForQuestionAnswering"]
GEN = lambda: torch.Generator().manual_seed(3)  # noqa: E731


def chain(prefix, layers=2):
    names = [f"{prefix}embeddings.LayerNorm"]
    for i in range(layers):
        names += [f"{prefix}encoder.layer.{i}.attention.output.LayerNorm", f"{prefix}encoder.layer.{i}.output.LayerNorm"]
    return names


@pytest.mark.parametrize("head", HEADS)
def test_every_head_is_exact_in_float64_stream_included(head):
    model = build(BertConfig, getattr(transformers, head), **CFG)
    conv, report = convert64(model)
    ref = assert_same_outputs(model, conv, encoder_inputs(model, GEN()))
    prefix = "" if head == "BertModel" else "bert."
    assert_converted_exactly(model, conv, report, [prefix + "embeddings.LayerNorm"])
    expected = {"BertModel": "pooler_output", "BertForPreTraining": "seq_relationship_logits",
                "BertForNextSentencePrediction": "logits", "BertForQuestionAnswering": "end_logits"}.get(head, "logits")
    assert expected in ref and "hidden_states[2]" in ref


def test_only_embedding_tables_and_the_tied_decoder_are_edited():
    model = build(BertConfig, transformers.BertForPreTraining, **CFG)
    conv, report = convert64(model)
    emb = conv.bert.embeddings
    for table in (emb.position_embeddings, emb.token_type_embeddings):
        assert_rows_centred(table.weight)
    # the decoder stays tied to the original word table, whose output a Recenter centres instead
    assert report.structure.recenter_after == ["bert.embeddings.word_embeddings"]
    assert_tied_head_keeps_the_original_matrix(conv.cls.predictions.decoder, emb.word_embeddings,
                                               model.bert.embeddings.word_embeddings.weight)
    assert conv.cls.predictions.bias is conv.cls.predictions.decoder.bias  # the bias pair stays shared too
    untied, _ = convert64(model, untie=True)  # the plain form: the decoder keeps the original table
    assert untied.cls.predictions.decoder.weight is not untied.bert.embeddings.word_embeddings.weight
    assert torch.equal(untied.cls.predictions.decoder.weight, model.bert.embeddings.word_embeddings.weight)
    assert_only_edited(model, conv, {"bert.embeddings."})
    ln = model.bert.embeddings.LayerNorm
    assert torch.equal(emb.LayerNorm.weight, ln.weight) and torch.equal(emb.LayerNorm.bias, ln.bias)
    assert sorted(report.centered) == sorted(f"bert.embeddings.{t}_embeddings" for t in ("position", "token_type"))


def test_kept_norms_have_specific_reasons_and_notes_count_the_change():
    model = build(BertConfig, transformers.BertForPreTraining, **CFG)
    _, report = convert64(model)
    reasons = {k["name"]: k["reason"] for k in report.kept}
    block_reasons_name_previous_norm(report, chain("bert."))
    assert "self-attention" in reasons["bert.encoder.layer.1.attention.output.LayerNorm"]
    assert "feed-forward" in reasons["bert.encoder.layer.0.output.LayerNorm"]
    assert "transform_act_fn" in reasons["cls.predictions.transform.LayerNorm"]
    assert "not zero-mean" in reasons["cls.predictions.transform.LayerNorm"]
    d = report.to_dict()["layernorms"]
    assert (d["total"], d["converted"]) == (6, 1)
    notes = " ".join(report.notes)
    assert "1 of 6" in notes and "no measurable speed-up" in notes
    assert "cls.predictions.decoder.weight" in notes  # the tied table costs a second vocab matrix


def test_real_bert_base_layout_counts_one_of_twenty_five():
    # Shapes of bert-base (12 layers) with tiny widths: the count does not depend on the width.
    model = build(BertConfig, transformers.BertModel, **{**CFG, "num_hidden_layers": 12})
    _, report = convert64(model)
    d = report.to_dict()["layernorms"]
    assert (d["converted"], d["total"]) == (1, 25)


def test_cross_attention_decoder_is_exact_and_keeps_cross_attention_norms():
    cfg = dict(CFG, is_decoder=True, add_cross_attention=True)
    model = build(BertConfig, transformers.BertLMHeadModel, **cfg)
    conv, report = convert64(model)
    inputs = encoder_inputs(model, GEN())
    enc = torch.randn(2, 5, 32, dtype=torch.float64, generator=GEN())
    assert_same_outputs(model, conv, inputs, encoder_hidden_states=enc)
    reasons = {k["name"]: k["reason"] for k in report.kept}
    assert "cross-attention" in reasons["bert.encoder.layer.0.crossattention.output.LayerNorm"]
    assert [r.name for r in report.structure.norms] == ["bert.embeddings.LayerNorm"]


def _affine_free(model, path):
    parent, _, leaf = path.rpartition(".")
    old = model.get_submodule(path)
    new = nn.LayerNorm(old.normalized_shape, eps=old.eps, elementwise_affine=False)
    setattr(model.get_submodule(parent), leaf, new)


def test_a_norm_without_affine_makes_the_next_block_norm_exact():
    # paper 001 App. B: the output n of a LayerNorm without affine is zero-mean, so the next
    # residual sum is zero-mean once its branch writer is centred.
    model = build(BertConfig, transformers.BertModel, **CFG)
    for path in ("embeddings.LayerNorm", "encoder.layer.0.attention.output.LayerNorm",
                 "encoder.layer.1.attention.output.LayerNorm"):
        _affine_free(model, path)
    conv, report = convert64(model)
    assert [r.name for r in report.structure.norms] == [
        "embeddings.LayerNorm", "encoder.layer.0.attention.output.LayerNorm", "encoder.layer.0.output.LayerNorm",
        "encoder.layer.1.output.LayerNorm"]
    assert [k["name"] for k in report.kept] == ["encoder.layer.1.attention.output.LayerNorm"]  # after an affine norm
    assert set(report.centered) >= {"encoder.layer.0.attention.output.dense", "encoder.layer.0.output.dense",
                                    "encoder.layer.1.output.dense"}
    assert "encoder.layer.1.attention.output.dense" not in report.centered
    assert_same_outputs(model, conv, encoder_inputs(model, GEN()))


def test_mlm_head_reloads_in_stock_transformers(tmp_path):
    model = build(BertConfig, transformers.BertForMaskedLM, torch.float32, **CFG)
    assert_stock_reload_matches(model, tmp_path, encoder_inputs(model, GEN()))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_bert_converts_through_float64(dtype):
    model = build(BertConfig, transformers.BertForSequenceClassification, dtype, **CFG)
    conv, report = normfold.convert(model)
    assert next(conv.parameters()).dtype == dtype
    v = report.verification
    assert v["fp64"]["max_rel_error"] <= 1e-9 and v["working"]["passed"], v["working"]["outputs"]
