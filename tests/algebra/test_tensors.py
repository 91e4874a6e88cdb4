"""Weight algebra against float64 brute force: every identity checked on random (and adversarial)
inputs by actually computing the layer both ways."""

import pytest
import torch

from normfold import algebra

D = torch.float64


def _adversarial(shape, outliers=True):
    x = torch.randn(shape, dtype=D)
    if outliers:
        x[..., 3 % shape[-1]] += 3000.0  # GPT-2's residual stream has coordinates ~3000
        x = x + 40.0  # and a large common mean
    return x


def linear_out(x, w, b):  # nn.Linear layout: w (out, in)
    return x @ w.T + (0 if b is None else b)


def conv1d_out(x, w, b):  # HF Conv1D layout: w (in, out)
    return x @ w + (0 if b is None else b)


@pytest.mark.parametrize("layout", ["linear", "conv1d"])
@pytest.mark.parametrize("n_in,n_out", [(5, 7), (16, 16), (3, 129)])
def test_center_writer_makes_output_zero_mean_and_equals_centred_output(layout, n_in, n_out):
    shape = (n_out, n_in) if layout == "linear" else (n_in, n_out)
    w = _adversarial(shape)
    b = torch.randn(n_out, dtype=D) + 9
    out_dim = 0 if layout == "linear" else 1
    f = linear_out if layout == "linear" else conv1d_out
    new_w, new_b = algebra.center_writer(w, b, out_dim)
    x = _adversarial((11, n_in))
    y, y_new = f(x, w, b), f(x, new_w, new_b)
    scale = y.abs().max()
    assert y_new.mean(-1).abs().max() <= 1e-13 * scale
    assert (y_new - (y - y.mean(-1, keepdim=True))).abs().max() <= 1e-13 * scale


def test_center_writer_embedding_table_rows():
    table = _adversarial((50, 12))
    new, _ = algebra.center_writer(table, None, out_dim=1)
    ids = torch.randint(0, 50, (20,))
    emb = torch.nn.functional.embedding(ids, new)
    assert emb.mean(-1).abs().max() < 1e-12 * table.abs().max()
    assert torch.allclose(emb, table[ids] - table[ids].mean(-1, keepdim=True), atol=1e-12, rtol=0)


def test_center_writer_conv2d_patch_embedding():
    w = torch.randn(8, 3, 4, 4, dtype=D)
    b = torch.randn(8, dtype=D)
    new_w, new_b = algebra.center_writer(w, b, out_dim=0)
    img = torch.randn(2, 3, 8, 8, dtype=D)
    y = torch.nn.functional.conv2d(img, w, b, stride=4).flatten(2).transpose(1, 2)
    y_new = torch.nn.functional.conv2d(img, new_w, new_b, stride=4).flatten(2).transpose(1, 2)
    assert torch.allclose(y_new, y - y.mean(-1, keepdim=True), atol=1e-12, rtol=0)


def test_center_writer_keeps_dtype_and_rounds_once():
    w = torch.randn(64, 32, dtype=torch.bfloat16)
    new_w, _ = algebra.center_writer(w, None, 0)
    assert new_w.dtype == torch.bfloat16
    exact = w.double() - w.double().mean(0, keepdim=True)
    # a single rounding of the exact float64 result
    assert torch.equal(new_w, exact.to(torch.bfloat16))


@pytest.mark.parametrize("layout", ["linear", "conv1d"])
@pytest.mark.parametrize("with_bias", [True, False])
def test_fold_affine_equals_reading_the_affine_output(layout, with_bias):
    d, m = 13, 9
    n = torch.randn(7, d, dtype=D)
    gamma, beta = torch.randn(d, dtype=D) * 3, torch.randn(d, dtype=D) * 2
    w = torch.randn((m, d) if layout == "linear" else (d, m), dtype=D)
    b = torch.randn(m, dtype=D) if with_bias else None
    f = linear_out if layout == "linear" else conv1d_out
    new_w, new_b = algebra.fold_affine(w, b, gamma, beta, in_dim=1 if layout == "linear" else 0)
    assert new_b is not None  # β always yields a bias term
    assert torch.allclose(f(n, new_w, new_b), f(n * gamma + beta, w, b), atol=1e-12, rtol=0)


