"""The Triton kernels (normfold.ops.triton_kernels) against the float64 reference: outputs and gradients.

On a CUDA machine they run on the GPU. Without one they run on CPU tensors in Triton's interpreter,
which must be switched on (TRITON_INTERPRET=1) before triton is first imported: tests/conftest.py
does that. Without the `triton` package everything here is skipped.
"""

import os
import subprocess
import sys

import pytest
import torch

from normfold import ops
from normfold.ops import reference, triton_kernels as tk

HAS_CUDA = torch.cuda.is_available()

if not tk.available():
    pytest.skip("the triton package is not installed (pip install triton)", allow_module_level=True)
if not HAS_CUDA and not tk.interpreting():
    pytest.skip("no CUDA, and TRITON_INTERPRET=1 was not set before triton was imported",
                allow_module_level=True)

DEVICE = "cuda" if HAS_CUDA else "cpu"
# Max |error| / max |reference|. Half precision: one rounding of the output (the interpreter
# truncates float32 -> bfloat16 instead of rounding to nearest, hence up to one full ulp).
TOL = {torch.float32: 5e-6, torch.bfloat16: 8e-3, torch.float16: 1e-3}
SHAPES = [(1, 1), (3, 5), (2, 3, 129), (33, 1000)]


def _inputs(shape, dtype, outliers=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, dtype=torch.float64, generator=g)
    if outliers:  # a few huge coordinates, like GPT-2's residual stream
        x[..., 0] *= 300
        x[..., -1] -= 50
    d = shape[-1]
    w, b = torch.randn(d, dtype=torch.float64, generator=g), torch.randn(d, dtype=torch.float64, generator=g)
    return x.to(DEVICE, dtype), w.to(DEVICE, dtype), b.to(DEVICE, dtype)


def _rel(a, b):
    return float((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30))


def _d(t):
    return None if t is None else t.double()


def _ref(compressed):
    return reference.crms_norm if compressed else reference.rms_norm


@pytest.mark.parametrize("dtype", list(TOL))
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("affine", ["none", "weight", "bias", "both"])
@pytest.mark.parametrize("compressed", [False, True])
def test_forward_matches_float64_reference(dtype, shape, affine, compressed):
    x, w, b = _inputs(shape, dtype, outliers=shape[-1] > 4)
    w = w if affine in ("weight", "both") else None
    b = b if affine in ("bias", "both") else None
    y, rstd = tk.forward(x, w, b, 1e-5, compressed, want_rstd=True)
    want = _ref(compressed)(x.double(), _d(w), _d(b), 1e-5)
    assert y.dtype == dtype and y.shape == x.shape and rstd.shape == x.shape[:-1]
    assert _rel(y, want) <= TOL[dtype]
    xd = x.double()
    ms = xd.square().mean(-1) if not compressed else (xd.square().sum(-1) + xd.sum(-1).square()) / (shape[-1] + 1)
    assert _rel(rstd, torch.rsqrt(ms + 1e-5)) <= 5e-6


def test_float32_weight_on_half_input_is_applied_in_float32():
    x, _, _ = _inputs((4, 64), torch.bfloat16)
    w = torch.randn(64, dtype=torch.float64).to(DEVICE, torch.float32) * 1.001
    y, _ = tk.forward(x, w, None, 1e-5, False, want_rstd=False)
    assert _rel(y, reference.rms_norm(x.double(), w.double(), None, 1e-5)) <= TOL[torch.bfloat16]


@pytest.mark.parametrize("dtype", list(TOL))
@pytest.mark.parametrize("compressed", [False, True])
@pytest.mark.parametrize("shape", [(4, 7), (3, 2, 257), (40, 768)])
@pytest.mark.parametrize("affine", ["none", "both"])
def test_backward_matches_float64_autograd(dtype, compressed, shape, affine):
    x, w, b = _inputs(shape, dtype, seed=1)
    if affine == "none":
        w = b = None
    dy = torch.randn(shape, dtype=torch.float64).to(DEVICE, dtype)
    leaves64 = [None if t is None else t.double().requires_grad_() for t in (x, w, b)]
    _ref(compressed)(*leaves64, 1e-5).backward(dy.double())
    leaves = [None if t is None else t.clone().requires_grad_() for t in (x, w, b)]
    ops_fn = tk.norm(*leaves, 1e-5, compressed)
    ops_fn.backward(dy)
    for got, want in zip(leaves, leaves64):
        if got is None:
            continue
        assert got.grad.dtype == got.dtype
        # dx is rounded once to the input dtype; dweight/dbias sum over rows in float32 first
        assert _rel(got.grad, want.grad) <= 2 * TOL[dtype]


