"""The safetensors format, in one place: dtypes, the header's limits, one validated header reader.

Every reader of weights goes through `read_header` (the checkpoint guard before a model is built, the
streamed conversion's source, block-wise verification, `normfold.load`'s checks), and the writer
(`checkpoint.writer`) lays files out with the same dtype table and `numel`. The header is validated
against the file's size before any tensor is read: a truncated or hostile file ends in one
`CheckpointError` saying what to do."""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import CheckpointError

HEADER_LEN_BYTES = 8  # the little-endian u64 that precedes the JSON header
MAX_HEADER = 100 * 1024 * 1024  # safetensors' own limit for the JSON header
# bytes per element of every dtype the safetensors format defines
ITEMSIZE = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
            "U16": 2, "U32": 4, "U64": 8, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}
# the dtypes normfold reads into and writes from torch tensors
TORCH_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}
ST_DTYPES = {v: k for k, v in TORCH_DTYPES.items()}

WHAT_TO_DO = "re-download or re-export the checkpoint (e.g. save_pretrained with safetensors)"


def numel(shape) -> int:
    return math.prod(shape)


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of a safetensors file: its dtype, shape and absolute byte range in `file`."""

    file: Path
    dtype: str
    shape: tuple[int, ...]
    start: int  # absolute offset in the file
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start


def read_header(path: str | Path) -> tuple[dict[str, TensorInfo], dict]:
    """{name: TensorInfo} (file order of the header) and the __metadata__ of one safetensors file, the header
    validated against the file's size first: length field, JSON, every entry's dtype / shape / offsets, sizes,
    overlaps, and a data section the tensors cover exactly."""
    path = Path(path)
    size = path.stat().st_size
    where = f"{path}"
    if size < HEADER_LEN_BYTES:
        raise CheckpointError(f"{where} is {'empty' if size == 0 else f'only {size} bytes'}, not a safetensors "
                              f"file: {WHAT_TO_DO}")
    with open(path, "rb") as fh:
        (n,) = struct.unpack("<Q", fh.read(HEADER_LEN_BYTES))
        if n < 2 or n > min(size - HEADER_LEN_BYTES, MAX_HEADER):
            raise CheckpointError(f"{where}: corrupted safetensors header (its length field says {n} bytes, the "
                                  f"file has {size}); the file is truncated or not safetensors: {WHAT_TO_DO}")
        raw = fh.read(n)
    try:
        header = json.loads(raw)
        if not isinstance(header, dict):
            raise ValueError("the header is not a JSON object")
    except (ValueError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{where}: corrupted safetensors header (invalid JSON: {exc}): {WHAT_TO_DO}") from None
    base = HEADER_LEN_BYTES + n
    data_len = size - base
    meta = header.pop("__metadata__", None) or {}
    out, spans = {}, []
    for name, entry in header.items():
        try:
            dtype, shape, (begin, end) = entry["dtype"], [int(d) for d in entry["shape"]], entry["data_offsets"]
            begin, end = int(begin), int(end)
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"{where}: corrupted safetensors header (entry {name!r} lacks a valid dtype, "
                                  f"shape or data_offsets): {WHAT_TO_DO}") from None
        if dtype not in ITEMSIZE:
            raise CheckpointError(f"{where}: tensor {name!r} has unknown dtype {dtype!r}: {WHAT_TO_DO}")
        if any(d < 0 for d in shape) or not 0 <= begin <= end:
            raise CheckpointError(f"{where}: tensor {name!r} has a negative shape or offsets: {WHAT_TO_DO}")
        if end > data_len:
            raise CheckpointError(f"{where}: tensor {name!r} ends at byte {end} of a {data_len}-byte data section; "
                                  f"the file is truncated: {WHAT_TO_DO}")
        if end - begin != numel(shape) * ITEMSIZE[dtype]:
            raise CheckpointError(f"{where}: tensor {name!r} has {end - begin} bytes for shape {shape} in {dtype}: "
                                  f"corrupted header: {WHAT_TO_DO}")
        spans.append((begin, end, name))
        out[name] = TensorInfo(path, dtype, tuple(shape), base + begin, base + end)
    spans.sort()
    for (b0, e0, a), (b1, e1, b) in zip(spans, spans[1:]):
        if b1 < e0:
            raise CheckpointError(f"{where}: tensors {a!r} and {b!r} overlap in the file: corrupted header: "
                                  f"{WHAT_TO_DO}")
    if spans and spans[-1][1] != data_len:
        raise CheckpointError(f"{where}: the data section has {data_len} bytes but the tensors cover "
                              f"{spans[-1][1]}; the file is truncated or has trailing garbage: {WHAT_TO_DO}")
    return out, meta
