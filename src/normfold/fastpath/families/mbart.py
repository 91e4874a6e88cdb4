"""mBART (transformers 5's MBartEncoderLayer and MBartDecoderLayer, Pre-LN): see _encoder_decoder (every
add that a norm of the same layer reads, fused with that norm). BART itself is Post-LN (its adds feed
a LayerNorm that becomes the stream, converted by adapters/post_ln.py) and is not fused."""

from __future__ import annotations

from ..blocks import FusedBlock, register
from ._encoder_decoder import DECODER_PARAMETERS, ENCODER_PARAMETERS, decoder_forward, encoder_forward

_MODULE = "transformers.models.mbart.modeling_mbart"
register(FusedBlock("MBartEncoderLayer", _MODULE, ("final_layer_norm",), encoder_forward, ENCODER_PARAMETERS))
register(FusedBlock("MBartDecoderLayer", _MODULE, ("final_layer_norm",), decoder_forward, DECODER_PARAMETERS))
