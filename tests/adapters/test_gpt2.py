"""GPT-2 conversion: outputs of the converted model against the original, independently of
normfold.verify (the tests run both models themselves)."""

import copy

import pytest
import torch

import normfold
from helpers import add_mean_offsets, perturb_biases, perturb_norms, rel_err

transformers = pytest.importorskip("transformers")
from transformers import (  # noqa: E402
    GPT2Config,
    GPT2DoubleHeadsModel,
    GPT2ForQuestionAnswering,
    GPT2ForSequenceClassification,
    GPT2ForTokenClassification,
    GPT2LMHeadModel,
    GPT2Model,
)

CONFIGS = {
    "tied-small": dict(n_embd=24, n_layer=2, n_head=3, layer_norm_epsilon=1e-5),
    "untied-eps6": dict(n_embd=32, n_layer=3, n_head=4, layer_norm_epsilon=1e-6, tie_word_embeddings=False),
    "inv-layer-idx": dict(n_embd=16, n_layer=3, n_head=2, scale_attn_by_inverse_layer_idx=True,
                          reorder_and_upcast_attn=True, layer_norm_epsilon=1e-12),
    "odd-width": dict(n_embd=30, n_layer=2, n_head=5, n_inner=50, activation_function="gelu_new"),
}
HEADS = [GPT2Model, GPT2LMHeadModel, GPT2ForSequenceClassification, GPT2ForTokenClassification,
         GPT2ForQuestionAnswering, GPT2DoubleHeadsModel]


