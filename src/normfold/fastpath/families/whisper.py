"""Whisper (transformers 5's WhisperEncoderLayer and WhisperDecoderLayer): see _encoder_decoder (every add
that a norm of the same layer reads, fused with that norm)."""

from __future__ import annotations

from ..blocks import FusedBlock, register
from ._encoder_decoder import DECODER_PARAMETERS, ENCODER_PARAMETERS, decoder_forward, encoder_forward

_MODULE = "transformers.models.whisper.modeling_whisper"
register(FusedBlock("WhisperEncoderLayer", _MODULE, ("final_layer_norm",), encoder_forward, ENCODER_PARAMETERS))
register(FusedBlock("WhisperDecoderLayer", _MODULE, ("final_layer_norm",), decoder_forward, DECODER_PARAMETERS))
