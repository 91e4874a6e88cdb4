"""Reference norms against float64 brute force and against torch's own LayerNorm."""

import pytest
import torch
import torch.nn.functional as F

from normfold.ops import reference as R


def brute_layer_norm(x, w, b, eps):
    x = x.double()
    out = torch.empty_like(x)
    for idx in range(x.shape[0]):
        row = x[idx]
        mu = row.sum() / row.numel()
        var = ((row - mu) ** 2).sum() / row.numel()
        out[idx] = (row - mu) / torch.sqrt(var + eps)
    return out * w.double() + b.double()


@pytest.mark.parametrize("d", [1, 2, 7, 64, 129])
def test_layer_norm_matches_brute_force_and_torch(d):
    x = torch.randn(9, d, dtype=torch.float64) * 3 + 5
    w, b = torch.randn(d, dtype=torch.float64), torch.randn(d, dtype=torch.float64)
    ref = brute_layer_norm(x, w, b, 1e-5)
    assert torch.allclose(R.layer_norm(x, w, b, 1e-5), ref, atol=1e-12, rtol=0)
    assert torch.allclose(F.layer_norm(x, (d,), w, b, 1e-5), ref, atol=1e-12, rtol=0)


def test_rms_norm_formula():
    x = torch.randn(5, 11, dtype=torch.float64)
    w, b = torch.randn(11, dtype=torch.float64), torch.randn(11, dtype=torch.float64)
    manual = x / torch.sqrt((x * x).mean(-1, keepdim=True) + 1e-6) * w + b
    assert torch.allclose(R.rms_norm(x, w, b, 1e-6), manual, atol=1e-14, rtol=0)


@pytest.mark.parametrize("eps", [1e-5, 1e-6, 1e-12])
def test_rms_equals_layer_norm_on_zero_mean_input(eps):
    x = torch.randn(6, 33, dtype=torch.float64) * 10
    x = x - x.mean(-1, keepdim=True)
    w, b = torch.randn(33, dtype=torch.float64), torch.randn(33, dtype=torch.float64)
    assert torch.allclose(R.rms_norm(x, w, b, eps), R.layer_norm(x, w, b, eps), atol=1e-12, rtol=0)


def test_layer_norm_is_rms_of_centred_input_plus_bias():
    # paper 003: LN(x) = RMSNorm(xC)·γ + β
    x = torch.randn(4, 20, dtype=torch.float64) + 7
    w, b = torch.randn(20, dtype=torch.float64), torch.randn(20, dtype=torch.float64)
    C = torch.eye(20, dtype=torch.float64) - 1 / 20
    assert torch.allclose(R.layer_norm(x, w, b), R.rms_norm(x @ C, w, b), atol=1e-12, rtol=0)


def test_crms_norm_equals_rms_norm_of_decompressed_vector():
    d = 17
    full = torch.randn(8, d, dtype=torch.float64) * 4
    full = full - full.mean(-1, keepdim=True)
    w = torch.randn(d - 1, dtype=torch.float64)
    got = R.crms_norm(full[:, :-1], w, None, 1e-5)
    want = R.rms_norm(full, None, None, 1e-5)[:, :-1] * w
    assert torch.allclose(got, want, atol=1e-12, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_inputs_accumulate_in_float32(dtype):
    x = (torch.randn(4, 4096) * 100).to(dtype)
    got = R.rms_norm(x).double()
    want = R.rms_norm(x.double())
    assert (got - want).abs().max() <= 2 * torch.finfo(dtype).eps * want.abs().max()
    assert R.rms_norm(x).dtype == dtype
