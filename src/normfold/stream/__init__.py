"""Checkpoints larger than memory: streaming (shard-by-shard) conversion of safetensors
checkpoints and block-wise verification, both in bounded memory."""

from .executor import StreamUnsupportedError, stream_convert

__all__ = ["stream_convert", "StreamUnsupportedError"]
