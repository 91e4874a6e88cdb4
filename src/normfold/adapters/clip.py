"""CLIP (transformers `CLIPTextModel`, `CLIPVisionModel`, their `*WithProjection` heads, `CLIPModel`).

Two independent streams, one per tower, found wherever the head class keeps them:

- text: x0 = token_embedding[ids] + position_embedding[pos]; Pre-LN blocks (layer_norm1 →
  self_attn.{q,k,v}_proj, layer_norm2 → mlp.fc1; writers self_attn.out_proj, mlp.fc2);
  `final_layer_norm` gives last_hidden_state, whose end-of-text row is read by `text_projection`.
- vision: x0 = [class_embedding; patch_embedding(pixels)] + position_embedding, then
  `pre_layrnorm` *on the stream*: its input is zero-mean once those writers are centred, so it
  becomes an RMSNorm, but its output γ⊙n + β (the stream the blocks add to) is not zero-mean for
  a learned γ. So an explicit Recenter follows it (`recenter_after`); a norm without γ needs only
  its β centred. Either way the checkpoint is stock-reloadable (stock LayerNorms re-centre their input,
  so a stock load needs no Recenter). The blocks are as in the text
  tower; there is no final norm on the stream: last_hidden_state *is* the raw stream (returned
  recentred: `centered_outputs`), and `post_layernorm` normalizes only the pooled class token
  (a row of the zero-mean stream, so exact), read by `visual_projection`.

`CLIPForImageClassification` is refused: its classifier averages the raw stream, so the stream's
per-token mean (which the conversion removes) reaches the logits.
"""

from __future__ import annotations

from torch import nn

from ..errors import UnsupportedConversionError
from ._inputs import image_text_inputs
from ._tower import embedding_norm_on_stream, expand_at, module_path
from .base import (
    Adapter,
    BlockTemplate,
    Capabilities,
    ConversionPlan,
    NormSite,
    StreamTemplate,
    TinyExample,
    exists,
    join,
)

CLIP_BLOCK = BlockTemplate(
    norms=(("layer_norm1", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
           ("layer_norm2", ("mlp.fc1",))),
    writers=("self_attn.out_proj", "mlp.fc2"),
)


TEXT_TOWER = StreamTemplate(
    name="text",
    sources=("embeddings.token_embedding", "embeddings.position_embedding"),
    layers="encoder.layers",
    block=CLIP_BLOCK,
)
VISION_TOWER = StreamTemplate(
    name="vision",
    sources=("embeddings.patch_embedding", "embeddings.class_embedding", "embeddings.position_embedding"),
    layers="encoder.layers",
    block=CLIP_BLOCK,
)


def _final(model: nn.Module, norm: str, *readers: str) -> NormSite:
    """A tower's last norm: its output leaves the model; `readers` that this head class has read it."""
    return NormSite(norm, tuple(r for r in readers if exists(model, r)), final=True)


def clip_plan(model: nn.Module) -> ConversionPlan:
    plan = ConversionPlan(adapter="clip")
    text = module_path(model, "CLIPTextModel")
    vision = module_path(model, "CLIPVisionModel")
    if text is not None:
        stream = expand_at(TEXT_TOWER, model, text)
        stream.norms.append(_final(model, join(text, "final_layer_norm"), "text_projection"))
        plan.streams.append(stream)
    if vision is not None:
        stream = expand_at(VISION_TOWER, model, vision)
        plan.notes.append(embedding_norm_on_stream(model, stream, join(vision, "pre_layrnorm")))
        stream.norms.append(_final(model, join(vision, "post_layernorm"), "visual_projection"))
        plan.streams.append(stream)
        # no final norm on the vision stream: its last_hidden_state is the (recentred) stream itself
        out = "vision_model_output.last_hidden_state" if text is not None else "last_hidden_state"
        plan.centered_outputs.append(out)
        plan.notes.append(f"{out} is the vision tower's raw residual stream (CLIP applies no final norm to "
                          "it): the converted model returns it recentred (per-token mean removed); every "
                          "norm, the pooled output and the embeddings are unchanged")
    return plan


def _check(model: nn.Module) -> None:
    if type(model).__name__ == "CLIPForImageClassification":
        raise UnsupportedConversionError(
            "CLIPForImageClassification's classifier reads the average of the vision tower's raw residual "
            "stream (CLIP has no final norm on it), so the per-token mean that the conversion removes would "
            "change its logits: it cannot be converted exactly. Convert the CLIPVisionModel (or CLIPModel) "
            "instead: their pooled outputs and embeddings are exact.")


_TEXT = dict(vocab_size=99, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
             max_position_embeddings=16, projection_dim=20, bos_token_id=0, eos_token_id=98, pad_token_id=1)
_VISION = dict(hidden_size=32, intermediate_size=40, num_hidden_layers=2, num_attention_heads=4, image_size=16,
               patch_size=4, projection_dim=20)

ADAPTER = Adapter(
    name="clip", display_name="CLIP",
    plan=clip_plan,
    model_types=("clip", "clip_text_model", "clip_vision_model"),
    check=_check,
    example_inputs=image_text_inputs,
    # the vision tower's Recenter after pre_layrnorm is for normfold's RMSNorms: a stock load needs none
    capabilities=Capabilities(variants=("rmsnorm",), stock_reloadable=True),
    examples=(
        TinyExample("text", "CLIPTextConfig", _TEXT, ("CLIPTextModel", "CLIPTextModelWithProjection")),
        TinyExample("vision", "CLIPVisionConfig", _VISION, ("CLIPVisionModel", "CLIPVisionModelWithProjection")),
        TinyExample("dual-eps6-eos2", "CLIPConfig",
                    dict(projection_dim=12,
                         text_config=dict(_TEXT, hidden_size=24, num_attention_heads=3, num_hidden_layers=3,
                                          layer_norm_eps=1e-6, eos_token_id=2, hidden_act="gelu"),
                         vision_config=dict(_VISION, hidden_size=16, num_attention_heads=2, image_size=12,
                                            num_channels=1, layer_norm_eps=1e-6)),
                    ("CLIPModel",)),
    ),
)
