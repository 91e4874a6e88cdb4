"""algebra.reused_buffers (the streamed conversion's reused float64 temporaries) gives the same bytes as fresh
temporaries, and stream.safetensors_io.Slabs recycles a buffer only once nothing uses it."""

import torch

from normfold.algebra import compress_reader, fold_affine, reused_buffers
from normfold.stream.safetensors_io import Slabs


def test_fold_and_compress_are_bitwise_the_same_with_reused_buffers():
    g = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        bufs: dict = {}
        for shape, in_dim in (((48, 32), 0), ((32, 48), 1), ((64, 32), 0)):
            w = torch.randn(shape, generator=g).to(dtype)
            n = shape[in_dim]
            b = torch.randn(shape[1 - in_dim], generator=g).to(dtype)
            gamma, beta = torch.randn(n, generator=g).to(dtype), torch.randn(n, generator=g).to(dtype)
            want = fold_affine(w, b, gamma, beta, in_dim)
            want_c = compress_reader(w, in_dim)
            with reused_buffers(bufs):
                got = fold_affine(w, b, gamma, beta, in_dim)
                got = (got[0].clone(), got[1])
                got_c = compress_reader(w, in_dim).clone()
            assert torch.equal(got[0].view(torch.uint8 if dtype != torch.float32 else torch.int32),
                               want[0].view(torch.uint8 if dtype != torch.float32 else torch.int32))
            assert torch.equal(got[1], want[1])
            assert got_c.shape == want_c.shape and torch.equal(got_c, want_c)
        assert bufs  # the buffers were kept for the next call


def test_slabs_recycle_only_unused_buffers():
    slabs = Slabs(budget=1 << 20, largest=1 << 16)
    a = slabs.take(1024).view(torch.float32)
    a_ptr = a.data_ptr()
    b = slabs.take(1024)
    assert b.data_ptr() != a_ptr  # `a` is still in use
    del a
    c = slabs.take(1024)
    assert c.data_ptr() == a_ptr  # freed: recycled
    big = slabs.take(1 << 17)  # above `largest`: a plain allocation, not held
    assert slabs.held == 2048 and big.numel() == 1 << 17
    del b, c
    slabs.drop_free()
    assert slabs.held == 0
