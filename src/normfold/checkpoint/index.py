"""The weight files of a model directory, from its shard index or its single file, each name checked once
here by the path policy (`ModelDir`): every command that reads weights (in-memory and streamed conversion,
both verification modes, `load`, `analyze`) gets its file list from `weight_files`."""

from __future__ import annotations

import json
from pathlib import Path

from ..errors import CheckpointError, UnsafePathError
from .paths import ModelDir, plain_name

_WHAT_TO_DO = "re-download or re-export the checkpoint (e.g. save_pretrained with safetensors)"


def read_weight_map(directory: ModelDir, index_name: str) -> dict[str, str]:
    """{tensor: shard file name} of a shard index, every shard name checked (plain name, inside the
    directory, a regular file)."""
    index = directory.file(index_name)
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
        if not isinstance(weight_map, dict):
            raise TypeError("'weight_map' is not an object")
    except (ValueError, KeyError, TypeError, AttributeError, UnicodeDecodeError, RecursionError) as exc:
        raise CheckpointError(f"{index} is not a valid shard index (JSON with a 'weight_map' of tensor -> file): "
                              f"{exc}; {_WHAT_TO_DO}") from None
    for tensor, name in weight_map.items():
        if not plain_name(name):
            raise UnsafePathError(f"{index} names the shard {name!r} (for {tensor!r}), which is not a file name inside "
                                  f"{directory.path}; refusing to read outside the model directory")
    for name in sorted(set(weight_map.values())):
        directory.file(name, where=str(index))
    return weight_map


def weight_files(directory: ModelDir | str, index_name: str, single_name: str) -> tuple[list[Path], bool] | None:
    """(files in name order, sharded?) from `index_name` if present, else `single_name`; None if neither."""
    d = directory if isinstance(directory, ModelDir) else ModelDir(directory)
    if d.exists(index_name):
        names = sorted(set(read_weight_map(d, index_name).values()))
        return [d.path / n for n in names], True
    if d.exists(single_name):
        return [d.file(single_name)], False
    return None
