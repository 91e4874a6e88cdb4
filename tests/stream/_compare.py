"""Helpers for the streaming tests: tiny checkpoints on disk, and tensor/header comparison of outputs."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import torch

from helpers import perturb_biases, perturb_norms


def make_checkpoint(example, head: str, path: Path, dtype=torch.float32, shard: str | None = None, seed: int = 0):
    torch.manual_seed(seed)
    model = example.build(head)
    perturb_norms(model, generator=torch.Generator().manual_seed(seed))
    perturb_biases(model, generator=torch.Generator().manual_seed(seed + 1))
    model = model.to(dtype)
    kwargs = {"max_shard_size": shard} if shard else {}
    model.save_pretrained(path, **kwargs)
    return path


def weight_files(d: Path) -> list[Path]:
    return sorted(p for p in Path(d).iterdir() if p.suffix == ".safetensors")


def header_and_data(path: Path) -> tuple[dict, bytes]:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8:8 + n]), raw[8 + n:]


def tensors_bytes(d: Path) -> dict[str, bytes]:
    """name -> (dtype, shape, raw bytes) over all weight files of a directory."""
    out = {}
    for f in weight_files(d):
        header, data = header_and_data(f)
        header.pop("__metadata__", None)
        for name, h in header.items():
            a, b = h["data_offsets"]
            out[name] = (h["dtype"], tuple(h["shape"]), data[a:b])
    return out