@pytest.mark.parametrize("dtype", list(TOL))
@pytest.mark.parametrize("compressed", [False, True])
def test_fused_add_norm_forward(dtype, compressed):
    x, w, b = _inputs((9, 300), dtype, seed=2)
    res, _, _ = _inputs((9, 300), dtype, outliers=True, seed=3)
    s, y, rstd = tk.add_forward(x, res, w, b, 1e-5, compressed, want_rstd=True)
    want_s = x + res  # torch adds in float32 and rounds once, like the kernel
    if HAS_CUDA or dtype == torch.float32:
        assert torch.equal(s, want_s)
    else:  # the interpreter truncates instead of rounding to nearest: at most one ulp apart
        assert _rel(s, want_s.double()) <= TOL[dtype]
    # y normalizes the stored (rounded) sum, exactly like the unfused pair of ops
    assert _rel(y, _ref(compressed)(s.double(), w.double(), b.double(), 1e-5)) <= TOL[dtype]
    assert rstd.shape == (9,)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("compressed", [False, True])
@pytest.mark.parametrize("use_sum", [True, False])
def test_fused_add_norm_backward(dtype, compressed, use_sum):
    x, w, b = _inputs((6, 2, 130), dtype, seed=4)
    res, _, _ = _inputs((6, 2, 130), dtype, seed=5)
    dy = torch.randn(x.shape, dtype=torch.float64).to(DEVICE, dtype)
    ds = torch.randn(x.shape, dtype=torch.float64).to(DEVICE, dtype)

    def loss(s, y):
        out = (y.double() * dy.double()).sum()
        return out + (s.double() * ds.double()).sum() if use_sum else out

    l64 = [t.double().requires_grad_() for t in (x, res, w, b)]
    s64 = l64[0] + l64[1]
    loss(s64, _ref(compressed)(s64, l64[2], l64[3], 1e-5)).backward()
    lk = [t.clone().requires_grad_() for t in (x, res, w, b)]
    loss(*tk.add_norm(*lk, 1e-5, compressed)).backward()
    for got, want in zip(lk, l64):
        assert _rel(got.grad, want.grad) <= 2 * TOL[dtype]


def test_rejects_mismatched_parameters():
    x, w, _ = _inputs((2, 8), torch.float32)
    with pytest.raises(ValueError, match="weight has 7 elements"):
        tk.forward(x, w[:7], None, 1e-5, False, want_rstd=False)
    with pytest.raises(ValueError, match="residual"):
        tk.add_forward(x, x[:, :4], None, None, 1e-5, False, want_rstd=False)


def test_never_selected_for_cpu_tensors():
    assert not tk.supports(torch.randn(2, 8))
    assert ops.backend_for(torch.randn(2, 8, dtype=torch.float64)) == "reference"


def test_importing_normfold_does_not_import_triton():
    code = "import sys, normfold, normfold.ops, normfold.nn; sys.exit('triton' in sys.modules)"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    assert subprocess.run([sys.executable, "-c", code], env=env, timeout=120).returncode == 0


class _FakeKernel:
    """Records launches instead of running them (for the launch-path logic, which needs no GPU)."""

    def __init__(self, log, name, best=None):
        self.log, self.name, self.best_config = log, name, best

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            meta = {**kwargs, **(self.best_config.kwargs if self.best_config else {})}  # as the autotuner does
            self.log.append((self.name, grid(meta) if callable(grid) else grid, kwargs))
        return launch


