"""The pycall extension (normfold/ops/pycall.py): the kernels called without ctypes.

It must be a pure calling-convention change: the same bits as the ctypes call on every entry point,
and when it cannot be built the kernels still run through ctypes, with the reason in `info()`.
"""

import subprocess

import pytest
import torch

from norm_cases import DTYPES, inputs, needs_kernel
from normfold import ops
from normfold.nn import CRMSNorm, RMSNorm
from normfold.ops import cpu, pycall

pytestmark = needs_kernel


def _ptr(t):
    return None if t is None else t.data_ptr()


def _ctypes_forward(lib, x, res, w, b, eps, compressed):
    """nf_forward through ctypes, everything written: (s, y, rstd)."""
    rows, n = x.numel() // x.shape[-1], x.shape[-1]
    y, s = torch.empty_like(x), (None if res is None else torch.empty_like(x))
    rstd = torch.empty(rows, dtype=torch.float32)
    code = cpu.DTYPE_CODES
    rc = lib.nf_forward(code[x.dtype], x.data_ptr(), n, _ptr(res), n, _ptr(w), 0 if w is None else code[w.dtype],
                        _ptr(b), 0 if b is None else code[b.dtype], y.data_ptr(), _ptr(s), rstd.data_ptr(), rows, n,
                        eps, compressed, 1)
    assert rc == 0
    return s, y, rstd


@pytest.fixture
def both_paths():
    """(pycall entry points, the ctypes library) in this process."""
    if cpu.status()["call"] != "pycall":
        pytest.skip(f"pycall extension not loaded here: {cpu.status()['call_note']}")
    return cpu._calls, cpu.library()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [1, 17, 767, 4097])
@pytest.mark.parametrize("compressed", [False, True])
def test_forward_is_bitwise_the_ctypes_call(both_paths, dtype, n, compressed):
    _, lib = both_paths
    for pdtype in (dtype, torch.float32):
        x, w, b = inputs((5, n), dtype)
        w, b = w.to(pdtype), b.to(pdtype)
        r = inputs((5, n), dtype, seed=1)[0]
        _, y0, rstd0 = _ctypes_forward(lib, x, None, w, b, 1e-5, compressed)
        y1, rstd1 = cpu.forward(x, w, b, 1e-5, compressed, True)
        assert torch.equal(y0, y1) and torch.equal(rstd0, rstd1)
        assert torch.equal(cpu.fast_forward(x, w, b, 1e-5, compressed), y0)  # the decode entry point
        s0, y0, rstd0 = _ctypes_forward(lib, x, r, w, b, 1e-5, compressed)
        s1, y1, rstd1 = cpu.add_forward(x, r, w, b, 1e-5, compressed, True)
        assert torch.equal(s0, s1) and torch.equal(y0, y1) and torch.equal(rstd0, rstd1)


@pytest.mark.parametrize("dtype", DTYPES)
def test_backward_is_bitwise_the_ctypes_call(both_paths, dtype):
    _, lib = both_paths
    x, w, _ = inputs((6, 129), dtype)
    dy, ds = inputs((6, 129), dtype, seed=2)[0], inputs((6, 129), dtype, seed=3)[0]
    _, _, rstd = _ctypes_forward(lib, x, None, w, None, 1e-5, False)
    dx0 = torch.empty_like(x)
    dw0 = torch.empty(1, 129, dtype=torch.float32)
    assert lib.nf_backward(cpu.DTYPE_CODES[dtype], dy.data_ptr(), ds.data_ptr(), x.data_ptr(), 129, w.data_ptr(),
                           cpu.DTYPE_CODES[dtype], rstd.data_ptr(), dx0.data_ptr(), dw0.data_ptr(), None, 6, 129, 0,
                           1) == 0
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one partial dweight row, as in the ctypes call
    try:
        dx1, dw1, db1 = cpu.backward(dy, x, w, rstd, False, True, False, ds=ds)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(dx0, dx1) and torch.equal(dw0[0], dw1) and db1 is None


def test_wrong_argument_counts_are_type_errors(both_paths):
    calls, _ = both_paths
    with pytest.raises(TypeError, match=r"forward takes 17 arguments \(2 given\)"):
        calls["forward"](0, 1)
    with pytest.raises(TypeError, match="backward takes 15 arguments"):
        calls["backward"]()
    with pytest.raises(TypeError):  # a non-integer address
        cpu._fast[0](0, "x", None, 0, None, 0, None, 1, 1, 1e-5, False, 1)


def test_disabled_by_environment_uses_ctypes(monkeypatch, fresh_library):
    monkeypatch.setenv("NORMFOLD_CPU_PYCALL", "0")
    ops.reload_environment()
    st = cpu.status()
    assert st["available"] and st["call"] == "ctypes" and st["call_note"] == "NORMFOLD_CPU_PYCALL=0"
    x = torch.randn(3, 768)
    ln = torch.nn.LayerNorm(768)
    ref = ops.reference.crms_norm(x[:, :-1].double())
    norm = CRMSNorm(767)
    with torch.inference_mode():
        assert float((norm(x[:, :-1].contiguous()).double() - ref).abs().max()) < 1e-5
        xz = x - x.mean(-1, keepdim=True)
        assert torch.allclose(RMSNorm.from_layernorm(ln)(xz.repeat(32, 1)), ln(xz.repeat(32, 1)), atol=1e-5)


def test_missing_python_headers_fall_back_to_ctypes(monkeypatch, tmp_path, fresh_library):
    monkeypatch.setenv("NORMFOLD_CACHE", str(tmp_path))
    monkeypatch.setattr(pycall, "_include_dir", lambda: str(tmp_path / "no-include"))
    ops.reload_environment()
    st = cpu.status()
    assert st["available"] and st["call"] == "ctypes"
    assert "no Python.h" in st["call_note"] and "development headers" in st["call_note"]
    x, w, b = inputs((4, 100), torch.float32)
    ref = ops.reference.rms_norm(x.double(), w.double(), b.double())
    assert float((cpu.fast_forward(x, w, b, 1e-5, False).double() - ref).abs().max()) < 1e-4
    assert not list((tmp_path / "kernels").glob("nf_pycall*"))


def test_failed_build_leaves_nothing_behind(tmp_path):
    mod, why = pycall.load("false", "false", tmp_path)
    assert mod is None and why.startswith("build failed")
    assert list(tmp_path.iterdir()) == []


def test_broken_cached_extension_is_reported_not_raised(tmp_path):
    cc = cpu._compiler() or "cc"
    ok, _ = pycall.load(cc, "id", tmp_path / "good")
    if ok is None:
        pytest.skip("the extension cannot be built here")
    # the same cache key in another directory, holding a corrupt file (never overwrite a loaded one:
    # its pages are mapped into this process)
    name = next((tmp_path / "good").glob("nf_pycall-*.so")).name
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / name).write_bytes(b"not an ELF file")
    mod, why = pycall.load(cc, "id", tmp_path / "bad")
    assert mod is None and ("ImportError" in why or "OSError" in why)


def test_build_error_text_is_kept(tmp_path, monkeypatch):
    def broken(cc, include, target):
        raise subprocess.CalledProcessError(1, [cc], stderr="nf_pycall.c:1: error: something")
    monkeypatch.setattr(pycall, "_build", broken)
    mod, why = pycall.load("cc", "id", tmp_path)
    assert mod is None and "nf_pycall.c:1: error: something" in why
