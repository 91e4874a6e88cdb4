"""Whisper: the explicit Recenter before the first encoder layer (the conv + GELU stem), the
encoder's final norm read by every cross-attention, the tied proj_out, cached decoding, fold_final,
the refused weighted-layer-sum classifier, and normfold.load restoring the Recenter."""

import dataclasses

import pytest
import torch

import normfold
from helpers import realistic, rel_err, run_flat
from normfold.adapters import get_adapter
from normfold.errors import UnsupportedConversionError
from normfold.nn import RMSNorm
from normfold.nn.hooks import has_input_recenter

transformers = pytest.importorskip("transformers")
from transformers import (  # noqa: E402
    WhisperConfig,
    WhisperForAudioClassification,
    WhisperForConditionalGeneration,
)

CFG = dict(vocab_size=99, num_mel_bins=8, max_source_positions=12, max_target_positions=16, pad_token_id=0,
           bos_token_id=1, eos_token_id=2, decoder_start_token_id=3, begin_suppress_tokens=None, d_model=32,
           encoder_layers=2, decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4,
           encoder_ffn_dim=48, decoder_ffn_dim=48, classifier_proj_size=20, num_labels=3)
G = torch.Generator().manual_seed(5)
FEATS = torch.randn(2, 8, 24, generator=G, dtype=torch.float64)
DEC = torch.randint(0, 99, (2, 6), generator=G)
INPUTS = {"input_features": FEATS, "decoder_input_ids": DEC}


def make(cls=WhisperForConditionalGeneration, **overrides):
    torch.manual_seed(0)
    return realistic(cls(WhisperConfig(**{**CFG, **overrides})).eval().double())


def test_structure():
    model = make()
    conv, report = normfold.convert(model, verify=False)
    enc, dec = conv.model.encoder, conv.model.decoder
    assert not any(isinstance(m, torch.nn.LayerNorm) for m in conv.modules()) and report.kept == []
    assert report.structure.recenter_before == ["model.encoder.layers.0"] and has_input_recenter(enc.layers[0])
    assert report.stock_reloadable and report.structure.recenter_after == ["model.decoder.embed_tokens"]
    # the stem is not edited (the Recenter handles it); the decoder's positions are centred, its token table
    # (tied to proj_out) stays the original and a Recenter after it centres its output
    assert torch.equal(enc.conv1.weight, model.model.encoder.conv1.weight)
    assert "model.encoder.embed_positions" not in report.centered
    assert {"model.decoder.embed_positions", "model.decoder.layers.1.encoder_attn.out_proj"} <= set(report.centered)
    assert "model.decoder.embed_tokens" not in report.centered
    # proj_out was tied to embed_tokens: it stays the stock head tied to the original table
    assert conv.proj_out.weight is dec.embed_tokens.weight and conv.config.tie_word_embeddings
    assert type(conv.proj_out) is torch.nn.Linear and torch.equal(conv.proj_out.weight, model.proj_out.weight)
    untied, _ = normfold.convert(model, verify=False, untie=True)  # the plain-transformers form
    assert untied.proj_out.weight is not untied.model.decoder.embed_tokens.weight
    assert torch.equal(untied.proj_out.weight, model.proj_out.weight)
    cross_ln = dec.layers[0].encoder_attn_layer_norm
    assert isinstance(cross_ln, RMSNorm) and cross_ln.weight is None
    assert enc.layer_norm.weight is not None and dec.layer_norm.weight is not None  # final norms keep their affine
    ref, got = run_flat(model, INPUTS), run_flat(conv, INPUTS)
    for k in ("logits", "encoder_last_hidden_state"):
        assert rel_err(got[k], ref[k]) <= 1e-9, k


def test_encoder_final_norm_readers_are_every_cross_attention_key_and_value():
    model = make()
    plan = get_adapter("whisper").plan(model)
    site = next(s for s in plan.streams[0].norms if s.path == "model.encoder.layer_norm")
    assert site.final and set(site.readers) == {f"model.decoder.layers.{i}.encoder_attn.{p}"
                                                for i in range(2) for p in ("k_proj", "v_proj")}