def test_autotuned_launch_tunes_once_then_calls_the_kernel_with_the_chosen_config(monkeypatch):
    import triton

    log = []
    best = triton.Config({"BLOCK_M": 4}, num_warps=8)
    fake = {"fwd": _FakeKernel(log, "fwd"), "fwd_tuned": _FakeKernel(log, "fwd_tuned", best),
            "bwd": _FakeKernel(log, "bwd"), "bwd_tuned": _FakeKernel(log, "bwd_tuned", triton.Config({}, num_warps=4))}
    monkeypatch.setattr(tk, "_kernels", lambda: fake)
    monkeypatch.setattr(tk, "_tuned", lambda: True)
    monkeypatch.setattr(tk, "_CHOSEN", {})
    # CPU tensors run only under TRITON_INTERPRET (set by conftest without a GPU); on a GPU, CUDA ones
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    x = torch.randn(37, 768, device=dev)
    for _ in range(3):
        tk.forward(x, None, None, 1e-5, False, want_rstd=False)
    tk.forward(x, None, None, 1e-5, True, want_rstd=False)  # a different kernel specialization: tuned again
    names = [entry[0] for entry in log]
    assert names == ["fwd_tuned", "fwd", "fwd", "fwd_tuned"]
    _, grid, kwargs = log[1]
    assert kwargs["BLOCK_M"] == 4 and kwargs["num_warps"] == 8 and grid == (10,)  # ceil(37 / 4)
    tk.backward(torch.randn(37, 768, device=dev), x, None, torch.ones(37, device=dev), False, need_dw=False,
                need_db=True)
    tk.backward(torch.randn(37, 768, device=dev), x, None, torch.ones(37, device=dev), False, need_dw=False,
                need_db=True)
    assert [entry[0] for entry in log[4:]] == ["bwd_tuned", "bwd"] and log[5][2]["num_warps"] == 4


@pytest.mark.parametrize("n", [1, 7, 768, 1023, 4096, 65536])
@pytest.mark.parametrize("rows", [1, 512, 8192])
def test_launch_configurations_are_valid(n, rows):
    import triton

    tk._triton()
    for cfg in tk._prune_fwd(tk._fwd_configs(), {"n": n, "rows": rows}):
        bm, warps = cfg.kwargs["BLOCK_M"], cfg.num_warps
        assert bm in (1, 2, 4, 8, 16) and warps in (1, 2, 4, 8, 16, 32)
        assert bm * triton.next_power_of_2(n) <= max(32768, triton.next_power_of_2(n))
    assert tk._prune_bwd(tk._bwd_configs(), {"n": n, "rows": rows})
    bm, warps = tk._fwd_heuristic(rows, tk._pow2(n), torch.bfloat16, 132)
    assert 1 <= bm <= 16 and 1 <= warps <= 32 and (bm == 1 or tk._cdiv(rows, bm) >= 2 * 132)
    assert tk._pow2(n) == triton.next_power_of_2(n)


# ---- on a GPU only -----------------------------------------------------------------------------------

cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("dtype", list(TOL))
@pytest.mark.parametrize("compressed", [False, True])
def test_dispatch_uses_triton_on_cuda(dtype, compressed, monkeypatch):
    from normfold.nn import CRMSNorm, RMSNorm

    x, _, _ = _inputs((64, 768), dtype, seed=6)
    assert ops.backend_for(x) == "triton"
    m = (CRMSNorm if compressed else RMSNorm)(768, bias=True).to(DEVICE)
    with torch.no_grad():
        m.weight.normal_()
        m.bias.normal_()
    want = _ref(compressed)(x.double(), m.weight.double(), m.bias.double(), m.eps)
    assert _rel(m(x), want) <= TOL[dtype]
    monkeypatch.setenv("NORMFOLD_TRITON", "0")
    assert ops.backend_for(x) == "reference"


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("shape", [(512, 768), (4096, 1023), (8, 65536)])
@pytest.mark.parametrize("autotune", ["1", "0"])
def test_large_shapes_and_both_launch_paths(shape, autotune, monkeypatch):
    monkeypatch.setenv("NORMFOLD_TRITON_AUTOTUNE", autotune)
    x, w, b = _inputs(shape, torch.bfloat16, seed=7)
    y, _ = tk.forward(x, w, b, 1e-6, False, want_rstd=False)
    assert _rel(y, reference.rms_norm(x.double(), w.double(), b.double(), 1e-6)) <= TOL[torch.bfloat16]
    xr = x.clone().requires_grad_()
    tk.norm(xr, w, None, 1e-6).float().sum().backward()
    x64 = x.double().requires_grad_()
    reference.rms_norm(x64, w.double(), None, 1e-6).sum().backward()
    assert _rel(xr.grad, x64.grad) <= 2 * TOL[torch.bfloat16]


@pytest.mark.cuda
@cuda
def test_matches_torch_rms_norm_on_cuda():
    x, w, _ = _inputs((256, 1024), torch.float32, seed=8)
    y, _ = tk.forward(x, w, None, 1e-5, False, want_rstd=False)
    assert _rel(y, torch.nn.functional.rms_norm(x, (1024,), w, 1e-5)) <= 1e-5
