"""Row-chunked centring: a tensor whose last axis is a writer's output axis (embedding tables, Conv1D weights)
centred in place a block of rows at a time through one reused float64 buffer, with the bits of one
whole-tensor `center` (each row's mean is its own). Both conversions use it: the in-memory one on a parameter
(`convert.center_writer_at`), the streamed one on rows read from the shards (`stream.compute`)."""

from __future__ import annotations

import torch

from .tensors import center_writer

# rows per chunk: about this many float64 bytes (float64 temporaries stay small and in cache)
CENTER_CHUNK_BYTES = 4 * 1024 * 1024


def row_chunks(n: int, rows: int) -> list[tuple[int, int]]:
    """[a, b) row ranges of about `rows` rows, none of exactly one row unless n == 1: torch reduces a single
    row (one output) by splitting it across threads, in another summation order than row by row."""
    rows = max(2, rows)
    bounds = [(a, min(a + rows, n)) for a in range(0, n, rows)]
    if len(bounds) > 1 and bounds[-1][1] - bounds[-1][0] == 1:
        bounds[-2:] = [(bounds[-2][0], n)]
    return bounds


def center_rows_in_place(flat: torch.Tensor, rows: int, scratch: dict | None = None) -> None:
    """Each row of the 2-D `flat` minus its mean, in place, in chunks of about `rows` rows through one reused
    float64 buffer: the values of `algebra.center(flat, -1)` (the same float64 copy, mean, subtraction and one
    rounding, `copy_` casting as `.to` does; each row's mean is its own), without a fresh float64 tensor, its
    centred copy and a rounded copy per chunk (three allocations and two more passes). `scratch`: where the
    buffer is kept from call to call."""
    if flat.dtype == torch.float64 or not flat.is_floating_point() or not flat.is_contiguous():
        for a, b in row_chunks(flat.shape[0], rows):
            flat[a:b] = center_writer_rows(flat[a:b])
        return
    bounds = row_chunks(flat.shape[0], rows)
    if not bounds:  # no rows
        return
    need = max(b - a for a, b in bounds) * flat.shape[1]
    scratch = {} if scratch is None else scratch
    buf = scratch.get("center64")
    if buf is None or buf.numel() < need:
        buf = scratch["center64"] = torch.empty(need, dtype=torch.float64)
    for a, b in bounds:
        t64 = buf[:(b - a) * flat.shape[1]].view(b - a, flat.shape[1]).copy_(flat[a:b])
        t64.sub_(t64.mean(dim=-1, keepdim=True))
        flat[a:b].copy_(t64)


def center_writer_rows(rows: torch.Tensor) -> torch.Tensor:
    return center_writer(rows, None, -1)[0]
