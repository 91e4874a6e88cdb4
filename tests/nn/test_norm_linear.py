"""NormLinear (issue 12 item 5): Linear(norm(x)) computed as (x·Wᵀ)·s(x) + b, against the
straightforward composition and the float64 reference; ops.row_scale against the kernel's rstd."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from normfold import ops
from normfold.nn import CRMSNorm, NormLinear, RMSNorm
from normfold.ops import cpu, reference


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("compressed", [False, True])
@pytest.mark.parametrize("affine", [False, True])
def test_float64_equals_norm_then_linear(compressed, affine):
    torch.manual_seed(0)
    d, out = 95, 130
    norm = (CRMSNorm if compressed else RMSNorm)(d, eps=1e-6, weight=affine, bias=affine).double()
    if affine:
        with torch.no_grad():
            norm.weight.normal_()
            norm.bias.normal_()
    linear = nn.Linear(d, out).double()
    x = torch.randn(3, 7, d, dtype=torch.float64) * 5 + 1
    want = linear(norm(x))
    got = NormLinear.fold(norm, linear)(x)
    assert got.shape == want.shape and rel(got, want) <= 1e-12
    ref = (reference.crms_norm if compressed else reference.rms_norm)(x, norm.weight, norm.bias, 1e-6)
    assert rel(got, F.linear(ref, linear.weight, linear.bias)) <= 1e-12


def test_affine_free_norm_shares_the_linear():
    linear = nn.Linear(16, 8)
    assert NormLinear.fold(RMSNorm(16, weight=False), linear).linear is linear


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("compressed", [False, True])
def test_row_scale_matches_the_kernel_rstd(dtype, compressed):
    torch.manual_seed(1)
    x = torch.randn(37, 767).to(dtype)
    r = torch.randn(37, 767).to(dtype)
    s, scale = ops.row_scale(x, eps=1e-5, compressed=compressed)
    assert s is None and scale.shape == (37,) and scale.dtype == torch.float32
    ref = ops.row_scale(x.double(), eps=1e-5, compressed=compressed)[1]
    assert rel(scale, ref) <= 1e-6
    s, scale = ops.row_scale(x, r, eps=1e-5, compressed=compressed)
    assert torch.equal(s, x + r)
    assert rel(scale, ops.row_scale((x + r).double(), eps=1e-5, compressed=compressed)[1]) <= 1e-6
    if cpu.library() is not None:  # the scale-only kernel call agrees with the full forward's rstd
        _, rstd = cpu.forward(x, None, None, 1e-5, compressed, True)
        assert torch.equal(ops.row_scale(x, eps=1e-5, compressed=compressed)[1], rstd)


def test_float32_kernel_path_close_to_float64():
    torch.manual_seed(2)
    linear = nn.Linear(768, 2304)
    x = torch.randn(64, 768)
    x = x - x.mean(-1, keepdim=True)
    got = NormLinear(linear, eps=1e-5)(x)
    x64, w64, b64 = x.double(), linear.weight.double(), linear.bias.double()
    want = F.linear(reference.rms_norm(x64, eps=1e-5), w64, b64)
    assert rel(got, want) <= 1e-6


def test_a_gradient_flows_through_the_reference_path():
    linear = nn.Linear(12, 5)
    x = torch.randn(4, 12, requires_grad=True)
    NormLinear(linear)(x).sum().backward()
    x2 = x.detach().clone().requires_grad_()
    F.linear(reference.rms_norm(x2), linear.weight, linear.bias).sum().backward()
    assert torch.allclose(x.grad, x2.grad, atol=1e-6)


def test_refuses_what_it_cannot_fold():
    with pytest.raises(TypeError, match="RMSNorm or CRMSNorm"):
        NormLinear.fold(nn.LayerNorm(8), nn.Linear(8, 4))
    with pytest.raises(TypeError, match="nn.Linear"):
        NormLinear.fold(RMSNorm(8), nn.Conv1d(8, 4, 1))
    with pytest.raises(TypeError, match="nn.Linear"):
        NormLinear(nn.Conv1d(8, 4, 1))
