"""Every op normfold puts into a model exports (issue 28, item 1): torch.export gives ATen-only
programs, the ONNX dynamo exporter translates each op at opset 18 (decomposed) and 23 (standard
`RMSNormalization` where it is an RMSNorm), onnxruntime computes the float64 reference's values,
and torch.compile(fullgraph=True) still calls the C kernels. Inputs are forced to the sizes where
the kernel's custom op is chosen under tracing (the case that used to fail)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from export_checks import export_onnx, kernel_sizes, need_onnx, op_types, rel, run_ort  # noqa: F401
from normfold import ops
from normfold.nn import AddCRMSNorm, AddRMSNorm, CRMSNorm, NormLinear, Recenter, RMSNorm
from normfold.nn.hooks import add_output_recenter
from normfold.ops import cpu, cpu_library

KERNEL_ACTIVE = cpu.library() is not None and ops.backend_for(torch.ones(1, 2)) == "cpu-kernel"
D = 96
TOL = 1e-5  # float32 export against the float64 reference, relative to the largest value


def _perturbed(m: nn.Module) -> nn.Module:
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(0.5 * torch.randn(p.shape, generator=g) + (1 if p.dim() == 1 else 0))
    return m.eval()


class Norm(nn.Module):
    def __init__(self, norm):
        super().__init__()
        self.norm = norm

    def forward(self, x, r):
        return self.norm(x)


class CNorm(Norm):
    def forward(self, x, r):
        return self.norm(x[..., :-1])


class Add(Norm):
    def forward(self, x, r):
        s, y = self.norm(x, r)
        return s, y


class CAdd(Norm):
    def forward(self, x, r):
        return self.norm(x[..., :-1], r[..., :-1])


class Hooked(nn.Module):
    """An explicit Recenter as a forward hook (how a conversion recentres a non-linear stem)."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Linear(D, D)
        add_output_recenter(self.stem)
        self.norm = RMSNorm(D, weight=False)

    def forward(self, x, r):
        return self.norm(torch.nn.functional.gelu(self.stem(x)) + Recenter()(r))


class Readers(nn.Module):
    """NormLinear (the norm folded into its reader), plain and compressed."""

    def __init__(self):
        super().__init__()
        self.q = NormLinear(nn.Linear(D, 32))
        self.c = NormLinear(nn.Linear(D - 1, 32, bias=False), compressed=True)

    def forward(self, x, r):
        return self.q(x), self.c(r[..., :-1])


# name -> (module factory, whether ONNX opset 23 holds RMSNormalization)
CASES = {
    "rmsnorm_affine": (lambda: Norm(RMSNorm(D, bias=True)), True),
    "rmsnorm_plain": (lambda: Norm(RMSNorm.from_layernorm(nn.LayerNorm(D), keep_weight=False, keep_bias=False)), True),
    "crmsnorm": (lambda: CNorm(CRMSNorm(D - 1, bias=True)), False),
    "add_rmsnorm": (lambda: Add(AddRMSNorm(D, weight=False)), True),
    "add_crmsnorm": (lambda: CAdd(AddCRMSNorm(D - 1)), False),
    "recenter": (lambda: Hooked(), True),
    "norm_linear": (lambda: Readers(), False),
}


def _inputs(dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 40, D, generator=g, dtype=torch.float64)
    x[..., 3] *= 50  # an outlier channel, like GPT-2's stream
    r = torch.randn(2, 40, D, generator=g, dtype=torch.float64)
    x, r = x - x.mean(-1, keepdim=True), r - r.mean(-1, keepdim=True)
    return x.to(dtype), r.to(dtype)


def _build(name):
    torch.manual_seed(0)
    return _perturbed(CASES[name][0]())


def _flat(out):
    return list(out) if isinstance(out, (tuple, list)) else [out]


def _reference(model, x, r):
    """The same module in float64, eager (normfold's float64 reference path)."""
    with torch.no_grad():
        return [o.double() for o in _flat(copy.deepcopy(model).double()(x.double(), r.double()))]


@pytest.mark.parametrize("opset", [18, 23])
@pytest.mark.parametrize("name", list(CASES))
def test_onnx_export_runs_in_onnxruntime(name, opset, tmp_path, kernel_sizes):
    need_onnx()
    model, (x, r) = _build(name), _inputs()
    program = export_onnx(model, (x, r), opset=opset)
    got = run_ort(program, tmp_path / "m.onnx", [x, r])
    want = _reference(model, x, r)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert rel(g, w) <= TOL
    types = op_types(program)
    assert not any(t.startswith("normfold") for t in types)
    if opset >= 23 and CASES[name][1]:
        assert "RMSNormalization" in types
    if opset < 23:
        assert "RMSNormalization" not in types


@pytest.mark.parametrize("name", list(CASES))
def test_torch_export_holds_only_aten_ops(name, kernel_sizes):
    model, (x, r) = _build(name), _inputs()
    ep = torch.export.export(model, (x, r))
    targets = {str(n.target) for n in ep.graph.nodes if n.op == "call_function"}
    assert all(t.startswith("aten.") or "getitem" in t for t in targets), targets
    core = ep.run_decompositions()
    targets = {str(n.target) for n in core.graph.nodes if n.op == "call_function"}
    assert all(t.startswith("aten.") or "getitem" in t for t in targets), targets
    with torch.no_grad():
        got = _flat(core.module()(x, r))
    for g, w in zip(got, _reference(model, x, r)):
        assert rel(g, w) <= TOL


