"""mBART (transformers 5's MBartEncoderLayer and MBartDecoderLayer, Pre-LN): see _encoder_decoder (every
add that a norm of the same layer reads, fused with that norm). BART itself is Post-LN (its adds feed
a LayerNorm that becomes the stream, converted by adapters/post_ln.py) and is not fused."""

from __future__ import annotations

from ..blocks import FusedBlock
from ._encoder_decoder import decoder_forward, encoder_forward

_MODULE = "transformers.models.mbart.modeling_mbart"
BLOCKS = (
    FusedBlock("MBartEncoderLayer", _MODULE, ("final_layer_norm",), encoder_forward,
               {"884830be28cb4818": "5.24.0"}),
    # 5.25 only added expose_in_signature=True to the forward's deprecate_kwarg: decoder_forward mirrors it
    FusedBlock("MBartDecoderLayer", _MODULE, ("final_layer_norm",), decoder_forward,
               {"d99b6c3af2942f5a": "5.24.0", "57f4f52091f4d2fb": "5.25.0"}),
)
