"""CLIP: the two towers, pre_layrnorm on the vision stream (RMSNorm + explicit Recenter, or a
centred bias when it has no weight), the raw-stream last_hidden_state, the refused
CLIPForImageClassification, fold_final into the projections."""

import dataclasses

import pytest
import torch

import normfold
from helpers import realistic, rel_err, run_flat
from normfold.adapters import get_adapter
from normfold.errors import UnsupportedConversionError
from normfold.nn import RMSNorm
from normfold.nn.hooks import has_output_recenter

transformers = pytest.importorskip("transformers")
from transformers import (  # noqa: E402
    CLIPConfig,
    CLIPForImageClassification,
    CLIPModel,
    CLIPVisionConfig,
    CLIPVisionModel,
)

TEXT = dict(vocab_size=99, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
            max_position_embeddings=16, projection_dim=20, bos_token_id=0, eos_token_id=98, pad_token_id=1)
VISION = dict(hidden_size=24, intermediate_size=40, num_hidden_layers=2, num_attention_heads=3, image_size=16,
              patch_size=4, projection_dim=20)
G = torch.Generator().manual_seed(7)
IDS = torch.cat([torch.randint(3, 98, (2, 6), generator=G), torch.full((2, 1), 98)], 1)
PIX = torch.randn(2, 3, 16, 16, generator=G, dtype=torch.float64)


def offsets(model):
    """Large common offsets on the vision writers that are plain parameters / bias-free convs."""
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for m in model.modules():
            if type(m).__name__ == "CLIPVisionEmbeddings":
                m.class_embedding.add_(4.0)
                m.patch_embedding.weight.add_(torch.randn(1, *m.patch_embedding.weight.shape[1:], generator=g,
                                                          dtype=m.patch_embedding.weight.dtype))
    return model


def make(cls=CLIPModel, dtype=torch.float64):
    torch.manual_seed(0)
    cfg = CLIPConfig(projection_dim=20, text_config=TEXT, vision_config=VISION) if cls is CLIPModel \
        else CLIPVisionConfig(**VISION)
    return offsets(realistic(cls(cfg).eval().to(dtype)))


def test_structure_of_a_converted_clip_model():
    model = make()
    conv, report = normfold.convert(model, verify=False)
    v, t = conv.vision_model, conv.text_model
    assert not any(isinstance(m, torch.nn.LayerNorm) for m in conv.modules()) and report.kept == []
    # pre_layrnorm: an RMSNorm keeping its affine (its output is the stream), followed by a Recenter
    assert isinstance(v.pre_layrnorm, RMSNorm) and v.pre_layrnorm.weight is not None and v.pre_layrnorm.bias is not None
    assert has_output_recenter(v.pre_layrnorm) and report.structure.recenter_after == ["vision_model.pre_layrnorm"]
    assert report.stock_reloadable and any("pre_layrnorm" in n for n in report.notes)  # stock LN re-centres
    # block norms folded into q/k/v and fc1; the final norms keep their affine (their outputs leave the model)
    for tower in (v, t):
        assert tower.encoder.layers[1].layer_norm1.weight is None and tower.encoder.layers[1].layer_norm2.bias is None
    assert v.post_layernorm.weight is not None and t.final_layer_norm.weight is not None
    assert "vision_model_output.last_hidden_state" in report.centered_outputs
    assert {"vision_model.embeddings.class_embedding", "vision_model.embeddings.patch_embedding",
            "text_model.embeddings.token_embedding"} <= set(report.centered)
    with torch.no_grad():
        out = conv(input_ids=IDS, pixel_values=PIX, output_hidden_states=True)
    for h in out.vision_model_output.hidden_states + (out.vision_model_output.last_hidden_state,):
        assert h.mean(-1).abs().max() <= 1e-12 * h.abs().max()  # the vision stream is zero-mean throughout


