"""SigLIP 2 (transformers `Siglip2TextModel`, `Siglip2VisionModel`, `Siglip2Model`,
`Siglip2ForImageClassification`).

The SigLIP layout (see `siglip.py`; the attention-pooling head's LayerNorm is kept for the same
reason) with a NaFlex vision stem: pre-patchified pixels go through a Linear `patch_embedding`, and
the position table is resized per image (`spatial_shapes`) and padded. transformers does that
resize in float32 on CPU whatever the model's dtype, so a centred table would be zero-mean only to
float32 rounding, and its rounding would differ from the original's: float64 verification sees
~1e-7 (measured). So the vision stream is recentred explicitly on the input of
`encoder.layers.0` (as Whisper's stem) and the stem is left untouched: exact in every dtype, and still
stock-reloadable (stock LayerNorms re-centre their input, so a stock load needs no Recenter). The text tower is SigLIP's.
"""

from __future__ import annotations

import inspect

import torch
from torch import nn

from ._inputs import BATCH, sub_config, text_ids
from .base import Adapter, Capabilities, StreamTemplate, TinyExample
from .clip import CLIP_BLOCK
from .siglip import siglip_like_plan

VISION_TOWER = StreamTemplate(
    name="vision",
    sources=(),  # Linear patches + float32-resized positions: recentred before layers.0 instead
    layers="encoder.layers",
    block=CLIP_BLOCK,
)
_VISION_NOTE = ("the vision embeddings (Linear patches + a position table that transformers resizes in "
                "float32 on CPU) are recentred explicitly on the input of the vision tower's first encoder "
                "layer, which keeps the conversion exact in every dtype (stock transformers, whose LayerNorms "
                "re-centre their input, needs no Recenter and reloads the checkpoint)")


PLAN = siglip_like_plan("siglip2", "Siglip2TextModel", "Siglip2VisionModel", VISION_TOWER, _VISION_NOTE)


def siglip2_inputs(model: nn.Module, generator: torch.Generator) -> dict:
    """Patchified pixels for two images of different grids (the second padded), plus token ids."""
    params = inspect.signature(model.forward).parameters
    inputs = {}
    if "input_ids" in params:
        inputs["input_ids"] = text_ids(model, generator)
    if "pixel_values" in params:
        cfg = sub_config(model, "vision_config")
        n, side = cfg.num_patches, int(cfg.num_patches ** 0.5)
        shapes = torch.tensor([[side, side], [side // 2, side + side // 2]])  # second: fewer patches, padded
        mask = torch.zeros(BATCH, n, dtype=torch.long)
        for i, (h, w) in enumerate(shapes.tolist()):
            mask[i, : h * w] = 1
        inputs["pixel_values"] = torch.randn(BATCH, n, cfg.num_channels * cfg.patch_size ** 2, generator=generator)
        inputs["pixel_attention_mask"] = mask
        inputs["spatial_shapes"] = shapes
    return inputs


_TEXT = dict(vocab_size=99, hidden_size=24, intermediate_size=48, num_hidden_layers=2, num_attention_heads=3,
             max_position_embeddings=16, projection_size=24, bos_token_id=0, eos_token_id=98, pad_token_id=1)
_VISION = dict(hidden_size=24, intermediate_size=40, num_hidden_layers=2, num_attention_heads=2, num_patches=16,
               patch_size=4)

ADAPTER = Adapter(
    name="siglip2", display_name="SigLIP 2",
    plan=PLAN,
    model_types=("siglip2", "siglip2_text_model", "siglip2_vision_model"),
    example_inputs=siglip2_inputs,
    # the vision tower's Recenter is for normfold's RMSNorms: a stock load needs none
    capabilities=Capabilities(variants=("rmsnorm",), stock_reloadable=True),
    examples=(
        TinyExample("text", "Siglip2TextConfig", _TEXT, ("Siglip2TextModel",)),
        TinyExample("vision-map-head", "Siglip2VisionConfig", dict(_VISION, hidden_size=32, num_attention_heads=4),
                    ("Siglip2VisionModel",)),
        TinyExample("dual-eps5", "Siglip2Config",
                    dict(text_config=dict(_TEXT, layer_norm_eps=1e-5), vision_config=dict(_VISION, num_channels=1),
                         num_labels=3),
                    ("Siglip2Model", "Siglip2ForImageClassification")),
    ),
)
