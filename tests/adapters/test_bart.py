"""BART (Post-LN): which norms are provably exact (the embedding LayerNorms; block norms only after
a norm without elementwise affine, paper 001 App. B), the kept norms and their reasons."""

import pytest
import torch

import normfold
from helpers import realistic, rel_err, run_flat
from normfold.adapters.mbart import seq2seq_text_inputs
from normfold.nn import RMSNorm

transformers = pytest.importorskip("transformers")
from transformers import BartConfig, BartForCausalLM, BartForConditionalGeneration  # noqa: E402

CFG = dict(vocab_size=99, max_position_embeddings=32, pad_token_id=1, bos_token_id=0, eos_token_id=2,
           decoder_start_token_id=2, d_model=32, encoder_layers=2, decoder_layers=3, encoder_attention_heads=4,
           decoder_attention_heads=4, encoder_ffn_dim=48, decoder_ffn_dim=48)


def make(cls=BartForConditionalGeneration):
    torch.manual_seed(0)
    return realistic(cls(BartConfig(**CFG)).eval().double())


def affine_free(model, except_=()):
    """Every LayerNorm (but `except_`) loses its elementwise affine, as with elementwise_affine=False."""
    for name, m in model.named_modules():
        if isinstance(m, torch.nn.LayerNorm) and name not in except_:
            m.register_parameter("weight", None)
            m.register_parameter("bias", None)
    return model


def inputs(model):
    return seq2seq_text_inputs(model, torch.Generator().manual_seed(0))


def assert_exact(conv, model):
    x = inputs(model)
    ref, got = run_flat(model, x), run_flat(conv, x)
    for k in ref:
        r, g = ref[k], got[k]
        if "hidden_states" in k:
            r, g = r - r.mean(-1, keepdim=True), g - g.mean(-1, keepdim=True)
        assert rel_err(g, r) <= 1e-9, k


def test_trained_like_bart_converts_only_the_embedding_norms():
    model = make()
    conv, report = normfold.convert(model, verify=False)
    assert [r.name for r in report.structure.norms] == ["model.encoder.layernorm_embedding",
                                                        "model.decoder.layernorm_embedding"]
    ln = conv.model.encoder.layernorm_embedding
    assert isinstance(ln, RMSNorm) and ln.weight is not None and ln.bias is not None  # its output is the stream
    kept = {k["name"]: k["reason"] for k in report.kept}
    assert len(kept) == 2 * 2 + 3 * 3 and all("Post-LN" in r for r in kept.values())
    assert "model.encoder.layernorm_embedding" in kept["model.encoder.layers.0.self_attn_layer_norm"]
    assert "layers.1.encoder_attn_layer_norm" in kept["model.decoder.layers.1.final_layer_norm"]
    # the branch writers are left alone (nothing to gain), the position tables are centred; the token table
    # stays the original, tied to lm_head, and a Recenter after each embedding centres its output
    assert report.centered == ["model.encoder.embed_positions", "model.decoder.embed_positions"]
    assert report.structure.recenter_after == ["model.encoder.embed_tokens", "model.decoder.embed_tokens"]
    # one table: shared, encoder, decoder and lm_head (the stock head)
    assert conv.lm_head.weight is conv.model.decoder.embed_tokens.weight is conv.model.shared.weight
    assert type(conv.lm_head) is torch.nn.Linear and torch.equal(conv.lm_head.weight, model.lm_head.weight)
    # stock-reloadable: the Recenters are for normfold's RMSNorms, stock LayerNorms re-centre their input
    assert report.stock_reloadable and any("no measurable speed-up" in n for n in report.notes)
    untied, report_u = normfold.convert(model, verify=False, untie=True)  # the untied form
    assert untied.lm_head.weight is not untied.model.decoder.embed_tokens.weight
    assert torch.equal(untied.lm_head.weight, model.lm_head.weight) and report_u.stock_reloadable
    assert_exact(conv, model)


def test_affine_free_bart_converts_every_norm():
    model = affine_free(make())
    conv, report = normfold.convert(model, verify=False)
    assert report.kept == [] and not any(isinstance(m, torch.nn.LayerNorm) for m in conv.modules())
    assert len(report.structure.norms) == 2 + 2 * 2 + 3 * 3
    assert "model.decoder.layers.2.encoder_attn.out_proj" in report.centered
    assert_exact(conv, model)


def test_one_learned_norm_keeps_only_its_successor():
    bad = "model.encoder.layers.0.self_attn_layer_norm"
    model = affine_free(make(), except_=(bad,))
    conv, report = normfold.convert(model, verify=False)
    kept = {k["name"]: k["reason"] for k in report.kept}
    assert list(kept) == ["model.encoder.layers.0.final_layer_norm"] and bad in kept[list(kept)[0]]
    assert isinstance(conv.model.encoder.layers[0].self_attn_layer_norm, RMSNorm)  # its own input is fine
    assert_exact(conv, model)


def test_causal_lm_without_cross_attention():
    # without encoder states the decoder skips encoder_attn_layer_norm: final_layer_norm then reads
    # self_attn_layer_norm's output, so both must qualify
    bad = "model.decoder.layers.1.self_attn_layer_norm"
    model = affine_free(make(BartForCausalLM), except_=(bad,))
    conv, report = normfold.convert(model, verify=False)
    assert {k["name"] for k in report.kept} == {"model.decoder.layers.1.encoder_attn_layer_norm",
                                                "model.decoder.layers.1.final_layer_norm"}
    assert_exact(conv, model)


def test_plans_are_structural_not_value_based():
    # an untrained BART has γ = 1, β = 0 everywhere, which happens to make every norm exact; the plan
    # does not look at values (it must stay valid once training moves γ), so it converts the same two
    torch.manual_seed(0)
    fresh = BartForConditionalGeneration(BartConfig(**CFG)).eval().double()
    assert all(bool((m.weight == 1).all()) for m in fresh.modules() if isinstance(m, torch.nn.LayerNorm))
    conv, report = normfold.convert(fresh, verify=False)
    assert len(report.structure.norms) == 2 and len(report.kept) == 2 * 2 + 3 * 3
    assert_exact(conv, fresh)
