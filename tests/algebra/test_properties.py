"""Property-based checks of the algebra (hypothesis): for any shapes and any values, including
huge common offsets and outlier coordinates, the rewritten layer computes the identity it claims."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from normfold import algebra
from normfold.ops import reference as R

D = torch.float64
dims = st.integers(min_value=2, max_value=40)
seeds = st.integers(min_value=0, max_value=2**31 - 1)
offsets = st.floats(min_value=-1e4, max_value=1e4, allow_nan=False)


def _rand(shape, seed, offset=0.0, outlier=0.0):
    g = torch.Generator().manual_seed(seed)
    t = torch.randn(shape, generator=g, dtype=D) + offset
    t[..., 0] += outlier
    return t


@settings(max_examples=60, deadline=None)
@given(n_in=dims, n_out=dims, seed=seeds, offset=offsets, outlier=offsets)
def test_centred_writer_output_is_the_centred_output(n_in, n_out, seed, offset, outlier):
    w = _rand((n_out, n_in), seed, offset, outlier)
    b = _rand((n_out,), seed + 1, offset)
    x = _rand((5, n_in), seed + 2, offset, outlier)
    new_w, new_b = algebra.center_writer(w, b, out_dim=0)
    y = x @ w.T + b
    y_new = x @ new_w.T + new_b
    scale = (x.abs() @ w.abs().T + b.abs()).max()  # the size of the terms being cancelled
    assert (y_new - (y - y.mean(-1, keepdim=True))).abs().max() <= 1e-12 * scale


@settings(max_examples=60, deadline=None)
@given(d=dims, m=dims, seed=seeds, offset=offsets, eps=st.sampled_from([1e-5, 1e-6, 1e-12]))
def test_layernorm_then_linear_equals_rmsnorm_then_folded_linear(d, m, seed, offset, eps):
    x = _rand((4, d), seed, offset)
    gamma, beta = _rand((d,), seed + 1), _rand((d,), seed + 2)
    w, b = _rand((m, d), seed + 3), _rand((m,), seed + 4)
    want = R.layer_norm(x, gamma, beta, eps) @ w.T + b
    new_w, new_b = algebra.fold_affine(w, b, gamma, beta, in_dim=1)
    got = R.rms_norm(x - x.mean(-1, keepdim=True), None, None, eps) @ new_w.T + new_b
    assert (got - want).abs().max() <= 1e-10 * (1 + want.abs().max())


@settings(max_examples=40, deadline=None)
@given(d=dims, m=dims, seed=seeds)
def test_compressed_reader_sees_the_same_input(d, m, seed):
    x = _rand((3, d), seed)
    x = x - x.mean(-1, keepdim=True)
    w = _rand((m, d), seed + 1)
    cw = algebra.compress_reader(w, in_dim=1)
    assert torch.allclose(x[:, :-1] @ cw.T, x @ w.T, atol=1e-11, rtol=0)
