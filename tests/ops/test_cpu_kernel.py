"""The C kernel (normfold.ops.cpu) against the float64 reference: outputs and gradients."""

import pytest
import torch

from normfold import ops
from normfold.ops import cpu, reference

pytestmark = pytest.mark.skipif(cpu.library() is None, reason="CPU kernel unavailable (no C compiler)")

TOL = {torch.float32: 2e-6, torch.bfloat16: 4e-3, torch.float16: 5e-4}
SHAPES = [(1, 1), (3, 5), (7, 768), (2, 3, 129), (64, 1000), (5, 4097)]


def _inputs(shape, dtype, outliers=False):
    x = torch.randn(shape, dtype=torch.float64)
    if outliers:  # a few huge coordinates, like GPT-2's residual stream
        x[..., 0] *= 300
        x[..., -1] -= 50
    d = shape[-1]
    w, b = torch.randn(d, dtype=torch.float64), torch.randn(d, dtype=torch.float64)
    return x.to(dtype), w.to(dtype), b.to(dtype)


def _rel(a, b):
    return float((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30))


@pytest.mark.parametrize("dtype", list(TOL))
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("affine", ["none", "weight", "bias", "both"])
@pytest.mark.parametrize("compressed", [False, True])
def test_forward_matches_float64_reference(dtype, shape, affine, compressed):
    x, w, b = _inputs(shape, dtype, outliers=shape[-1] > 4)
    w = w if affine in ("weight", "both") else None
    b = b if affine in ("bias", "both") else None
    fn = ops.crms_norm if compressed else ops.rms_norm
    ref_fn = reference.crms_norm if compressed else reference.rms_norm
    assert ops.backend_for(x) == "cpu-kernel"
    got = fn(x, w, b, 1e-5)
    want = ref_fn(x.double(), None if w is None else w.double(), None if b is None else b.double(), 1e-5)
    assert got.dtype == dtype and got.shape == x.shape
    assert _rel(got, want) <= TOL[dtype]


@pytest.mark.parametrize("dtype", list(TOL))
@pytest.mark.parametrize("compressed", [False, True])
@pytest.mark.parametrize("shape", [(4, 7), (3, 2, 257), (16, 768)])
def test_backward_matches_float64_autograd(dtype, compressed, shape):
    x, w, b = _inputs(shape, dtype)
    dy = torch.randn(shape, dtype=torch.float64)
    x64, w64, b64 = (t.double().requires_grad_() for t in (x, w, b))
    ref_fn = reference.crms_norm if compressed else reference.rms_norm
    ref_fn(x64, w64, b64, 1e-5).backward(dy)
    xk, wk, bk = (t.clone().requires_grad_() for t in (x, w, b))
    fn = ops.crms_norm if compressed else ops.rms_norm
    fn(xk, wk, bk, 1e-5).backward(dy.to(dtype))
    # half-precision gradients are rounded once at the end; float32 accumulation inside
    tol = 2 * TOL[dtype]
    assert _rel(xk.grad, x64.grad) <= tol
    assert _rel(wk.grad, w64.grad) <= tol
    assert _rel(bk.grad, b64.grad) <= tol
    assert xk.grad.dtype == dtype and wk.grad.dtype == dtype


def test_backward_without_weight_and_only_input_grad():
    x = torch.randn(5, 33, requires_grad=True)
    ops.rms_norm(x, None, None, 1e-6).sum().backward()
    x64 = x.detach().double().requires_grad_()
    reference.rms_norm(x64, None, None, 1e-6).sum().backward()
    assert _rel(x.grad, x64.grad) < 1e-5


def test_gradcheck_style_finite_difference_in_float32():
    # An independent check of the analytic backward: central differences of the reference.
    x = torch.randn(2, 6, dtype=torch.float64)
    w = torch.randn(6, dtype=torch.float64)
    dy = torch.randn(2, 6, dtype=torch.float64)
    xk = x.float().requires_grad_()
    ops.crms_norm(xk, w.float(), None, 1e-5).backward(dy.float())
    h = 1e-6
    fd = torch.zeros_like(x)
    for i in range(x.numel()):
        e = torch.zeros_like(x).view(-1)
        e[i] = h
        e = e.view_as(x)
        fd.view(-1)[i] = ((reference.crms_norm(x + e, w, None, 1e-5) - reference.crms_norm(x - e, w, None, 1e-5)) * dy).sum() / (2 * h)
    assert _rel(xk.grad, fd) < 1e-5


def test_non_contiguous_input_is_handled():
    x = torch.randn(8, 64).t()  # (64, 8), non-contiguous
    assert _rel(ops.rms_norm(x), reference.rms_norm(x.double())) < 1e-6


def test_forced_reference_backend(monkeypatch):
    monkeypatch.setenv("NORMFOLD_BACKEND", "reference")
    assert ops.backend_for(torch.randn(2, 4)) == "reference"


def test_float64_uses_reference():
    assert ops.backend_for(torch.randn(2, 4, dtype=torch.float64)) == "reference"


def test_kernel_disabled_by_environment(monkeypatch):
    monkeypatch.setenv("NORMFOLD_CPU_KERNEL", "0")
    assert cpu.library() is None
    assert ops.backend_for(torch.randn(2, 4)) == "reference"
    x = torch.randn(3, 10)
    assert _rel(ops.rms_norm(x), reference.rms_norm(x.double())) < 1e-6


def test_build_failure_falls_back(monkeypatch, tmp_path):
    # A broken compiler must leave normfold working on the reference path, with a warning.
    monkeypatch.setattr(cpu, "_lib", None)
    monkeypatch.setattr(cpu, "_tried", False)
    monkeypatch.setenv("NORMFOLD_CACHE", str(tmp_path))
    monkeypatch.setenv("CC", "false")
    monkeypatch.setattr(cpu, "_compiler", lambda: "false")
    with pytest.warns(RuntimeWarning, match="CPU kernel build failed"):
        assert cpu.library() is None
    assert ops.backend_for(torch.randn(2, 4)) == "reference"
    monkeypatch.setattr(cpu, "_tried", False)  # let later tests rebuild/reload the real kernel
