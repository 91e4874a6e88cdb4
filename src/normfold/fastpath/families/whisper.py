"""Whisper (transformers 5's WhisperEncoderLayer and WhisperDecoderLayer): see _encoder_decoder (every add
that a norm of the same layer reads, fused with that norm)."""

from __future__ import annotations

from ..blocks import FusedBlock
from ._encoder_decoder import decoder_forward, encoder_forward

_MODULE = "transformers.models.whisper.modeling_whisper"
BLOCKS = (
    FusedBlock("WhisperEncoderLayer", _MODULE, ("final_layer_norm",), encoder_forward,
               {"884830be28cb4818": "5.24.0"}),
    FusedBlock("WhisperDecoderLayer", _MODULE, ("final_layer_norm",), decoder_forward,
               {"8c97f8a5a3daa72e": "5.24.0"}),
)