def test_without_the_recenter_the_stem_breaks_exactness():
    adapter = get_adapter("whisper")

    def no_recenter(model):
        plan = adapter.plan(model)
        plan.streams[0].recenter_before.clear()
        return plan

    model = make()
    with torch.no_grad():  # the GELU output's mean is what the Recenter removes
        gelu, enc = torch.nn.functional.gelu, model.model.encoder
        h = gelu(enc.conv2(gelu(enc.conv1(FEATS))))
    assert h.mean(1).abs().min() > 1e-3
    conv, _ = normfold.convert(model, adapter=dataclasses.replace(adapter, plan=no_recenter), verify=False)
    assert rel_err(run_flat(conv, INPUTS)["logits"], run_flat(model, INPUTS)["logits"]) > 1e-4


def test_cached_decoding_matches():
    model = make()
    conv, _ = normfold.convert(model, verify=False)
    logits = []
    for m in (model, conv):
        with torch.no_grad():
            first = m(input_features=FEATS, decoder_input_ids=DEC[:, :4], use_cache=True)
            nxt = m(encoder_outputs=(first.encoder_last_hidden_state,), decoder_input_ids=DEC[:, 4:5],
                    past_key_values=first.past_key_values, use_cache=True)
        logits.append(nxt.logits)
    assert rel_err(logits[1], logits[0]) <= 1e-9


def test_fold_final_into_cross_attention_and_proj_out():
    model = make()
    conv, report = normfold.convert(model, fold_final=True, allow_new_bias=True, verify=False)
    assert conv.model.encoder.layer_norm.weight is None and conv.model.decoder.layer_norm.bias is None
    # k_proj and proj_out have no bias in Whisper: absorbing beta made them grow one
    assert {"model.decoder.layers.0.encoder_attn.k_proj", "proj_out"} <= set(report.structure.added_bias)
    assert rel_err(run_flat(conv, INPUTS)["logits"], run_flat(model, INPUTS)["logits"]) <= 1e-9


def test_audio_classification():
    model = make(WhisperForAudioClassification)
    conv, report = normfold.convert(model, fold_final=True, verify=False)
    assert conv.encoder.layer_norm.weight is None  # the projector (with a bias) absorbed the final norm
    inputs = {"input_features": FEATS}
    assert rel_err(run_flat(conv, inputs)["logits"], run_flat(model, inputs)["logits"]) <= 1e-9
    with pytest.raises(UnsupportedConversionError, match="use_weighted_layer_sum"):
        normfold.convert(make(WhisperForAudioClassification, use_weighted_layer_sum=True))


def test_load_restores_the_recenter(tmp_path):
    model = make()
    conv, report = normfold.convert(model.float(), verify=False)
    out = normfold.save(conv, report, tmp_path / "w")
    assert (out / "model.safetensors").is_file() and not (out / "normfold_model.safetensors").exists()
    loaded = normfold.load(out)
    assert has_input_recenter(loaded.model.encoder.layers[0])
    a, b = run_flat(loaded, INPUTS), run_flat(conv, INPUTS)
    assert all(torch.equal(a[k], b[k]) for k in b)


def test_encoder_self_attention_norms_keep_no_affine():
    """k_proj has no bias, yet β folds: its term βW_k is the same for every key of a query and the softmax
    drops it (issue 13). Every encoder self-attention norm ends without γ and β, still exact."""
    model = make()
    plan = get_adapter("whisper").plan(model)
    sites = [s for s in plan.streams[0].norms if s.path.endswith("self_attn_layer_norm")]
    assert [s.beta_cancels for s in sites] == [(f"model.encoder.layers.{i}.self_attn.k_proj",) for i in range(2)]
    assert model.model.encoder.layers[0].self_attn.k_proj.bias is None
    conv, report = normfold.convert(model)
    for i in range(2):
        ln = conv.model.encoder.layers[i].self_attn_layer_norm
        assert isinstance(ln, RMSNorm) and ln.weight is None and ln.bias is None
        assert conv.model.encoder.layers[i].self_attn.k_proj.bias is None  # nothing grew
    assert report.structure.added_bias == [] and report.verification["fp64"]["max_rel_error"] <= 1e-9
    ref, got = run_flat(model, INPUTS), run_flat(conv, INPUTS)
    for k in ("logits", "encoder_last_hidden_state"):
        assert rel_err(got[k], ref[k]) <= 1e-9, k
