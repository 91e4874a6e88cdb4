"""SigLIP: both towers converted, the attention-pooling head's LayerNorm kept (and why converting
it would not be exact), interpolated positions, fold_final."""

import dataclasses

import pytest
import torch

import normfold
from helpers import realistic, rel_err, run_flat
from normfold.adapters import NormSite, get_adapter
from normfold.nn import RMSNorm

transformers = pytest.importorskip("transformers")
from transformers import (  # noqa: E402
    SiglipConfig,
    SiglipForImageClassification,
    SiglipModel,
    SiglipVisionConfig,
    SiglipVisionModel,
)

TEXT = dict(vocab_size=99, hidden_size=24, intermediate_size=48, num_hidden_layers=2, num_attention_heads=3,
            max_position_embeddings=16, projection_size=24)
VISION = dict(hidden_size=24, intermediate_size=40, num_hidden_layers=2, num_attention_heads=2, image_size=16,
              patch_size=4)
G = torch.Generator().manual_seed(7)
IDS = torch.randint(0, 99, (2, 7), generator=G)
PIX = torch.randn(2, 3, 16, 16, generator=G, dtype=torch.float64)


def make(cls=SiglipModel, **vision):
    torch.manual_seed(0)
    if cls is SiglipVisionModel:
        cfg = SiglipVisionConfig(**{**VISION, **vision})
    else:
        cfg = SiglipConfig(text_config=TEXT, vision_config={**VISION, **vision}, num_labels=3)
    model = realistic(cls(cfg).eval().double())
    with torch.no_grad():  # a large common offset on the patch conv's output (its bias)
        for m in model.modules():
            if type(m).__name__ == "SiglipVisionEmbeddings":
                m.patch_embedding.bias.add_(3.0)
    return model


def test_structure_and_kept_head_norm():
    model = make()
    conv, report = normfold.convert(model, verify=False)
    assert report.stock_reloadable and report.structure.recenter_after == []
    kept = {k["name"]: k["reason"] for k in report.kept}
    assert list(kept) == ["vision_model.head.layernorm"] and "pooled output" in kept["vision_model.head.layernorm"]
    assert isinstance(conv.vision_model.head.layernorm, torch.nn.LayerNorm)
    lns = report.to_dict()["layernorms"]  # text: 2 per block + final; vision: the same + the head's
    assert (lns["total"], lns["converted"]) == (11, 10)
    v, t = conv.vision_model, conv.text_model
    assert isinstance(v.post_layernorm, RMSNorm) and v.post_layernorm.weight is not None
    assert v.encoder.layers[0].layer_norm1.weight is None and t.encoder.layers[1].layer_norm2.weight is None
    inputs = {"input_ids": IDS, "pixel_values": PIX}
    ref, got = run_flat(model, inputs), run_flat(conv, inputs)
    for k in ("logits_per_image", "image_embeds", "text_embeds", "vision_model_output.last_hidden_state"):
        assert rel_err(got[k], ref[k]) <= 1e-9, k


def test_converting_the_pooling_head_stream_would_change_the_embeddings():
    # the decision behind keeping head.layernorm: treat the head's stream like any other (centre its
    # writers, RMSNorm) and the pooled output (= that stream) loses its mean, so the logits move
    adapter = get_adapter("siglip")

    def with_head(model):
        plan = adapter.plan(model)
        head = "vision_model.head"
        plan.streams[1].writers += [f"{head}.attention.out_proj", f"{head}.mlp.fc2"]
        plan.streams[1].norms.append(NormSite(f"{head}.layernorm", (f"{head}.mlp.fc1",)))
        plan.kept.clear()
        return plan

    model = make()
    conv, _ = normfold.convert(model, adapter=dataclasses.replace(adapter, plan=with_head), verify=False)
    inputs = {"input_ids": IDS, "pixel_values": PIX}
    ref, got = run_flat(model, inputs), run_flat(conv, inputs)
    assert rel_err(got["logits_per_image"], ref["logits_per_image"]) > 1e-3
    pooled = ref["vision_model_output.pooler_output"]
    assert rel_err(got["vision_model_output.pooler_output"] - got["vision_model_output.pooler_output"].mean(-1, True),
                   pooled - pooled.mean(-1, keepdim=True)) <= 1e-9  # only the mean was lost


def test_interpolated_positions_stay_exact():
    model = make(SiglipVisionModel)
    conv, _ = normfold.convert(model, verify=False)
    pix = torch.randn(2, 3, 24, 24, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    inputs = {"pixel_values": pix, "interpolate_pos_encoding": True}
    ref, got = run_flat(model, inputs), run_flat(conv, inputs)
    for k in ("pooler_output", "last_hidden_state"):
        assert rel_err(got[k], ref[k]) <= 1e-9, k


def test_fold_final():
    # with the pooling head (a MultiheadAttention reader) the vision final norm keeps its affine;
    # without it the classifier is its only reader and absorbs it; the text head always can
    model = make()
    conv, _ = normfold.convert(model, fold_final=True, verify=False)
    assert conv.vision_model.post_layernorm.weight is not None and conv.text_model.final_layer_norm.weight is None
    inputs = {"input_ids": IDS, "pixel_values": PIX}
    assert rel_err(run_flat(conv, inputs)["logits_per_text"], run_flat(model, inputs)["logits_per_text"]) <= 1e-9
    clf = make(SiglipForImageClassification, vision_use_head=False)
    conv, report = normfold.convert(clf, fold_final=True, verify=False)
    assert conv.vision_model.post_layernorm.weight is None and conv.vision_model.post_layernorm.bias is None
    assert report.kept == []
    x = {"pixel_values": PIX}
    assert rel_err(run_flat(conv, x)["logits"], run_flat(clf, x)["logits"]) <= 1e-9
