"""SigLIP2 (transformers 5's Siglip2EncoderLayer, both towers, written as CLIP's): CLIP's fused forward, the
attention output's add fused with layer_norm2."""

from __future__ import annotations

from ..blocks import FusedBlock
from .clip import encoder_layer_forward

BLOCKS = (FusedBlock("Siglip2EncoderLayer", "transformers.models.siglip2.modeling_siglip2", ("layer_norm2",),
                     encoder_layer_forward, {"c90e00b5fe2da19f": "5.24.0"}),)
