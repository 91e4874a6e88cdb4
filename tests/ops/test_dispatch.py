"""Dispatch: the backend registry, the environment switches, graceful fallback, torch.compile."""

import types

import pytest
import torch

from norm_cases import DTYPES, KERNEL_ACTIVE, TOL, check_backward, check_forward, needs_kernel, rel
from normfold import ops
from normfold.errors import NormfoldError, NormInputError
from normfold.ops import cpu, reference



@pytest.fixture
def empty_cache(monkeypatch, tmp_path, fresh_library):
    """No cached library and the kernel enabled, whatever the outer environment says."""
    monkeypatch.setenv("NORMFOLD_CACHE", str(tmp_path))
    monkeypatch.delenv("NORMFOLD_CPU_KERNEL", raising=False)
    monkeypatch.delenv("NORMFOLD_BACKEND", raising=False)
    ops.reload_environment()


def test_float64_and_other_devices_use_reference():
    assert ops.backend_for(torch.randn(2, 4, dtype=torch.float64)) == "reference"
    assert ops.backend_for(torch.randn(2, 4, device="meta")) == "reference"


@needs_kernel
def test_forced_reference_backend(monkeypatch, fresh_library):
    monkeypatch.setenv("NORMFOLD_BACKEND", "reference")
    ops.reload_environment()
    x = torch.randn(3, 10)
    assert ops.backend_for(x) == "reference"
    assert rel(ops.rms_norm(x), reference.rms_norm(x.double())) < 1e-6
    monkeypatch.setenv("NORMFOLD_BACKEND", "cpu-kernel")
    ops.reload_environment()
    assert ops.backend_for(x) == "cpu-kernel"


def test_kernel_disabled_by_environment(monkeypatch, fresh_library):
    monkeypatch.setenv("NORMFOLD_CPU_KERNEL", "0")
    ops.reload_environment()
    assert cpu.library() is None and cpu.status()["disabled"]
    assert ops.backend_for(torch.randn(2, 4)) == "reference"
    x = torch.randn(3, 10, requires_grad=True)
    assert rel(ops.rms_norm(x), reference.rms_norm(x.double())) < 1e-6
    s, y = ops.add_crms_norm(x, x)
    assert rel(y, reference.crms_norm(2 * x.double())) < 1e-6
    y.sum().backward()
    assert x.grad is not None


def test_build_failure_falls_back(monkeypatch, empty_cache):
    # A broken compiler must leave normfold working on the reference path, with one warning.
    monkeypatch.setattr(cpu, "_compiler", lambda: "false")
    with pytest.warns(RuntimeWarning, match="CPU kernel build failed"):
        assert cpu.library() is None
    assert cpu.status()["error"]
    assert ops.backend_for(torch.randn(2, 4)) == "reference"


def test_no_compiler_falls_back(monkeypatch, empty_cache):
    monkeypatch.setattr(cpu, "_compiler", lambda: None)
    assert cpu.library() is None
    assert cpu.status()["error"] == "no C compiler found"
    x = torch.randn(2, 9)
    assert rel(ops.crms_norm(x), reference.crms_norm(x.double())) < 1e-6


@needs_kernel
def test_portable_vector_build(monkeypatch, fresh_library):
    # The non-AVX-512 code (what AVX2, SSE or NEON machines run), built on this machine.
    monkeypatch.setenv("NORMFOLD_CPU_ISA", "generic")
    ops.reload_environment()
    assert cpu.status()["isa"] == "portable"
    for dtype in DTYPES:
        for compressed in (False, True):
            for shape in [(3, 5), (7, 768), (5, 4097)]:
                check_forward(compressed, dtype, shape, "both")
            check_backward(compressed, dtype, (9, 33), "both")
            check_backward(compressed, dtype, (300, 257), "weight")
        x, r = torch.randn(6, 50).to(dtype), torch.randn(6, 50).to(dtype)
        s, y = ops.add_rms_norm(x, r)
        assert torch.equal(s, x + r) and rel(y, reference.rms_norm(s.double())) <= TOL[dtype]


