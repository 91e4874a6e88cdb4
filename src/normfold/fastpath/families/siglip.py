"""SigLIP (transformers 5's SiglipEncoderLayer, both towers, written as CLIP's): CLIP's fused forward, the
attention output's add fused with layer_norm2."""

from __future__ import annotations

from ..blocks import FusedBlock
from .clip import encoder_layer_forward

BLOCKS = (FusedBlock("SiglipEncoderLayer", "transformers.models.siglip.modeling_siglip", ("layer_norm2",),
                     encoder_layer_forward, {"c90e00b5fe2da19f": "5.24.0"}),)
