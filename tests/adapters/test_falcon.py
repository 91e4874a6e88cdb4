"""Falcon specifics: which norms exist and what reads them in each LayerNorm variant."""

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

transformers = pytest.importorskip("transformers")
from transformers import FalconConfig, FalconForCausalLM, FalconModel  # noqa: E402

from normfold.errors import UnsupportedConversionError  # noqa: E402

CFG = dict(vocab_size=89, max_position_embeddings=32, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
           pad_token_id=3)
INPUTS = ids(89)
QKV, MLP = "self_attention.query_key_value", "mlp.dense_h_to_4h"

VARIANTS = {
    "new-arch-2ln": (dict(new_decoder_architecture=True, parallel_attn=True, num_kv_heads=2),
                     {"ln_attn": [QKV], "ln_mlp": [MLP]}),
    "new-arch-1ln": (dict(new_decoder_architecture=True, parallel_attn=True, num_kv_heads=2, num_ln_in_parallel_attn=1),
                     {"input_layernorm": [QKV, MLP]}),
    "parallel-mqa": (dict(parallel_attn=True, multi_query=True), {"input_layernorm": [QKV, MLP]}),
    "sequential": (dict(parallel_attn=False, multi_query=False),
                   {"input_layernorm": [QKV], "post_attention_layernorm": [MLP]}),
}


@pytest.mark.parametrize("alibi", [False, True], ids=["rotary", "alibi"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_variant_norms_and_readers(variant, alibi):
    kwargs, expected = VARIANTS[variant]
    model = make(FalconConfig, FalconForCausalLM, bias=True, alibi=alibi, **kwargs, **CFG)
    conv, report = assert_exact(model, INPUTS)
    assert layernorms(conv) == []
    folded = {r.name.split(".")[-1]: sorted(p.split(".", 3)[-1] for p in r.folded_into)
              for r in report.structure.norms if r.name.startswith("transformer.h.0.")}
    assert folded == {k: sorted(v) for k, v in expected.items()}
    assert len(rmsnorms(conv)) == 2 * len(expected) + 1
    assert_norm_inputs_zero_mean(conv, INPUTS)
    assert_stream_zero_mean(conv, INPUTS)


def test_without_bias_beta_stays_in_the_norm():
    model = make(FalconConfig, FalconForCausalLM, new_decoder_architecture=True, parallel_attn=True, **CFG)
    assert model.transformer.h[0].self_attention.query_key_value.bias is None
    conv, report = assert_exact(model, INPUTS)
    ln = conv.transformer.h[0].ln_attn
    assert ln.weight is not None and ln.bias is not None
    assert report.structure.added_bias == [] and report.stock_reloadable  # lm_head stays tied, stock LN re-centres
    assert report.structure.recenter_after == ["transformer.word_embeddings"] and not report.structure.tied_heads
    _, report_u = assert_exact(model, INPUTS, untie=True)
    assert report_u.stock_reloadable and report_u.structure.added_bias == []


def test_configs_transformers_cannot_run_are_rejected():
    model = FalconModel(FalconConfig(new_decoder_architecture=True, parallel_attn=False, **CFG))
    with pytest.raises(UnsupportedConversionError, match="parallel_attn"):
        normfold.convert(model)


@pytest.mark.parametrize("eps", [1e-5, 1e-12])
def test_eps_is_carried(eps):
    model = make(FalconConfig, FalconModel, layer_norm_epsilon=eps, parallel_attn=False, **CFG)
    conv, _ = assert_exact(model, INPUTS)
    assert {m.eps for m in rmsnorms(conv).values()} == {eps}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision(dtype):
    model = make(FalconConfig, FalconForCausalLM, dtype=torch.float32, new_decoder_architecture=True,
                 parallel_attn=True, num_kv_heads=2, **CFG)
    assert_half_precision(model, INPUTS, dtype)
