"""BLOOM specifics: the embedding LayerNorm sits on the stream (recentred once), tied tables stay
tied, apply_residual_connection_post_layernorm."""

import dataclasses

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
    max_error,
    rmsnorms,
)
from helpers import run_flat

transformers = pytest.importorskip("transformers")
from transformers import BloomConfig, BloomForCausalLM, BloomForTokenClassification, BloomModel  # noqa: E402

from normfold.adapters import get_adapter  # noqa: E402
from normfold.nn.hooks import has_output_recenter  # noqa: E402

CFG = dict(vocab_size=73, hidden_size=24, n_layer=2, n_head=3, pad_token_id=3)
INPUTS = ids(73)


def test_tied_lm_keeps_the_embedding_norm_and_recentres_its_output():
    model = make(BloomConfig, BloomForCausalLM, **CFG)
    assert model.lm_head.weight is model.transformer.word_embeddings.weight
    conv, report = assert_exact(model, INPUTS)
    t = conv.transformer
    assert layernorms(conv) == ["transformer.word_embeddings_layernorm"]
    assert "lm_head" in kept_reasons(report)["transformer.word_embeddings_layernorm"]
    assert has_output_recenter(t.word_embeddings_layernorm)
    assert report.structure.recenter_after == ["transformer.word_embeddings_layernorm"]
    # the table is not edited, so it stays tied to lm_head (no vocab x hidden copy)
    assert conv.lm_head.weight is t.word_embeddings.weight and report.structure.untied == []
    assert torch.equal(t.word_embeddings.weight, model.transformer.word_embeddings.weight)
    assert len(rmsnorms(conv)) == 2 * 2 + 1 and report.stock_reloadable  # stock LayerNorms need no Recenter
    assert t.h[0].input_layernorm.weight is None  # folded into the fused query_key_value
    assert_norm_inputs_zero_mean(conv, INPUTS)
    assert_stream_zero_mean(conv, INPUTS)


@pytest.mark.parametrize("cls", [BloomModel, BloomForTokenClassification])
def test_untied_table_is_centred_and_the_embedding_norm_converted(cls):
    model = make(BloomConfig, cls, **CFG)
    conv, report = assert_exact(model, INPUTS)
    prefix = "transformer." if cls is not BloomModel else ""
    eln = conv.get_submodule(prefix + "word_embeddings_layernorm")
    assert layernorms(conv) == [] and report.kept == []
    # an RMSNorm keeping its affine (its output is the stream), with the Recenter on top of it
    assert type(eln).__name__ == "RMSNorm" and eln.weight is not None and eln.bias is not None
    assert has_output_recenter(eln)
    assert prefix + "word_embeddings" in report.centered
    assert_norm_inputs_zero_mean(conv, INPUTS)


def test_without_the_recenter_the_block_norms_would_be_wrong():
    # The decision's premise: the embedding norm's output is not zero-mean, so converting the block norms
    # without recentring it is not exact (and the error is large, not rounding).
    model = make(BloomConfig, BloomForCausalLM, **CFG)
    adapter = get_adapter("bloom")

    def no_recenter(m):
        plan = adapter.plan(m)
        plan.streams[0].recenter_after.clear()
        return plan

    conv, report = normfold.convert(model, adapter=dataclasses.replace(adapter, plan=no_recenter), verify=False)
    assert max_error(model, conv, report, INPUTS) > 1e-3


def test_save_and_normfold_load_replay_the_recenter(tmp_path):
    model = make(BloomConfig, BloomModel, dtype=torch.float32, **CFG)
    conv, report = normfold.convert(model, verify=False)
    out = normfold.save(conv, report, tmp_path / "out")
    assert (out / "model.safetensors").is_file() and not (out / "normfold_model.safetensors").exists()
    loaded = normfold.load(out)
    assert has_output_recenter(loaded.word_embeddings_layernorm)
    assert type(loaded.word_embeddings_layernorm).__name__ == "RMSNorm"
    got, ref = run_flat(loaded, INPUTS), run_flat(conv, INPUTS)
    assert all(torch.equal(got[k], ref[k]) for k in ref)


@pytest.mark.parametrize("tied", [True, False])
def test_residual_post_layernorm_converts_only_the_embedding_norm(tied):
    model = make(BloomConfig, BloomForCausalLM, apply_residual_connection_post_layernorm=True,
                 tie_word_embeddings=tied, **CFG)
    conv, report = assert_exact(model, INPUTS)
    reasons = kept_reasons(report)
    assert len(reasons) == 2 * 2 + 1 + tied
    assert all("apply_residual_connection_post_layernorm" in r for n, r in reasons.items()
               if n != "transformer.word_embeddings_layernorm")
    assert [r.name for r in report.structure.norms] == ([] if tied else ["transformer.word_embeddings_layernorm"])
    assert report.structure.recenter_after == [] and report.stock_reloadable
    if tied:
        assert any("nothing is converted" in n for n in report.notes)


@pytest.mark.parametrize("eps", [1e-5, 1e-12])
def test_eps_is_carried(eps):
    model = make(BloomConfig, BloomModel, layer_norm_epsilon=eps, **CFG)
    conv, _ = assert_exact(model, INPUTS)
    assert {m.eps for m in rmsnorms(conv).values()} == {eps}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision(dtype):
    assert_half_precision(make(BloomConfig, BloomForCausalLM, dtype=torch.float32, **CFG), INPUTS, dtype)