def make(cls, name, dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    cfg = GPT2Config(vocab_size=97, n_positions=24, bos_token_id=0, eos_token_id=0, pad_token_id=0,
                     num_labels=3, **CONFIGS[name])
    model = cls(cfg).eval()
    perturb_norms(model)
    perturb_biases(model)
    add_mean_offsets(model)
    return model.to(dtype)


def outputs(model, ids):
    with torch.no_grad():
        out = model(input_ids=ids, output_hidden_states=True, use_cache=False)
    flat = {}
    for k, v in out.items():
        if isinstance(v, torch.Tensor):
            flat[k] = v
        elif isinstance(v, tuple) and k == "hidden_states":
            for i, h in enumerate(v):
                flat[f"h{i}"] = h - h.mean(-1, keepdim=True)  # stream is recentred by the conversion
    return flat


IDS = torch.randint(0, 97, (2, 12), generator=torch.Generator().manual_seed(5))


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("cls", HEADS, ids=lambda c: c.__name__)
def test_float64_conversion_is_exact(cls, name):
    model = make(cls, name, torch.float64)
    conv, report = normfold.convert(model, verify=False)
    ref, got = outputs(model, IDS), outputs(conv, IDS)
    assert set(ref) == set(got) and ref
    for k in ref:
        assert rel_err(got[k], ref[k]) <= 1e-9, k
    assert report.to_dict()["layernorms"]["converted"] == 2 * model.config.n_layer + 1


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("cls", [GPT2LMHeadModel, GPT2ForSequenceClassification, GPT2DoubleHeadsModel],
                         ids=lambda c: c.__name__)
def test_float32_error_is_within_four_times_the_originals_own_error(cls, name):
    model = make(cls, name, torch.float32)
    conv, report = normfold.convert(model)
    exact = outputs(copy.deepcopy(model).double(), IDS)
    orig, got = outputs(model, IDS), outputs(conv, IDS)
    for k in exact:
        base = rel_err(orig[k], exact[k])
        assert rel_err(got[k], exact[k]) <= 4 * base + 64 * torch.finfo(torch.float32).eps, k
    v = report.verification
    assert v["passed"] and v["fp64"]["max_rel_error"] <= 1e-9 and v["dtype"] == "float32"
    if cls is GPT2LMHeadModel:
        assert v["top1_agreement"] == 1.0


def test_conversion_does_not_modify_the_original():
    model = make(GPT2LMHeadModel, "tied-small")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    normfold.convert(model, verify=False)
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
    assert model.lm_head.weight is model.transformer.wte.weight


def test_structure_after_conversion():
    from normfold.nn import RMSNorm

    model = make(GPT2LMHeadModel, "tied-small")
    conv, report = normfold.convert(model, verify=False)
    t = conv.transformer
    assert not any(isinstance(m, torch.nn.LayerNorm) for m in conv.modules())
    assert isinstance(t.h[0].ln_1, RMSNorm) and t.h[0].ln_1.weight is None and t.h[0].ln_1.bias is None
    assert t.ln_f.weight is not None and t.ln_f.bias is not None  # final norm keeps its affine
    # the tie is kept: the table stays the original, the stock head reads it, a Recenter centres wte's output
    assert conv.lm_head.weight is t.wte.weight and conv.config.tie_word_embeddings is True
    assert type(conv.lm_head) is torch.nn.Linear and torch.equal(t.wte.weight, model.transformer.wte.weight)
    assert report.structure.tied_heads == [] and report.structure.recenter_after == ["transformer.wte"]
    assert "transformer.wte" not in report.centered and "transformer.wpe" in report.centered
    untied, report_u = normfold.convert(model, verify=False, untie=True)  # the plain-transformers form
    assert untied.lm_head.weight is not untied.transformer.wte.weight and untied.config.tie_word_embeddings is False
    assert report_u.stock_reloadable and report.stock_reloadable  # both: stock LayerNorms need no Recenter
    # the stream is zero-mean: every writer is centred
    ids = IDS
    with torch.no_grad():
        hs = conv(input_ids=ids, output_hidden_states=True).hidden_states
    for h in hs[:-1]:
        assert h.double().mean(-1).abs().max() <= 1e-5 * h.abs().max()
    assert not conv.training


def test_keep_affine_keeps_gamma_beta_in_rmsnorm():
    model = make(GPT2LMHeadModel, "untied-eps6", torch.float64)
    conv, report = normfold.convert(model, keep_affine=True, verify=False)
    ln = conv.transformer.h[1].ln_2
    assert ln.weight is not None and ln.bias is not None
    assert torch.equal(ln.weight, model.transformer.h[1].ln_2.weight)
    assert rel_err(outputs(conv, IDS)["logits"], outputs(model, IDS)["logits"]) <= 1e-9


def test_affine_stays_in_the_norm_when_a_reader_has_no_bias():
    # Folding β needs a bias on every reader; with γ folded alone the norm would have to emit n + β/γ.
    # So when c_fc has no bias, ln_2 keeps its whole affine.
    model = make(GPT2LMHeadModel, "tied-small", torch.float64)
    for blk in model.transformer.h:  # an nn.Linear reader without bias (HF Conv1D always has one)
        old = blk.mlp.c_fc
        blk.mlp.c_fc = torch.nn.Linear(old.weight.shape[0], old.weight.shape[1], bias=False, dtype=torch.float64)
        blk.mlp.c_fc.weight.data.copy_(old.weight.T)
    conv, report = normfold.convert(model, verify=False, untie=True)
    ln2 = conv.transformer.h[0].ln_2
    assert ln2.weight is not None and ln2.bias is not None
    assert conv.transformer.h[0].ln_1.weight is None  # ln_1's reader c_attn has a bias: folded
    assert conv.transformer.h[0].mlp.c_fc.bias is None
    assert report.stock_reloadable
    assert rel_err(outputs(conv, IDS)["logits"], outputs(model, IDS)["logits"]) <= 1e-9
    conv2, report2 = normfold.convert(model, allow_new_bias=True, verify=False)
    assert conv2.transformer.h[0].ln_2.bias is None and conv2.transformer.h[0].ln_2.weight is None
    assert conv2.transformer.h[0].mlp.c_fc.bias is not None
    assert not report2.stock_reloadable
    assert rel_err(outputs(conv2, IDS)["logits"], outputs(model, IDS)["logits"]) <= 1e-9


@pytest.mark.parametrize("untie", [False, True])
def test_fold_final_into_lm_head(untie):
    model = make(GPT2LMHeadModel, "tied-small", torch.float64)
    conv, report = normfold.convert(model, fold_final=True, allow_new_bias=True, untie=untie)
    assert conv.transformer.ln_f.weight is None and conv.transformer.ln_f.bias is None
    assert conv.lm_head.bias is not None
    assert (conv.lm_head.weight is conv.transformer.wte.weight) is not untie
    assert rel_err(outputs(conv, IDS)["logits"], outputs(model, IDS)["logits"]) <= 1e-9
    assert report.verification["passed"]


def test_training_mode_with_dropout_is_reported():
    model = make(GPT2LMHeadModel, "tied-small").train()
    conv, report = normfold.convert(model, verify=False)
    assert not conv.training
    assert any("training mode" in w and "not equivalent" in w for w in report.warnings)
    assert model.training  # the caller's model is left as it was


def test_nan_weights_are_rejected():
    from normfold.errors import NonFiniteWeightsError

    model = make(GPT2LMHeadModel, "tied-small")
    with torch.no_grad():
        model.transformer.h[1].attn.c_proj.weight[0, 0] = float("nan")
    with pytest.raises(NonFiniteWeightsError, match="h.1.attn.c_proj.weight"):
        normfold.convert(model)


def test_cross_attention_config_is_rejected_with_a_reason():
    from normfold.errors import UnsupportedConversionError

    cfg = GPT2Config(vocab_size=50, n_positions=16, n_embd=16, n_layer=1, n_head=2, add_cross_attention=True)
    with pytest.raises(UnsupportedConversionError, match="cross_attention"):
        normfold.convert(GPT2LMHeadModel(cfg))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_models_convert_through_float64(dtype):
    model = make(GPT2LMHeadModel, "untied-eps6", dtype)
    conv, report = normfold.convert(model)
    assert next(conv.parameters()).dtype == dtype
    v = report.verification
    assert v["fp64"]["max_rel_error"] <= 1e-9
    assert v["working"]["passed"], v["working"]["outputs"]


def test_inplace_conversion():
    model = make(GPT2LMHeadModel, "tied-small")
    exact = outputs(copy.deepcopy(model).double(), IDS)["logits"]
    base = rel_err(outputs(model, IDS)["logits"], exact)
    conv, report = normfold.convert(model, inplace=True)
    assert conv is model
    assert report.verification["passed"]
    assert rel_err(outputs(conv, IDS)["logits"], exact) <= 4 * base + 64 * torch.finfo(torch.float32).eps
