"""Writing safetensors files with their SHA-256 computed as the bytes go out (no second read).

The header is laid out as safetensors' own serializer lays it out (tensors ordered by dtype, largest
first, then by name; JSON without spaces; padded with spaces to 8 bytes), so `save_safetensors` writes
the same bytes as `safetensors.torch.save_file` of the same tensors (tests/test_checkpoint_writer.py),
and the streamed conversion (normfold.stream) writes its files with the same `layout`.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import torch

from .digest import HashingSink
from .safetensors_format import ST_DTYPES, TORCH_DTYPES, numel

# safetensors' Rust `Dtype` declaration order; files list tensors by descending rank, then by name.
_RANK = {name: i for i, name in enumerate(
    ["BOOL", "F4", "F6_E2M3", "F6_E3M2", "U8", "I8", "F8_E5M2", "F8_E4M3", "F8_E8M0", "I16", "U16", "F16",
     "BF16", "I32", "U32", "F32", "F64", "I64", "U64"])}
CHUNK = 8 * 1024 * 1024


def layout(entries: dict[str, tuple[str, tuple[int, ...]]], metadata: dict[str, str]) -> tuple[bytes, list]:
    """(header bytes incl. the length prefix, [(name, offset, nbytes)] in file order) for tensors
    {name: (st dtype, shape)}, ordered and padded as safetensors' serializer does."""
    order = sorted(entries, key=lambda k: (-_RANK[entries[k][0]], k))
    header: dict = {"__metadata__": dict(sorted(metadata.items()))} if metadata else {}
    placed, offset = [], 0
    for name in order:
        dtype, shape = entries[name]
        n = numel(shape) * torch.empty((), dtype=TORCH_DTYPES[dtype]).element_size()
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + n]}
        placed.append((name, offset, n))
        offset += n
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * ((8 - len(text) % 8) % 8)
    return struct.pack("<Q", len(text)) + text, placed


def write_all(fd, data, offset: int) -> None:
    """pwrite all of `data` at `offset`; `fd` is a file descriptor or a `HashingSink` (which hashes the
    bytes as they are written)."""
    view = memoryview(data).cast("B")
    sink = None
    if not isinstance(fd, int):
        sink, fd = fd, fd.fd
    done = 0
    while done < len(view):
        done += os.pwrite(fd, view[done:done + CHUNK], offset + done)
    if sink is not None:
        sink.seen(view, offset)


def can_write(tensors: dict[str, torch.Tensor]) -> bool:
    """Whether every tensor's dtype is one `save_safetensors` writes (else use safetensors' save_file)."""
    return all(t.dtype in ST_DTYPES for t in tensors.values())


def save_safetensors(tensors: dict[str, torch.Tensor], path: str | os.PathLike, metadata: dict[str, str]) -> dict:
    """Write `tensors` (CPU, no shared storage) as a safetensors file at `path` (which must not exist) and
    return {"sha256", "bytes"} of what was written, hashed on the way out."""
    path = Path(path)
    header, placed = layout({k: (ST_DTYPES[t.dtype], tuple(t.shape)) for k, t in tensors.items()}, metadata)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        sink = HashingSink(fd, path)
        write_all(sink, header, 0)
        base = len(header)
        for name, offset, nbytes in placed:
            if nbytes:
                t = tensors[name].detach().contiguous()
                write_all(sink, t.reshape(-1).view(torch.uint8).numpy(), base + offset)
        return {"sha256": sink.hexdigest(), "bytes": os.fstat(fd).st_size}
    finally:
        os.close(fd)
