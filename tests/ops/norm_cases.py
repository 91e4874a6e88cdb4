"""Shared cases for the (C)RMSNorm kernel tests: inputs, float64 references, tolerances.

Every fast path is compared with the float64 reference ops (`normfold.ops.reference`) on the same
inputs (rounded to the working dtype first), so the only error measured is the kernel's own.
"""

from __future__ import annotations

import pytest
import torch

from normfold import ops
from normfold.ops import cpu, reference

# The kernel tests need the kernel to be built and selected (not forced off by NORMFOLD_CPU_KERNEL=0
# or NORMFOLD_BACKEND=reference): otherwise they would compare the reference with itself.
KERNEL_ACTIVE = cpu.library() is not None and ops.backend_for(torch.ones(1, 2)) == "cpu-kernel"
needs_kernel = pytest.mark.skipif(not KERNEL_ACTIVE, reason="CPU kernel unavailable or not selected")

# Max error relative to the largest reference value. float32: a few ulps of accumulation over
# ~4k terms; half types: one rounding of the output (2^-8 bf16, 2^-11 fp16) plus slack.
TOL = {torch.float32: 2e-6, torch.bfloat16: 4e-3, torch.float16: 5e-4}
DTYPES = list(TOL)
# Odd widths exercise the vector tails; (5, 4097) and (64, 1000) have rows wider than one tile.
SHAPES = [(1, 1), (3, 5), (2, 17), (7, 768), (2, 3, 129), (64, 1000), (5, 4097)]
AFFINES = ["none", "weight", "bias", "both"]


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach(), b.detach()
    return float((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30))


def inputs(shape, dtype, affine="both", outliers=True, seed=0):
    """x (with a few huge coordinates, like GPT-2's residual stream), weight, bias in `dtype`."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, dtype=torch.float64, generator=g)
    if outliers and shape[-1] > 4:
        x[..., 0] *= 300
        x[..., -1] -= 50
    d = shape[-1]
    w = 1 + 0.5 * torch.randn(d, dtype=torch.float64, generator=g)
    b = 0.5 * torch.randn(d, dtype=torch.float64, generator=g)
    w = w.to(dtype) if affine in ("weight", "both") else None
    b = b.to(dtype) if affine in ("bias", "both") else None
    return x.to(dtype), w, b


def d64(t):
    return None if t is None else t.detach().double()


def fast_fn(compressed):
    return ops.crms_norm if compressed else ops.rms_norm


def ref_fn(compressed):
    return reference.crms_norm if compressed else reference.rms_norm


def check_forward(compressed, dtype, shape, affine, eps=1e-5):
    x, w, b = inputs(shape, dtype, affine)
    assert ops.backend_for(x) == "cpu-kernel"
    got = fast_fn(compressed)(x, w, b, eps)
    want = ref_fn(compressed)(x.double(), d64(w), d64(b), eps)
    assert got.dtype == dtype and got.shape == x.shape and got.is_contiguous()
    assert rel(got, want) <= TOL[dtype], rel(got, want)


def check_backward(compressed, dtype, shape, affine, eps=1e-5, x=None):
    x0, w, b = inputs(shape, dtype, affine, outliers=False, seed=1)
    x = x0 if x is None else x
    assert ops.backend_for(x) == "cpu-kernel"
    dy = torch.randn(x.shape, dtype=torch.float64)
    leaves64 = [t.double().requires_grad_() if t is not None else None for t in (x, w, b)]
    ref_fn(compressed)(*leaves64, eps).backward(dy)
    leaves = [t.detach().clone().requires_grad_() if t is not None else None for t in (x, w, b)]
    fast_fn(compressed)(*leaves, eps).backward(dy.to(dtype))
    tol = 2 * TOL[dtype]  # the gradient is rounded once at the end, float32 inside
    for got, want in zip(leaves, leaves64):
        if got is not None:
            assert got.grad.dtype == got.dtype and got.grad.shape == got.shape
            assert rel(got.grad, want.grad) <= tol, rel(got.grad, want.grad)


def check_finite_difference(compressed: bool) -> None:
    """An independent check of the analytic backward: central differences of the float64 reference."""
    x = torch.randn(2, 6, dtype=torch.float64)
    w = torch.randn(6, dtype=torch.float64)
    dy = torch.randn(2, 6, dtype=torch.float64)
    ref = ref_fn(compressed)
    xk = x.float().requires_grad_()
    fast_fn(compressed)(xk, w.float(), None, 1e-5).backward(dy.float())
    h, fd = 1e-6, torch.zeros_like(x)
    for i in range(x.numel()):
        e = torch.zeros(x.numel(), dtype=torch.float64)
        e[i] = h
        e = e.view_as(x)
        fd.view(-1)[i] = ((ref(x + e, w) - ref(x - e, w)) * dy).sum() / (2 * h)
    assert rel(xk.grad, fd) < 1e-5
