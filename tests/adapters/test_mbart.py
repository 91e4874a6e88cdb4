"""mBART: layernorm_embedding on each stream (RMSNorm + Recenter, or a centred bias when it has no
weight), the encoder's final norm read by the cross-attention, untied lm_head, fold_final."""

import dataclasses

import pytest
import torch

import normfold
from helpers import realistic, rel_err, run_flat
from normfold.adapters import get_adapter
from normfold.adapters.mbart import seq2seq_text_inputs
from normfold.nn import RMSNorm
from normfold.nn.hooks import has_output_recenter

transformers = pytest.importorskip("transformers")
from transformers import MBartConfig, MBartForConditionalGeneration  # noqa: E402

CFG = dict(vocab_size=99, max_position_embeddings=32, pad_token_id=1, bos_token_id=0, eos_token_id=2,
           decoder_start_token_id=2, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
           decoder_attention_heads=4, encoder_ffn_dim=48, decoder_ffn_dim=48, scale_embedding=True)


def make():
    torch.manual_seed(0)
    return realistic(MBartForConditionalGeneration(MBartConfig(**CFG)).eval().double())


def logits(model):
    return run_flat(model, seq2seq_text_inputs(model, torch.Generator().manual_seed(0)))["logits"]


def test_structure():
    model = make()
    conv, report = normfold.convert(model, verify=False)
    assert report.kept == [] and not any(isinstance(m, torch.nn.LayerNorm) for m in conv.modules())
    for tower in (conv.model.encoder, conv.model.decoder):
        ln = tower.layernorm_embedding
        assert isinstance(ln, RMSNorm) and ln.weight is not None and has_output_recenter(ln)
        assert tower.layers[0].self_attn_layer_norm.weight is None and tower.layer_norm.weight is not None
    assert report.structure.recenter_after == ["model.encoder.layernorm_embedding", "model.encoder.embed_tokens",
                                               "model.decoder.layernorm_embedding", "model.decoder.embed_tokens"]
    assert report.stock_reloadable  # the Recenters are for normfold's RMSNorms: stock LayerNorms re-centre
    site = next(s for s in get_adapter("mbart").plan(model).streams[0].norms if s.path == "model.encoder.layer_norm")
    assert site.final and len(site.readers) == 2 * 2 and all("encoder_attn" in r for r in site.readers)
    assert conv.lm_head.weight is conv.model.decoder.embed_tokens.weight  # kept tied: the original table
    assert type(conv.lm_head) is torch.nn.Linear and torch.equal(conv.lm_head.weight, model.lm_head.weight)
    assert rel_err(logits(conv), logits(model)) <= 1e-9


def test_without_the_recenters_it_is_not_exact():
    adapter = get_adapter("mbart")

    def plan(model):
        p = adapter.plan(model)
        for s in p.streams:
            s.recenter_after.clear()
        return p

    model = make()
    conv, _ = normfold.convert(model, adapter=dataclasses.replace(adapter, plan=plan), verify=False)
    assert rel_err(logits(conv), logits(model)) > 1e-4


def test_embedding_norms_without_weight_stay_stock_reloadable(tmp_path):
    model = make()
    for tower in (model.model.encoder, model.model.decoder):
        tower.layernorm_embedding.register_parameter("weight", None)  # n + β: zero-mean once β is centred
    conv, report = normfold.convert(model, verify=False, untie=True)  # untied: the stock form
    assert report.stock_reloadable and report.structure.recenter_after == []
    assert "model.decoder.layernorm_embedding.bias" in report.centered
    normfold.save(conv, report, tmp_path / "out")
    stock = MBartForConditionalGeneration.from_pretrained(tmp_path / "out").eval()
    assert rel_err(logits(stock), logits(model)) <= 1e-9


def test_fold_final_into_lm_head():
    model = make()
    conv, report = normfold.convert(model, fold_final=True, allow_new_bias=True, verify=False)
    assert conv.model.decoder.layer_norm.weight is None and conv.lm_head.bias is not None
    assert conv.model.encoder.layer_norm.weight is None  # folded into every cross-attention k/v
    assert rel_err(logits(conv), logits(model)) <= 1e-9
