"""Reading model directories safely: one path policy (`ModelDir`) and one shard-index reader
(`weight_files`) for every command that reads a checkpoint, and SHA-256 digests of weight files
(`file_digest`, `HashingWriter`) for tamper evidence."""

from .digest import HashingSink, check_digests, file_digest
from .index import read_weight_map, weight_files
from .paths import AUXILIARY, ModelDir, hf_cache_blobs, plain_name

__all__ = ["AUXILIARY", "HashingSink", "check_digests", "file_digest", "ModelDir", "hf_cache_blobs", "plain_name", "read_weight_map", "weight_files"]
