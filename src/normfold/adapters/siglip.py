"""SigLIP (transformers `SiglipTextModel`, `SiglipVisionModel`, `SiglipModel`,
`SiglipForImageClassification`).

The CLIP layout (see `clip.py`: same block module names) with three differences:

- the vision stream is x0 = patch_embedding(pixels) + position_embedding, with no class token and
  no norm before the blocks, so no Recenter is needed and checkpoints stay stock-reloadable;
- both towers end in a final norm over every token (`post_layernorm`, `final_layer_norm`) whose
  output is last_hidden_state; the text `head` (a Linear on the last token) reads it;
- the vision tower's multihead-attention-pooling head (`head`, when `vision_use_head`) has its own
  small residual stream: h = attention(probe, x, x); h + mlp(layernorm(h)); pooled = h[:, 0].
  That stream *is* the pooled output (the image embedding whose direction the contrastive logits
  use), so it cannot be recentred, and `head.layernorm` stays a LayerNorm. It runs on one probe
  token per image: keeping it costs nothing measurable.
"""

from __future__ import annotations

from torch import nn

from ._inputs import image_text_inputs
from ._tower import expand_at, module_path, present
from .base import Adapter, Capabilities, ConversionPlan, KeptNorm, NormSite, StreamTemplate, TinyExample, join
from .clip import CLIP_BLOCK, TEXT_TOWER

VISION_TOWER = StreamTemplate(
    name="vision",
    sources=("embeddings.patch_embedding", "embeddings.position_embedding"),
    layers="encoder.layers",
    block=CLIP_BLOCK,
)

MAP_HEAD_REASON = ("the attention-pooling head's residual stream is the pooled output itself (the image "
                   "embedding), so it cannot be recentred without changing that output; it runs on a single "
                   "probe token per image, so keeping this LayerNorm costs nothing measurable")


def siglip_like_plan(adapter: str, text_cls: str, vision_cls: str, vision_tower: StreamTemplate,
                     recenter_vision: str | None = None):
    """The plan function for SigLIP-style models. SigLIP 2 reuses it with its own vision tower and
    `recenter_vision`: a note saying why its vision stream is recentred before the first layer."""

    def plan_of(model: nn.Module) -> ConversionPlan:
        plan = ConversionPlan(adapter=adapter)
        text = module_path(model, text_cls)
        vision = module_path(model, vision_cls)
        if text is not None:
            stream = expand_at(TEXT_TOWER, model, text)
            stream.norms.append(NormSite(join(text, "final_layer_norm"), (join(text, "head"),), final=True))
            plan.streams.append(stream)
        if vision is not None:
            stream = expand_at(vision_tower, model, vision)
            head = join(vision, "head")
            # every reader of post_layernorm: the pooling head's attention (not a foldable Linear: the
            # affine then stays in the norm even with fold_final) and the classification head
            readers = tuple(r for r in (join(head, "attention"), "classifier") if present(model, r))
            stream.norms.append(NormSite(join(vision, "post_layernorm"), readers, final=True))
            plan.streams.append(stream)
            if recenter_vision:
                stream.recenter_before.append(join(vision, vision_tower.layers, "0"))
                plan.notes.append(recenter_vision)
            if present(model, head):
                plan.kept.append(KeptNorm(join(head, "layernorm"), MAP_HEAD_REASON, on_stream=False))
        return plan

    return plan_of


siglip_plan = siglip_like_plan("siglip", "SiglipTextModel", "SiglipVisionModel", VISION_TOWER)


_TEXT = dict(vocab_size=99, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
             max_position_embeddings=16, projection_size=20, bos_token_id=0, eos_token_id=98, pad_token_id=1)
_VISION = dict(hidden_size=32, intermediate_size=40, num_hidden_layers=2, num_attention_heads=4, image_size=16,
               patch_size=4)

ADAPTER = Adapter(
    name="siglip", display_name="SigLIP",
    plan=siglip_plan,
    model_types=("siglip", "siglip_text_model", "siglip_vision_model"),
    example_inputs=image_text_inputs,
    capabilities=Capabilities(variants=("rmsnorm",)),
    examples=(
        TinyExample("text", "SiglipTextConfig", _TEXT, ("SiglipTextModel",)),
        TinyExample("vision-map-head", "SiglipVisionConfig", _VISION, ("SiglipVisionModel",)),
        TinyExample("vision-no-head-eps5", "SiglipVisionConfig",
                    dict(_VISION, hidden_size=24, num_attention_heads=3, num_hidden_layers=3, vision_use_head=False,
                         layer_norm_eps=1e-5, num_channels=1, image_size=12),
                    ("SiglipVisionModel",)),
        TinyExample("dual", "SiglipConfig",
                    dict(text_config=dict(_TEXT, hidden_size=24, num_attention_heads=3, projection_size=24),
                         vision_config=dict(_VISION, hidden_size=24, num_attention_heads=2), num_labels=3),
                    ("SiglipModel", "SiglipForImageClassification")),
    ),
)
