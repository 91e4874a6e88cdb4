"""CRMSNorm fast path (paper 001 eq. 5, the C kernel on CPU) against the float64 reference."""

import pytest
import torch

from norm_cases import (
    AFFINES, DTYPES, SHAPES, TOL, check_backward, check_finite_difference, check_forward, needs_kernel, rel,
)
from normfold import ops
from normfold.nn import CRMSNorm
from normfold.ops import reference

pytestmark = needs_kernel


@pytest.mark.parametrize("affine", AFFINES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_forward(dtype, shape, affine):
    check_forward(True, dtype, shape, affine)


@pytest.mark.parametrize("affine", ["none", "weight", "both"])
@pytest.mark.parametrize("shape", [(4, 7), (3, 2, 257), (16, 767), (9, 33)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_backward(dtype, shape, affine):
    check_backward(True, dtype, shape, affine)


@pytest.mark.parametrize("dtype", DTYPES)
def test_parallel_rows(dtype):
    check_forward(True, dtype, (300, 701), "both")
    check_backward(True, dtype, (300, 701), "both")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_equals_rmsnorm_of_the_decompressed_stream(dtype):
    # The defining property: CRMSNorm(x[:d-1]) = RMSNorm(x)[:d-1] for a zero-mean x in R^d.
    x = torch.randn(12, 65, dtype=torch.float64)
    x = x - x.mean(-1, keepdim=True)
    w = torch.randn(64, dtype=torch.float64)
    full = reference.rms_norm(x, torch.cat([w, torch.ones(1, dtype=torch.float64)]))[..., :64]
    got = ops.crms_norm(x[..., :64].to(dtype), w.to(dtype))
    assert rel(got, full) <= 2 * TOL[dtype]  # the kernel's rounding plus that of the inputs


def test_strided_compressed_slice_is_read_in_place():
    # x[..., :d-1] of a contiguous stream: rows are d apart, the kernel reads them without a copy.
    x = torch.randn(10, 33)
    xs = x[..., :32]
    assert not xs.is_contiguous()
    assert rel(ops.crms_norm(xs), reference.crms_norm(xs.double())) <= TOL[torch.float32]


def test_finite_difference_gradient():
    check_finite_difference(compressed=True)


def test_module():
    m = CRMSNorm(31, eps=1e-6, weight=True, bias=True)
    with torch.no_grad():
        m.weight.normal_()
        m.bias.normal_()
    x = torch.randn(3, 5, 31, requires_grad=True)
    y = m(x)
    want = reference.crms_norm(x.double(), m.weight.double(), m.bias.double(), 1e-6)
    assert rel(y, want) <= TOL[torch.float32]
    y.sum().backward()
    assert m.weight.grad is not None and m.bias.grad is not None and x.grad is not None
