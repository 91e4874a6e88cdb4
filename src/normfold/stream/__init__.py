"""Streaming (shard-by-shard) conversion of safetensors checkpoints in bounded memory (issue 11)."""

from .convert import StreamUnsupportedError, stream_convert

__all__ = ["stream_convert", "StreamUnsupportedError"]
