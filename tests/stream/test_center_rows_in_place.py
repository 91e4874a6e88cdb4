"""stream.compute.center_rows_in_place (a streamed writer whose output axis is its last, centred in row chunks
through one reused float64 buffer): the bits of one whole-tensor `algebra.center`, whatever the chunk size (tiny
chunks, a last chunk that would be a single row), dtype and reuse of the buffer between tensors."""

from __future__ import annotations

import pytest
import torch

from normfold.algebra import center
from normfold.stream.compute import center_rows_in_place


@pytest.mark.parametrize("shape", [(7, 5), (64, 33), (3, 1), (1, 9), (11, 1600)])
@pytest.mark.parametrize("rows", [1, 2, 3, 6, 1000])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_same_bits_as_the_whole_tensor_centre(shape, rows, dtype):
    gen = torch.Generator().manual_seed(shape[0] * 31 + rows)
    x = (torch.randn(shape, generator=gen, dtype=torch.float64) * 3 + 0.7).to(dtype)
    want = center(x, -1)
    scratch: dict = {}
    got = x.clone()
    center_rows_in_place(got, rows, scratch)
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    again = x.clone()  # the buffer reused for a second tensor
    center_rows_in_place(again, rows, scratch)
    assert torch.equal(again.view(torch.uint8), want.view(torch.uint8))
