"""ViT / DeiT: structure after conversion, the stream writers (patch conv, cls / distillation /
mask tokens, position embeddings), interpolated positions, fold_final into the heads."""

import pytest
import torch

import normfold
from helpers import realistic, rel_err, run_flat
from normfold.nn import RMSNorm

transformers = pytest.importorskip("transformers")
from transformers import (  # noqa: E402
    DeiTConfig,
    DeiTForImageClassificationWithTeacher,
    DeiTForMaskedImageModeling,
    ViTConfig,
    ViTForImageClassification,
    ViTForMaskedImageModeling,
    ViTModel,
)

VIT = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, image_size=16,
           patch_size=4, encoder_stride=4, num_labels=3, pooler_output_size=20)


def make(cls, config_cls=ViTConfig, dtype=torch.float64, **overrides):
    torch.manual_seed(0)
    model = realistic(cls(config_cls(**{**VIT, **overrides})).eval()).to(dtype)
    emb = next(m for n, m in model.named_modules() if n.endswith("embeddings") and hasattr(m, "cls_token"))
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():  # large common offsets on every writer the embeddings own, so centring matters
        for p in (emb.cls_token, emb.position_embeddings, getattr(emb, "distillation_token", None),
                  getattr(emb, "mask_token", None), emb.patch_embeddings.projection.bias):
            if p is not None:
                p.add_(3.0 + torch.randn(p.shape[:-1] + (1,), generator=g, dtype=p.dtype))
    return model


def pixels(size=16, channels=3, batch=2, seed=0):
    return torch.randn(batch, channels, size, size, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def assert_exact(conv, model, inputs, centred=("hidden_states",)):
    ref, got = run_flat(model, inputs), run_flat(conv, inputs)
    assert ref and set(ref) == set(got)
    for k in ref:
        r, g = ref[k], got[k]
        if k.startswith(centred):
            r, g = r - r.mean(-1, keepdim=True), g - g.mean(-1, keepdim=True)
        assert rel_err(g, r) <= 1e-9, k


def test_structure_and_writers():
    model = make(ViTModel)
    conv, report = normfold.convert(model, verify=False)
    assert not any(isinstance(m, torch.nn.LayerNorm) for m in conv.modules())
    layer = conv.layers[0]
    assert isinstance(layer.layernorm_before, RMSNorm) and layer.layernorm_before.weight is None
    assert layer.layernorm_before.bias is None and layer.layernorm_after.weight is None
    assert conv.layernorm.weight is not None and conv.layernorm.bias is not None  # final: output keeps affine
    assert len(report.structure.norms) == 2 * 2 + 1 and report.kept == [] and report.stock_reloadable
    emb = conv.embeddings
    for t in (emb.cls_token, emb.position_embeddings, emb.patch_embeddings.projection.bias):
        assert t.mean(-1).abs().max() <= 1e-12
    assert emb.patch_embeddings.projection.weight.sum(0).abs().max() <= 1e-12  # centred over output channels
    assert set(report.centered) >= {"embeddings.cls_token", "embeddings.position_embeddings",
                                     "embeddings.patch_embeddings.projection", "layers.1.mlp.fc2"}
    with torch.no_grad():
        hs = conv(pixel_values=pixels(), output_hidden_states=True).hidden_states
    for h in hs:  # the whole stream is zero-mean (tie_last_hidden_states=False: all raw stream)
        assert h.mean(-1).abs().max() <= 1e-12 * h.abs().max()
    assert_exact(conv, model, {"pixel_values": pixels()})


def test_norm_keeps_its_affine_when_readers_have_no_bias():
    model = make(ViTForImageClassification, qkv_bias=False)
    conv, report = normfold.convert(model, verify=False)
    ln = conv.vit.layers[1].layernorm_before  # q/k/v have no bias: beta cannot be folded, so gamma stays too
    assert ln.weight is not None and ln.bias is not None and conv.vit.layers[1].layernorm_after.weight is None
    assert report.stock_reloadable and not report.structure.added_bias
    assert_exact(conv, model, {"pixel_values": pixels()})


def test_interpolated_position_embeddings_stay_exact():
    # bicubic interpolation mixes positions with channel-independent weights: rows stay zero-mean
    model = make(ViTForImageClassification)
    conv, _ = normfold.convert(model, verify=False)
    assert_exact(conv, model, {"pixel_values": pixels(size=24), "interpolate_pos_encoding": True})


@pytest.mark.parametrize("cls,config_cls", [(ViTForMaskedImageModeling, ViTConfig),
                                            (DeiTForMaskedImageModeling, DeiTConfig)])
def test_mask_token_is_a_writer(cls, config_cls):
    model = make(cls, config_cls)
    conv, report = normfold.convert(model, verify=False)
    prefix = model.base_model_prefix
    assert f"{prefix}.embeddings.mask_token" in report.centered
    mask = torch.rand(2, 16, generator=torch.Generator().manual_seed(1)) < 0.5
    assert_exact(conv, model, {"pixel_values": pixels(), "bool_masked_pos": mask})


def test_fold_final_into_classifier_but_not_into_the_mim_conv():
    model = make(ViTForImageClassification)
    conv, report = normfold.convert(model, fold_final=True, allow_new_bias=True)
    assert conv.vit.layernorm.weight is None and conv.vit.layernorm.bias is None
    assert rel_err(run_flat(conv, {"pixel_values": pixels()})["logits"],
                   run_flat(model, {"pixel_values": pixels()})["logits"]) <= 1e-9
    mim = make(ViTForMaskedImageModeling)
    conv, report = normfold.convert(mim, fold_final=True)
    # the MIM decoder's 1x1 Conv2d reads the norm over its channels with no padding: since issue 13 the
    # affine folds into it too (normfold.algebra.fold_affine_conv), exactly
    assert conv.vit.layernorm.weight is None and conv.vit.layernorm.bias is None
    assert_exact(conv, mim, {"pixel_values": pixels()})


def test_deit_with_teacher_structure():
    model = make(DeiTForImageClassificationWithTeacher, DeiTConfig)
    conv, report = normfold.convert(model, fold_final=True, allow_new_bias=True)
    assert "deit.embeddings.distillation_token" in report.centered
    assert conv.deit.embeddings.distillation_token.mean(-1).abs().max() <= 1e-12
    # both heads read the final norm, so both absorbed its affine
    assert conv.deit.layernorm.weight is None
    rec = next(r for r in report.structure.norms if r.name == "deit.layernorm")
    assert set(rec.folded_into) == {"cls_classifier", "distillation_classifier"}
    inputs = {"pixel_values": pixels()}
    ref, got = run_flat(model, inputs), run_flat(conv, inputs)
    for k in ("logits", "cls_logits", "distillation_logits"):
        assert rel_err(got[k], ref[k]) <= 1e-9, k
