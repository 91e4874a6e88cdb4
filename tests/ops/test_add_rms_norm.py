"""Fused residual add + (C)RMSNorm against the unfused float64 reference: (s, norm(s)) and gradients."""

import pytest
import torch

from norm_cases import DTYPES, TOL, d64, inputs, needs_kernel, ref_fn, rel
from normfold import ops
from normfold.nn import AddCRMSNorm, AddRMSNorm

pytestmark = needs_kernel

FUSED = {False: ops.add_rms_norm, True: ops.add_crms_norm}


def _pair(shape, dtype, affine="both"):
    x, w, b = inputs(shape, dtype, affine, outliers=False, seed=2)
    r, _, _ = inputs(shape, dtype, "none", outliers=True, seed=3)
    return x, r, w, b


@pytest.mark.parametrize("compressed", [False, True])
@pytest.mark.parametrize("affine", ["none", "weight", "bias", "both"])
@pytest.mark.parametrize("shape", [(1, 1), (3, 5), (7, 768), (2, 3, 129), (5, 4097)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_forward(dtype, shape, affine, compressed):
    x, r, w, b = _pair(shape, dtype, affine)
    s, y = FUSED[compressed](x, r, w, b, 1e-5)
    # the sum is exactly torch's own x + r in the working dtype (rounded once)...
    assert s.dtype == dtype and torch.equal(s, x + r)
    # ...and y is the norm of that rounded sum
    want = ref_fn(compressed)(s.double(), d64(w), d64(b), 1e-5)
    assert y.dtype == dtype and y.shape == x.shape
    assert rel(y, want) <= TOL[dtype]


@pytest.mark.parametrize("compressed", [False, True])
@pytest.mark.parametrize("use", ["both", "norm", "sum"])
@pytest.mark.parametrize("shape", [(4, 7), (3, 2, 257), (16, 768)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_backward(dtype, shape, use, compressed):
    x, r, w, b = _pair(shape, dtype)
    dy, ds = torch.randn(shape, dtype=torch.float64), torch.randn(shape, dtype=torch.float64)

    def loss(s, y, scale=lambda t: t):
        out = 0
        if use in ("both", "norm"):
            out = out + (y * scale(dy)).sum()
        if use in ("both", "sum"):
            out = out + (s * scale(ds)).sum()
        return out

    leaves64 = [t.double().requires_grad_() for t in (x, r, w, b)]
    s64 = leaves64[0] + leaves64[1]
    loss(s64, ref_fn(compressed)(s64, leaves64[2], leaves64[3], 1e-5)).backward()
    leaves = [t.clone().requires_grad_() for t in (x, r, w, b)]
    s, y = FUSED[compressed](*leaves, 1e-5)
    loss(s, y, lambda t: t.to(dtype)).backward()
    for got, want in zip(leaves, leaves64):
        if want.grad is None:  # only the sum was used: no gradient reaches weight and bias
            assert got.grad is None or not got.grad.any()
            continue
        assert got.grad.dtype == got.dtype
        assert rel(got.grad, want.grad) <= 2 * TOL[dtype], rel(got.grad, want.grad)


def test_gradients_of_x_and_residual_are_independent_tensors():
    x, r, w, b = _pair((4, 64), torch.float32)
    x.requires_grad_()
    r.requires_grad_()
    s, y = ops.add_rms_norm(x, r, w, b)
    (y.sum() + s.sum()).backward()
    assert torch.equal(x.grad, r.grad)
    x.grad.add_(1.0)  # accumulating into one leaf's .grad must not touch the other's
    assert not torch.equal(x.grad, r.grad)


def test_strided_inputs_and_parallel_rows():
    base = torch.randn(300, 800)
    x, r = base[:, :700], torch.randn(300, 700)
    w = torch.randn(700)
    s, y = ops.add_rms_norm(x, r, w)
    assert torch.equal(s, x + r)
    assert rel(y, ref_fn(False)(s.double(), w.double())) <= TOL[torch.float32]


def test_broadcast_or_mixed_dtype_residual_uses_torch_semantics():
    x = torch.randn(4, 3, 16)
    r = torch.randn(16)  # broadcast
    s, y = ops.add_rms_norm(x, r)
    assert torch.equal(s, x + r) and rel(y, ref_fn(False)(s.double())) <= TOL[torch.float32]
    s2, y2 = ops.add_rms_norm(x.bfloat16(), x)  # bf16 + fp32 promotes to fp32, like `+`
    assert s2.dtype == torch.float32


def test_modules():
    for cls, compressed in ((AddRMSNorm, False), (AddCRMSNorm, True)):
        m = cls(24, eps=1e-6, bias=True)
        with torch.no_grad():
            m.weight.normal_()
            m.bias.normal_()
        x, r = torch.randn(5, 24, requires_grad=True), torch.randn(5, 24)
        s, y = m(x, r)
        assert torch.equal(s, x + r)
        want = ref_fn(compressed)(s.double(), m.weight.double(), m.bias.double(), 1e-6)
        assert rel(y, want) <= TOL[torch.float32]
        y.sum().backward()
        assert x.grad is not None and m.weight.grad is not None and m.bias.grad is not None


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("compressed", [False, True])
@pytest.mark.parametrize("affine", ["none", "weight", "both", "f32-params"])
def test_module_fast_add_path_is_the_dispatchers_call(dtype, compressed, affine):
    """RMSNorm / CRMSNorm(x, residual) call the kernel directly in CPU inference (cpu.fast_add_forward):
    bit for bit what ops.add_(c)rms_norm returns, and None (the general path) where it does not apply."""
    from normfold.nn import CRMSNorm, RMSNorm
    from normfold.ops import cpu

    g = torch.Generator().manual_seed(1)
    x, r = (torch.randn(3, 70, 96, generator=g).to(dtype) for _ in range(2))
    pdt = torch.float32 if affine == "f32-params" else dtype
    w = None if affine == "none" else torch.randn(96, generator=g).to(pdt)
    b = torch.randn(96, generator=g).to(pdt) if affine in ("both", "f32-params") else None
    op = ops.add_crms_norm if compressed else ops.add_rms_norm
    want = op(x, r, w, b, 1e-5)
    got = cpu.fast_add_forward(x, r, w, b, 1e-5, compressed)
    assert got is not None and all(torch.equal(a, c) for a, c in zip(got, want))
    mod = (CRMSNorm if compressed else RMSNorm)(96, weight=w is not None, bias=b is not None, dtype=pdt)
    with torch.no_grad():
        if w is not None:
            mod.weight.copy_(w)
        if b is not None:
            mod.bias.copy_(b)
        s, y = mod(x, r)
    assert torch.equal(s, want[0]) and torch.equal(y, want[1])
    # not the common case: the general path takes it (and raises the user errors)
    assert cpu.fast_add_forward(x, r.transpose(0, 1).contiguous().transpose(0, 1), w, b, 1e-5, compressed) is None
    assert cpu.fast_add_forward(x, r.double(), w, b, 1e-5, compressed) is None
    assert cpu.fast_add_forward(x, r[:, :1], w, b, 1e-5, compressed) is None
    if w is not None:
        assert cpu.fast_add_forward(x, r, w[:-1], b, 1e-5, compressed) is None