@needs_kernel
def test_library_is_cached_and_reused(fresh_library):
    lib = cpu.library()
    path = cpu.status()["library"]
    ops.reload_environment()
    assert cpu.library() is not None and cpu.status()["library"] == path
    assert lib is not None


def test_wrong_parameter_shape_is_a_user_error():
    x = torch.randn(2, 8)
    with pytest.raises(NormInputError, match=r"needs shape \(8,\)"):
        ops.rms_norm(x, torch.ones(7))
    with pytest.raises(NormfoldError):
        ops.add_crms_norm(x, x, None, torch.ones(2, 8))


class _Recorder:
    """A toy backend for float64 CPU tensors that computes with the reference ops and records calls."""

    def __init__(self):
        self.calls = []

    def supports(self, x):
        return x.dtype == torch.float64 and x.device.type == "cpu"

    def forward(self, x, weight, bias, eps, compressed, want_rstd):
        self.calls.append(("forward", compressed, want_rstd))
        y = (reference.crms_norm if compressed else reference.rms_norm)(x, weight, bias, eps)
        return y, (self._rstd(x, eps, compressed) if want_rstd else None)

    def add_forward(self, x, residual, weight, bias, eps, compressed, want_rstd):
        self.calls.append(("add_forward", compressed, want_rstd))
        s = x + residual
        y, rstd = self.forward(s, weight, bias, eps, compressed, want_rstd)
        return s, y, rstd

    def backward(self, dy, x, weight, rstd, compressed, need_dw, need_db, ds=None):
        self.calls.append(("backward", compressed, need_dw, need_db, ds is not None))
        xl = x.detach().requires_grad_()
        wl = None if weight is None else weight.detach().requires_grad_()
        with torch.enable_grad():
            y = (reference.crms_norm if compressed else reference.rms_norm)(xl, wl, None, 1e-5)
            dx, dw = torch.autograd.grad(y, (xl, wl) if wl is not None else (xl,), dy) + (None,) * (wl is None)
        if ds is not None:
            dx = dx + ds
        return dx, (dw if need_dw else None), (dy.reshape(-1, dy.shape[-1]).sum(0) if need_db else None)

    @staticmethod
    def _rstd(x, eps, compressed):
        d = x.shape[-1] + compressed
        ms = (x.square().sum(-1) + (x.sum(-1).square() if compressed else 0)) / d
        return torch.rsqrt(ms + eps).float()


def test_registered_backend_is_used_for_what_it_supports(monkeypatch, fresh_library):
    monkeypatch.delenv("NORMFOLD_BACKEND", raising=False)
    ops.reload_environment()
    rec = _Recorder()
    ops.register_backend("recorder", rec, priority=max(b.priority for b in ops.backends()) + 1)
    try:
        assert [b.name for b in ops.backends()][0] == "recorder"
        x = torch.randn(3, 6, dtype=torch.float64, requires_grad=True)
        w = torch.randn(6, dtype=torch.float64, requires_grad=True)
        b = torch.randn(6, dtype=torch.float64, requires_grad=True)
        assert ops.backend_for(x) == "recorder"
        assert ops.backend_for(x.float()) != "recorder"
        ops.rms_norm(x, w, b).sum().backward()
        assert rec.calls == [("forward", False, True), ("backward", False, True, True, False)]
        x64 = x.detach().requires_grad_()
        w64, b64 = w.detach().requires_grad_(), b.detach().requires_grad_()
        reference.rms_norm(x64, w64, b64).sum().backward()
        assert rel(x.grad, x64.grad) < 1e-12 and rel(w.grad, w64.grad) < 1e-12 and rel(b.grad, b64.grad) < 1e-12
        rec.calls.clear()
        s, y = ops.add_crms_norm(x.detach(), x.detach())  # no grad needed: no rstd asked for
        assert rec.calls == [("add_forward", True, False), ("forward", True, False)]
    finally:
        ops.unregister_backend("recorder")
    assert ops.backend_for(torch.randn(2, 2, dtype=torch.float64)) == "reference"


