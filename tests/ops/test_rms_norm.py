"""RMSNorm fast path (the C kernel on CPU) against the float64 reference: outputs and gradients."""

import pytest
import torch

from norm_cases import (
    AFFINES, DTYPES, SHAPES, TOL, check_backward, check_finite_difference, check_forward, inputs, needs_kernel, rel,
)
from normfold import ops
from normfold.nn import RMSNorm
from normfold.ops import reference

pytestmark = needs_kernel


def test_cpu_tensors_use_the_kernel():
    for dtype in DTYPES:
        assert ops.backend_for(torch.randn(2, 8).to(dtype)) == "cpu-kernel"


@pytest.mark.parametrize("affine", AFFINES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_forward(dtype, shape, affine):
    check_forward(False, dtype, shape, affine)


@pytest.mark.parametrize("affine", ["none", "weight", "both"])
@pytest.mark.parametrize("shape", [(4, 7), (3, 2, 257), (16, 768), (9, 33)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_backward(dtype, shape, affine):
    check_backward(False, dtype, shape, affine)


@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("dtype", DTYPES)
def test_parallel_rows_and_weight_gradient_reduction(threads, dtype):
    # Big enough to be split across threads: dweight/dbias are summed from per-thread partials.
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        check_forward(False, dtype, (300, 700), "both")
        check_backward(False, dtype, (300, 700), "both")
    finally:
        torch.set_num_threads(old)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tensors_larger_than_cache(dtype):
    # Past ~20 MiB of dy + x + dx the backward streams one row at a time instead of in blocks.
    check_forward(False, dtype, (3600, 1100), "weight")
    check_backward(False, dtype, (3600, 1100), "both")


@pytest.mark.parametrize("dtype", DTYPES)
def test_non_contiguous_inputs(dtype):
    base = torch.randn(6, 5, 40).to(dtype)
    w = torch.randn(33).to(dtype)
    for x in (base[..., 3:36],  # rows 40 apart: read in place
              base.transpose(0, 1)[..., :33],  # leading dims not flattenable: copied
              torch.randn(33, 12).to(dtype).t()):  # last dimension strided: copied
        want = reference.rms_norm(x.double(), w.double(), None, 1e-5)
        assert rel(ops.rms_norm(x, w), want) <= TOL[dtype]
    # gradients through a strided view reach the base tensor
    base64 = base.double().requires_grad_()
    reference.rms_norm(base64[..., 3:36], w.double(), None).sum().backward()
    leaf = base.clone().requires_grad_()
    ops.rms_norm(leaf[..., 3:36], w).sum().backward()
    assert rel(leaf.grad, base64.grad) <= 2 * TOL[dtype]


def test_float32_parameters_on_half_inputs_are_not_rounded():
    # A bf16 activation with float32 weights: the reference applies the float32 weight as is.
    x, _, _ = inputs((8, 96), torch.bfloat16)
    w, b = torch.randn(96), torch.randn(96)
    got = ops.rms_norm(x, w, b)
    want = reference.rms_norm(x.double(), w.double(), b.double())
    assert got.dtype == torch.bfloat16 and rel(got, want) <= TOL[torch.bfloat16]
    xg, wg, bg = x.clone().requires_grad_(), w.clone().requires_grad_(), b.clone().requires_grad_()
    ops.rms_norm(xg, wg, bg).sum().backward()
    assert wg.grad.dtype == torch.float32 and bg.grad.dtype == torch.float32


@pytest.mark.parametrize("dtype", DTYPES)
def test_zero_rows_and_eps(dtype):
    x = torch.zeros(3, 10, dtype=dtype)
    x[1] = 1e-3
    for eps in (1e-5, 1e-6, 0.1):
        want = reference.rms_norm(x.double(), None, None, eps)
        assert rel(ops.rms_norm(x, None, None, eps), want) <= TOL[dtype]
    assert torch.equal(ops.rms_norm(x)[0], torch.zeros(10, dtype=dtype))


def test_non_finite_inputs_propagate():
    x = torch.randn(3, 40)
    x[0, 5] = float("nan")
    x[1, 7] = float("inf")
    for dtype in DTYPES:
        y = ops.rms_norm(x.to(dtype))
        assert y[0].isnan().all() and y[1].isnan().any() and y[2].isfinite().all()


def test_only_weight_gradient_requested():
    x, w, _ = inputs((5, 64), torch.float32, "weight")
    wg = w.clone().requires_grad_()
    ops.rms_norm(x, wg).pow(2).sum().backward()
    w64 = w.double().requires_grad_()
    reference.rms_norm(x.double(), w64).pow(2).sum().backward()
    assert rel(wg.grad, w64.grad) < 1e-5


def test_finite_difference_gradient():
    check_finite_difference(compressed=False)


def test_module_uses_kernel_and_matches_layernorm_on_zero_mean_input():
    ln = torch.nn.LayerNorm(48, eps=1e-6)
    with torch.no_grad():
        ln.weight.normal_()
        ln.bias.normal_()
    m = RMSNorm.from_layernorm(ln)
    x = torch.randn(4, 48, dtype=torch.float64)
    x = (x - x.mean(-1, keepdim=True)).float()
    assert ops.backend_for(x) == "cpu-kernel"
    assert rel(m(x), ln(x)) < 1e-5
    assert m.weight is not None and m.bias is not None
