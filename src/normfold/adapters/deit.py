"""DeiT (transformers `DeiTModel` and its heads, the distilled classifier with teacher included).

The ViT layout (see `vit.py`) with one more stream writer, the distillation token, and two more
readers of the final norm: `cls_classifier` (on the cls token) and `distillation_classifier` (on
the distillation token) of `DeiTForImageClassificationWithTeacher`.
"""

from __future__ import annotations

from .base import TinyExample
from .vit import vit_like_adapter

_HEADS = ("DeiTModel", "DeiTForImageClassification", "DeiTForImageClassificationWithTeacher",
          "DeiTForMaskedImageModeling")

ADAPTER = vit_like_adapter(
    "deit", "DeiT", model_types=("deit",), tokens=("cls_token", "distillation_token"),
    heads=("classifier", "cls_classifier", "distillation_classifier"),
    examples=(
        TinyExample("rgb16-p4", "DeiTConfig",
                    dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                         image_size=16, patch_size=4, encoder_stride=4, num_labels=3, pooler_output_size=20),
                    _HEADS),
        TinyExample("gray8-p2-eps6", "DeiTConfig",
                    dict(hidden_size=24, num_hidden_layers=3, num_attention_heads=2, intermediate_size=48,
                         image_size=8, patch_size=2, num_channels=1, encoder_stride=2, layer_norm_eps=1e-6,
                         qkv_bias=False, num_labels=4),
                    ("DeiTForImageClassificationWithTeacher",)),
    ),
)