def test_incomplete_backend_is_rejected():
    with pytest.raises(TypeError, match="add_forward, backward"):
        ops.register_backend("broken", types.SimpleNamespace(supports=lambda x: True, forward=lambda *a: None))
    with pytest.raises(ValueError):
        ops.register_backend("reference", _Recorder())


def _graph_targets(fn, *args):
    """Call torch.compile(fn) on args with a backend that records the traced graph's ops."""
    seen = []

    def backend(gm, example_inputs):
        seen.extend(str(node.target) for node in gm.graph.nodes)
        return gm.forward

    out = torch.compile(fn, backend=backend, fullgraph=True)(*args)
    return out, seen


def test_torch_compile_sees_no_graph_break(monkeypatch):
    # fullgraph=True: the ops trace without a break, whichever path they take.
    from normfold.nn import AddRMSNorm, CRMSNorm, RMSNorm

    monkeypatch.setattr(ops, "COMPILE_KERNEL_MIN_NUMEL", 0)  # these tiny inputs take the kernel path

    norm, cnorm, add = RMSNorm(16, bias=True), CRMSNorm(15), AddRMSNorm(16)

    def f(x, r):
        s, y = add(x, r)
        return norm(y) + s, cnorm(x[..., :15])

    x, r = torch.randn(4, 16), torch.randn(4, 16)
    out, seen = _graph_targets(f, x, r)
    for got, want in zip(out, f(x, r)):
        assert rel(got, want) < 1e-6
    if KERNEL_ACTIVE:  # compiled code calls the kernels as opaque custom ops
        assert any("normfold.rms_norm_cpu" in t for t in seen) and any("normfold.add_rms_norm_cpu" in t for t in seen)
    x64 = x.double()
    _, seen64 = _graph_targets(lambda t: ops.rms_norm(t), x64)
    assert not any("normfold" in t for t in seen64)  # float64: the reference formula is traced


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_training_uses_kernel_gradients(dtype, monkeypatch):
    from normfold.nn import AddCRMSNorm, RMSNorm

    monkeypatch.setattr(ops, "COMPILE_KERNEL_MIN_NUMEL", 0)

    torch.manual_seed(0)
    norm, add = RMSNorm(24, bias=True).to(dtype), AddCRMSNorm(23).to(dtype)
    with torch.no_grad():
        for p in (*norm.parameters(), *add.parameters()):
            p.normal_()

    def f(x, r, xc, rc):
        s, y = add(xc, rc)
        return (norm(x + r) * 1.5).sum() + (y * s).sum()

    inputs = [torch.randn(5, 24 - i // 2, dtype=dtype, requires_grad=True) for i in range(4)]
    params = [*norm.parameters(), *add.parameters()]
    f(*inputs).backward()
    want = [t.grad.clone() for t in (*inputs, *params)]
    for t in (*inputs, *params):
        t.grad = None
    torch.compile(f, backend="aot_eager", fullgraph=True)(*inputs).backward()
    for t, w in zip((*inputs, *params), want):
        assert t.grad.dtype == t.dtype and rel(t.grad, w) <= 4 * TOL[dtype]


def test_small_inputs_are_left_to_the_compiler():
    # below COMPILE_KERNEL_MIN_NUMEL compiled code traces the reference formula (inductor fuses it)
    small = torch.randn(4, 16)
    _, seen = _graph_targets(lambda t: ops.rms_norm(t), small)
    assert not any("normfold" in t for t in seen)
    if KERNEL_ACTIVE:
        big = torch.randn(ops.COMPILE_KERNEL_MIN_NUMEL // 256, 256)
        _, seen = _graph_targets(lambda t: ops.rms_norm(t), big)
        assert any("normfold.rms_norm_cpu" in t for t in seen)