def test_fold_affine_gamma_only_keeps_bias_untouched():
    w, b = torch.randn(4, 6, dtype=D), torch.randn(4, dtype=D)
    gamma = torch.randn(6, dtype=D)
    new_w, new_b = algebra.fold_affine(w, b, gamma, None, in_dim=1)
    assert torch.equal(new_b, b)
    n = torch.randn(3, 6, dtype=D)
    assert torch.allclose(linear_out(n, new_w, new_b), linear_out(n * gamma, w, b), atol=1e-13, rtol=0)


def test_layer_norm_then_linear_equals_rms_then_folded_linear_brute_force():
    # The whole Pre-LN identity on one layer: Linear(LN(x)) == Linear'(RMSNorm(x - μ(x))).
    from normfold.ops import reference as R

    d, m = 24, 10
    x = _adversarial((9, d))
    gamma, beta = torch.randn(d, dtype=D), torch.randn(d, dtype=D)
    w, b = torch.randn(m, d, dtype=D), torch.randn(m, dtype=D)
    want = linear_out(R.layer_norm(x, gamma, beta, 1e-5), w, b)
    new_w, new_b = algebra.fold_affine(w, b, gamma, beta, in_dim=1)
    xc = x - x.mean(-1, keepdim=True)
    got = linear_out(R.rms_norm(xc, None, None, 1e-5), new_w, new_b)
    assert (got - want).abs().max() <= 1e-12 * want.abs().max()


@pytest.mark.parametrize("layout", ["linear", "conv1d"])
def test_compress_reader_on_zero_mean_inputs(layout):
    d, m = 10, 6
    x = torch.randn(5, d, dtype=D)
    x = x - x.mean(-1, keepdim=True)
    w = torch.randn((m, d) if layout == "linear" else (d, m), dtype=D)
    in_dim = 1 if layout == "linear" else 0
    f = linear_out if layout == "linear" else conv1d_out
    cw = algebra.compress_reader(w, in_dim)
    assert cw.shape[in_dim] == d - 1
    assert torch.allclose(f(x[:, :-1], cw, None), f(x, w, None), atol=1e-12, rtol=0)
    # decompress (App. C) gives a reader of the full vector with the same outputs
    dw = algebra.decompress_reader(cw, in_dim)
    assert torch.allclose(f(x, dw, None), f(x, w, None), atol=1e-12, rtol=0)


def test_compress_and_decompress_writer_round_trip():
    w, b = algebra.center_writer(torch.randn(12, 5, dtype=D), torch.randn(12, dtype=D), 0)
    cw, cb = algebra.compress_writer(w, b, 0)
    assert cw.shape == (11, 5) and cb.shape == (11,)
    rw, rb = algebra.decompress_writer(cw, cb, 0)
    assert torch.allclose(rw, w, atol=1e-13, rtol=0) and torch.allclose(rb, b, atol=1e-13, rtol=0)


def test_layouts_registry():
    from torch import nn

    assert algebra.layout_of(nn.Linear(2, 3)).out_dim == 0
    assert algebra.layout_of(nn.Embedding(4, 3)).in_dim is None
    assert algebra.is_linear_reader(nn.Linear(2, 3))
    assert not algebra.is_linear_reader(nn.Embedding(4, 3))
    assert algebra.layout_of(nn.ReLU()) is None


def test_hf_conv1d_layout(transformers):
    from transformers.pytorch_utils import Conv1D

    lay = algebra.layout_of(Conv1D(7, 5))
    assert (lay.out_dim, lay.in_dim) == (1, 0)