class _Direct(nn.Module):
    """Calls the custom ops themselves (a graph traced by other means than normfold's modules)."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(1 + 0.5 * torch.randn(D))
        self.b = nn.Parameter(0.5 * torch.randn(D - 1))

    def forward(self, x, r):
        y = cpu_library.norm(x, self.w, None, 1e-5, False)
        s, yc = cpu_library.add_norm(x[..., :-1], r[..., :-1], None, self.b, 1e-6, True)
        return y, s, yc


@pytest.mark.skipif(not KERNEL_ACTIVE, reason="CPU kernel unavailable or not selected")
def test_custom_ops_have_aten_decompositions(tmp_path):
    model, (x, r) = _Direct().eval(), _inputs()
    with torch.no_grad():
        want = [o.double() for o in model(x, r)]
        ref = (ops.reference.rms_norm(x.double(), model.w.double(), None, 1e-5),
               *ops.reference.crms_norm(x.double()[..., :-1] + r.double()[..., :-1], None, model.b.double(), 1e-6)[None])
    assert rel(want[0], ref[0]) <= TOL and rel(want[2], ref[1]) <= TOL
    ep = torch.export.export(model, (x, r))
    assert any("normfold" in str(n.target) for n in ep.graph.nodes)
    table = torch.export.default_decompositions()
    table.update(ops.decompositions())
    core = ep.run_decompositions(table)
    assert not any("normfold" in str(n.target) for n in core.graph.nodes)
    with torch.no_grad():
        for g, w in zip(core.module()(x, r), want):
            assert rel(g, w) <= TOL
    if all(pytest.importorskip(m) for m in ("onnx", "onnxscript", "onnxruntime")):
        for opset in (18, 23):  # the exporter applies the registered decompositions by itself
            program = export_onnx(model, (x, r), opset=opset)
            assert ("RMSNormalization" in op_types(program)) == (opset >= 23)
            for g, w in zip(run_ort(program, tmp_path / f"d{opset}.onnx", [x, r]), want):
                assert rel(g, w) <= TOL


@pytest.mark.skipif(not KERNEL_ACTIVE, reason="CPU kernel unavailable or not selected")
@pytest.mark.parametrize("compressed", [False, True])
@pytest.mark.parametrize("with_ds", [False, True])
def test_backward_decomposition_matches_kernel(compressed, with_ds):
    g = torch.Generator().manual_seed(5)
    x, dy, ds = (torch.randn(6, 33, generator=g) for _ in range(3))
    w = 1 + 0.5 * torch.randn(33, generator=g)
    ms = (x.double().pow(2).sum(-1) + (x.double().sum(-1).pow(2) if compressed else 0)) / (33 + compressed)
    rstd = torch.rsqrt(ms + 1e-5).float()
    op = torch.ops.normfold.rms_norm_cpu_backward.default
    args = (dy, ds if with_ds else None, x, w, rstd, compressed, True, True)
    for got, want in zip(ops.decompositions()[op](*args), op(*args)):
        assert got.shape == want.shape and rel(got, want) <= 1e-5


def test_compile_fullgraph_keeps_the_kernels(kernel_sizes):
    """torch.compile is not an export: it still sees the opaque kernels (faster than inductor's code)."""
    model, (x, r) = _build("add_rmsnorm"), _inputs()
    seen = []

    def backend(gm, example_inputs):
        seen.extend(str(n.target) for n in gm.graph.nodes)
        return gm.forward

    with torch.no_grad():
        got = torch.compile(model, backend=backend, fullgraph=True)(x, r)
    for g, w in zip(got, _reference(model, x, r)):
        assert rel(g, w) <= TOL
    if KERNEL_ACTIVE:
        assert any("normfold.add_rms_norm_cpu" in t for t in seen)


def test_exported_program_runs_without_normfold(tmp_path, kernel_sizes):
    """A saved torch.export program of normfold's ops loads and runs in a process where normfold
    cannot be imported (what ExecuTorch / AOTInductor packaging needs)."""
    import subprocess
    import sys

    class All(nn.Module):
        def __init__(self):
            super().__init__()
            self.add, self.c, self.r = AddRMSNorm(D, weight=False), CRMSNorm(D - 1, bias=True), Readers()

        def forward(self, x, r):
            s, y = self.add(x, r)
            return (y, self.c(s[..., :-1]), *self.r(s, r))

    model, (x, r) = _perturbed(All()), _inputs()
    ep = torch.export.export(model, (x, r))
    torch.export.save(ep, str(tmp_path / "ep.pt2"))
    torch.save({"x": x, "r": r}, str(tmp_path / "in.pt"))
    code = (
        "import sys; sys.modules['normfold'] = None\n"  # any import of normfold now fails
        "import torch\n"
        f"ep = torch.export.load({str(tmp_path / 'ep.pt2')!r})\n"
        f"d = torch.load({str(tmp_path / 'in.pt')!r})\n"
        "out = ep.run_decompositions().module()(d['x'], d['r'])\n"
        f"torch.save(list(out), {str(tmp_path / 'out.pt')!r})\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    for g, w in zip(torch.load(str(tmp_path / "out.pt")), _reference(model, x, r)):
        assert rel(g, w) <= TOL
