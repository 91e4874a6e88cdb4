"""The nn modules' call paths: the direct kernel call, the LayerNorm route of a zero-mean RMSNorm
(tiny inputs, or no C kernel at all) and the no-compiler fallback, each against float64."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from normfold import ops
from normfold.nn import CRMSNorm, RMSNorm, norms
from normfold.ops import cpu, reference

TOL = {torch.float32: 2e-6, torch.bfloat16: 4e-3, torch.float16: 5e-4}


def rel(a, b):
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).abs().max() / b.abs().max())


def zero_mean(shape, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, dtype=torch.float64, generator=g) * 3
    x[..., 0] += 40  # an outlier coordinate, as real streams have
    return (x - x.mean(-1, keepdim=True)).to(dtype)


def converted(n, dtype):
    ln = torch.nn.LayerNorm(n)
    with torch.no_grad():
        ln.weight.normal_()
    m = RMSNorm.from_layernorm(ln, keep_bias=False).to(dtype)
    assert m.zero_mean_input
    return m


@pytest.mark.parametrize("dtype", list(TOL))
@pytest.mark.parametrize("shape", [(1, 768), (16, 768), (1, 4096), (3, 767), (16, 4096), (2, 40, 767)])
def test_every_route_matches_float64(dtype, shape):
    m = converted(shape[-1], dtype)
    x = zero_mean(shape, dtype)
    want = reference.rms_norm(x.double(), m.weight.double(), None, m.eps)
    with torch.no_grad():
        got = m(x)
    # The LayerNorm route subtracts the stored x's mean (a rounding residue of the dtype): its error
    # against the float64 RMSNorm stays within the kernel's tolerance.
    assert got.dtype == dtype and rel(got, want) <= TOL[dtype], rel(got, want)


@pytest.mark.skipif(cpu.library() is None, reason="CPU kernel unavailable")
def test_tiny_inputs_take_the_layernorm_route_and_large_ones_the_kernel(monkeypatch):
    m = converted(768, torch.float32)
    calls = []
    real = torch.layer_norm
    monkeypatch.setattr(torch, "layer_norm", lambda *a, **k: calls.append(1) or real(*a, **k))
    with torch.no_grad():
        m(zero_mean((1, 768), torch.float32))
        assert calls == [1]
        m(zero_mean((64, 768), torch.float32))
        assert calls == [1]  # above LN_ROUTE_MAX_NUMEL: the kernel
    # a plain RMSNorm (input not known to be zero-mean) never takes the route
    plain = RMSNorm(768)
    x = torch.randn(1, 768) + 5
    with torch.no_grad():
        assert rel(plain(x), reference.rms_norm(x.double())) <= 2e-6
    assert calls == [1]


def test_gradients_are_rmsnorm_gradients_not_layernorm_ones():
    # With a gradient needed the route is not taken: LayerNorm's input gradient has no mean
    # component, RMSNorm's has one.
    m = converted(64, torch.float32)
    x = zero_mean((2, 64), torch.float32).requires_grad_()
    dy = torch.randn(2, 64)
    m(x).backward(dy)
    x64 = x.detach().double().requires_grad_()
    reference.rms_norm(x64, m.weight.detach().double(), None, m.eps).backward(dy.double())
    assert rel(x.grad, x64.grad) < 1e-5


def test_kernel_fast_path_equals_the_dispatcher():
    if cpu.library() is None:
        pytest.skip("CPU kernel unavailable")
    for dtype in TOL:
        x = torch.randn(64, 767).to(dtype)
        w = torch.randn(767).to(dtype)
        assert torch.equal(cpu.fast_forward(x, w, None, 1e-5, False), ops.rms_norm(x, w))
        assert torch.equal(cpu.fast_forward(x, w.float(), None, 1e-5, True), ops.crms_norm(x, w.float()))
        assert cpu.fast_forward(x[:, ::2], w[:384], None, 1e-5, False) is None  # not contiguous
        assert cpu.fast_forward(x, w[:5], None, 1e-5, False) is None  # the dispatcher raises instead


def test_forced_reference_backend_disables_the_module_shortcuts(monkeypatch):
    monkeypatch.setenv("NORMFOLD_BACKEND", "reference")
    ops.reload_environment()
    try:
        m = converted(768, torch.float32)
        calls = []
        monkeypatch.setattr(cpu, "fast_forward", lambda *a: calls.append(1))
        with torch.no_grad():
            m(zero_mean((1, 768), torch.float32))
            m(zero_mean((64, 768), torch.float32))
        assert calls == []
    finally:
        monkeypatch.undo()
        ops.reload_environment()


NO_COMPILER = r"""
import warnings, torch
warnings.simplefilter("ignore")
from normfold import ops
from normfold.nn import RMSNorm, CRMSNorm
from normfold.ops import cpu, reference
assert cpu.library() is None and cpu.status()["error"] == "no C compiler found", cpu.status()
ln = torch.nn.LayerNorm(767)
m = RMSNorm.from_layernorm(ln, keep_bias=False)
calls = []
real = torch.layer_norm
torch.layer_norm = lambda *a, **k: calls.append(1) or real(*a, **k)
for dtype, tol in ((torch.float32, 2e-6), (torch.bfloat16, 4e-3), (torch.float16, 5e-4)):
    x = torch.randn(300, 767, dtype=torch.float64)
    x = (x - x.mean(-1, keepdim=True)).to(dtype)
    with torch.no_grad():
        y = m.to(dtype)(x)
    want = reference.rms_norm(x.double(), m.weight.double())
    err = float((y.double() - want).abs().max() / want.abs().max())
    assert err <= tol, (dtype, err)
assert len(calls) == 3, calls  # every size takes the LayerNorm route without the kernel
c = CRMSNorm(766)
x = torch.randn(4, 766)
assert float((c(x).double() - reference.crms_norm(x.double())).abs().max()) < 1e-5
print("NO-COMPILER OK")
"""


def test_no_compiler_install_uses_the_layernorm_route(tmp_path):
    # What a user without a C compiler gets: CC pointing nowhere, an empty kernel cache.
    env = dict(os.environ, CC="/nonexistent/cc", NORMFOLD_CACHE=str(tmp_path))
    env.pop("NORMFOLD_CPU_KERNEL", None)
    env.pop("NORMFOLD_BACKEND", None)
    src = str(Path(ops.__file__).resolve().parents[2])
    env["PYTHONPATH"] = src + os.pathsep + env.get("PYTHONPATH", "")
    out = subprocess.run([sys.executable, "-c", NO_COMPILER], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and "NO-COMPILER OK" in out.stdout, out.stderr[-3000:]


@pytest.mark.parametrize("dtype", list(TOL))
@pytest.mark.parametrize("grad", [False, True])
def test_decode_sized_fused_call_is_the_unfused_pair(dtype, grad):
    """RMSNorm(x, residual) on a decode-sized input takes forward(s)'s LayerNorm route directly (one
    round of checks): the same (s, y) as the add and the plain call, bit for bit."""
    m = converted(768, dtype)
    x, r = zero_mean((1, 1, 768), dtype, 1), zero_mean((1, 1, 768), dtype, 2)
    if grad:
        x.requires_grad_(True)
    with torch.set_grad_enabled(grad):
        s, y = m(x, r)
        s_ref = x + r
        y_ref = m(s_ref)
    assert torch.equal(s, s_ref) and torch.equal(y, y_ref)
    assert rel(y, reference.rms_norm(s.double(), m.weight.double())) <= TOL[dtype]
    if grad:
        y.sum().backward()
        assert x.grad is not None
