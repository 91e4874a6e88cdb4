"""fold_affine folds a float32 γ into a float32 reader in float32 (one correctly rounded multiplication: the
product of two float32 numbers is exact in float64). Its bits must be those of the float64 product rounded once,
the formula it replaced, here recomputed independently, on values that test the rounding: subnormal results,
products that overflow, signed zeros, with and without β, a bias, the reused buffers, both reader layouts."""

from __future__ import annotations

import pytest
import torch

from normfold.algebra import reused_buffers
from normfold.algebra.tensors import fold_affine


def _reference(w, b, g, beta, in_dim):
    w64 = w.double()
    new_b = None
    if beta is not None:
        shift = torch.tensordot(w64, beta.double(), dims=([in_dim], [0]))
        new_b = (shift if b is None else b.double() + shift).to(b.dtype if b is not None else w.dtype)
    elif b is not None:
        new_b = b.clone()
    if g is not None:
        shape = [1, 1]
        shape[in_dim] = -1
        w64 = w64 * g.double().reshape(shape)
    return w64.to(w.dtype), new_b


def _hard_values(shape, seed):
    gen = torch.Generator().manual_seed(seed)
    t = torch.randn(shape, generator=gen) * torch.exp2(torch.randint(-140, 120, shape, generator=gen).float())
    edge = torch.tensor([1e-40, -1e-42, 3e38, -3e38, 0.0, -0.0, 1.17549435e-38, 7e-39, 2.5e-45, 1.0])
    t.view(-1)[:edge.numel()] = edge
    return t


@pytest.mark.parametrize("in_dim", [0, 1])
@pytest.mark.parametrize("with_beta", [False, True])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("reuse", [False, True])
def test_float32_gamma_fold_has_the_bits_of_the_float64_product(in_dim, with_beta, with_bias, reuse):
    w = _hard_values((37, 29), 0)
    n_in, n_out = w.shape[in_dim], w.shape[1 - in_dim]
    g = _hard_values((n_in,), 1)
    beta = torch.randn(n_in) if with_beta else None
    bias = torch.randn(n_out) if with_bias else None
    want_w, want_b = _reference(w, bias, g, beta, in_dim)
    if reuse:
        with reused_buffers({}):
            got_w, got_b = fold_affine(w, bias, g, beta, in_dim)
            got_w = got_w.clone()
    else:
        got_w, got_b = fold_affine(w, bias, g, beta, in_dim)
    assert torch.isinf(want_w).any() and (want_w.abs() < 1.17549435e-38).logical_and(want_w != 0).any()
    assert torch.equal(got_w.view(torch.int32), want_w.view(torch.int32))
    assert (got_b is None) == (want_b is None)
    if want_b is not None:
        assert torch.equal(got_b, want_b)


@pytest.mark.parametrize("dtypes", [(torch.float32, torch.float64), (torch.bfloat16, torch.bfloat16),
                                    (torch.float64, torch.float64)])
def test_other_dtypes_keep_the_float64_fold(dtypes):
    wd, gd = dtypes
    w = torch.randn(16, 12).to(wd)
    g = torch.randn(12).to(gd)
    beta = torch.randn(12).to(gd)
    got_w, got_b = fold_affine(w, None, g, beta, 1)
    want_w, want_b = _reference(w, None, g, beta, 1)
    assert got_w.dtype == wd and torch.equal(got_w, want_w) and torch.equal(got_b, want_b)


def test_neither_gamma_nor_beta_returns_the_weight_unchanged():
    w = torch.randn(5, 4)
    got_w, got_b = fold_affine(w, None, None, None, 1)
    assert torch.equal(got_w, w) and got_w.data_ptr() != w.data_ptr() and got_b is None