def test_embeddings_and_logits_are_exact():
    model = make()
    conv, _ = normfold.convert(model, verify=False)
    inputs = {"input_ids": IDS, "pixel_values": PIX}
    ref, got = run_flat(model, inputs), run_flat(conv, inputs)
    for k in ("logits_per_image", "logits_per_text", "text_embeds", "image_embeds",
              "text_model_output.last_hidden_state", "vision_model_output.pooler_output"):
        assert rel_err(got[k], ref[k]) <= 1e-9, k
    # last_hidden_state of the vision tower is the raw stream: equal up to each token's mean only
    a, b = got["vision_model_output.last_hidden_state"], ref["vision_model_output.last_hidden_state"]
    assert rel_err(a - a.mean(-1, keepdim=True), b - b.mean(-1, keepdim=True)) <= 1e-9
    assert rel_err(a, b) > 1e-3


def test_without_the_recenter_the_vision_tower_is_not_exact():
    adapter = get_adapter("clip")

    def no_recenter(model):
        plan = adapter.plan(model)
        for s in plan.streams:
            s.recenter_after.clear()
        return plan

    model = make(CLIPVisionModel)
    conv, _ = normfold.convert(model, adapter=dataclasses.replace(adapter, plan=no_recenter), verify=False)
    assert rel_err(run_flat(conv, {"pixel_values": PIX})["pooler_output"],
                   run_flat(model, {"pixel_values": PIX})["pooler_output"]) > 1e-4


def test_pre_layrnorm_without_weight_needs_no_recenter_and_reloads_in_stock_transformers(tmp_path):
    model = make(CLIPVisionModel)
    model.pre_layrnorm.register_parameter("weight", None)  # n + β: zero-mean once β is centred
    conv, report = normfold.convert(model, verify=False)
    assert report.structure.recenter_after == [] and report.stock_reloadable
    assert "pre_layrnorm.bias" in report.centered and abs(float(conv.pre_layrnorm.bias.detach().mean())) <= 1e-12
    ref = run_flat(model, {"pixel_values": PIX})
    assert rel_err(run_flat(conv, {"pixel_values": PIX})["pooler_output"], ref["pooler_output"]) <= 1e-9
    normfold.save(conv, report, tmp_path / "out")
    stock = CLIPVisionModel.from_pretrained(tmp_path / "out").eval()  # pre_layrnorm.weight: initialised to 1
    assert isinstance(stock.pre_layrnorm, torch.nn.LayerNorm)
    assert rel_err(run_flat(stock, {"pixel_values": PIX})["pooler_output"], ref["pooler_output"]) <= 1e-9


def test_interpolated_positions_stay_exact():
    model = make(CLIPVisionModel)
    conv, _ = normfold.convert(model, verify=False)
    pix = torch.randn(2, 3, 24, 24, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    inputs = {"pixel_values": pix, "interpolate_pos_encoding": True}
    assert rel_err(run_flat(conv, inputs)["pooler_output"], run_flat(model, inputs)["pooler_output"]) <= 1e-9


def test_fold_final_into_the_projections():
    model = make()
    conv, report = normfold.convert(model, fold_final=True, allow_new_bias=True, verify=False)
    assert conv.vision_model.post_layernorm.weight is None and conv.text_model.final_layer_norm.bias is None
    assert conv.visual_projection.bias is not None and conv.text_projection.bias is not None
    inputs = {"input_ids": IDS, "pixel_values": PIX}
    ref, got = run_flat(model, inputs), run_flat(conv, inputs)
    for k in ("logits_per_image", "text_embeds", "image_embeds"):
        assert rel_err(got[k], ref[k]) <= 1e-9, k


def test_image_classification_head_is_refused_with_the_reason(tmp_path, capsys):
    model = CLIPForImageClassification(CLIPConfig(text_config=TEXT, vision_config=VISION, num_labels=3)).eval()
    with pytest.raises(UnsupportedConversionError, match="raw residual.*CLIPVisionModel"):
        normfold.convert(model)
    from normfold.cli import main

    model.save_pretrained(tmp_path / "src")
    assert main(["convert", str(tmp_path / "src"), "--out", str(tmp_path / "out"), "-q"]) == 2
    assert "CLIPForImageClassification" in capsys.readouterr().err and not (tmp_path / "out").exists()
