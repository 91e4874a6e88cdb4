"""Fast CPU RMSNorm / CRMSNorm: a small C library built on first use and called through ctypes.

Why this path: on CPU, torch's F.layer_norm is a fused kernel while F.rms_norm is composed of
several ops and runs 1.2–16× slower than LayerNorm, so a plain swap would make converted models
slower. The C kernels (csrc/) read each row once and need only a C compiler: no torch headers, so a
build takes about two seconds, once.

ISA paths, chosen at load time from what the CPU reports (/proc/cpuinfo flags, else
`torch.backends.cpu.get_cpu_capability()`), each its own library built with explicit flags:
`avx512` (AVX-512 F/BW/VL, -march=native), `avx2` (AVX2+FMA+F16C, -mavx2 -mfma -mf16c), `neon`
(aarch64) and `portable` (vector extensions, no ISA flags). A path whose build fails falls back to
the next lower one (avx512 → avx2 → portable, neon → portable), each tried with and without
OpenMP. Libraries are cached under $NORMFOLD_CACHE (default ~/.cache/normfold) keyed by source,
flags, compiler and CPU.

NORMFOLD_CPU_ISA=avx512|avx2|neon|portable forces a path (e.g. the AVX2 code on an AVX-512 machine,
to measure both on one CPU; `generic` is an alias of `portable`); a path the CPU cannot run is
refused with a warning and the best supported one is used. If no compiler is found or every build
fails, `library()` returns None (with one warning) and the dispatcher uses the PyTorch fallback
(normfold.ops). NORMFOLD_CPU_KERNEL=0 forces that fallback. Both variables are read when the
library is first needed (call `reset()` after changing them at run time): reading the environment
on every call would cost more than a small norm itself.

Backend interface (see normfold.ops.registry): `supports`, `forward`, `add_forward`, `backward`.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import threading
import warnings
from pathlib import Path

import torch
from torch import Tensor

from . import pycall
from ._build import compile_to

_CSRC = Path(__file__).with_name("csrc")
_SOURCE = _CSRC / "rmsnorm_cpu.c"
_ABI_VERSION = 4
_COMMON = ["-O3", "-shared", "-fPIC"]
# Compiler flags of each ISA path (see csrc/nf_simd.h) and the path to try when its build fails.
ISA_FLAGS = {
    "avx512": ["-march=native"],  # only chosen on CPUs with AVX-512 F/BW/VL; picks up AVX512_BF16
    "avx2": ["-mavx2", "-mfma", "-mf16c"],
    "neon": [],  # NEON is baseline on aarch64
    "portable": ["-DNF_FORCE_GENERIC"],
}
ISA_FALLBACK = {"avx512": "avx2", "avx2": "portable", "neon": "portable", "portable": None}
ISA_ALIASES = {"generic": "portable", "vector": "portable", "x86-64-v3": "avx2", "x86-64-v4": "avx512"}
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
_PARAM_FAST = frozenset(DTYPE_CODES)
ISA_NAMES = {2: "avx512", 3: "avx2", 4: "neon", 1: "portable"}

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_tried = False
_build_error: str | None = None
_lib_path: str | None = None
_dtypes: frozenset = frozenset()  # dtypes the loaded library handles (empty when unavailable)
_disabled = False
_isa_detected: str | None = None
_isa_requested: str | None = None
_isa_note: str | None = None
_fast: list = [None, {}]  # [nf_forward_simple, {dtype: code}] of the loaded library (see fast_forward)
# How the kernels are called: the pycall extension's functions when it loads, else ctypes' (pycall.py).
_calls: dict = {"forward": None, "backward": None, "via": None, "note": None}


def cache_dir() -> Path:
    root = os.environ.get("NORMFOLD_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "normfold")
    return Path(root) / "kernels"


def _env_off(name: str, default: str = "1") -> bool:
    return os.environ.get(name, default).lower() in ("0", "false", "off", "no")


def disabled() -> bool:
    return _env_off("NORMFOLD_CPU_KERNEL")


def _cpu_flags() -> frozenset:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def detect_isa() -> str:
    """The best ISA path this CPU can run."""
    machine = platform.machine().lower()
    if machine in ("aarch64", "arm64"):
        return "neon"
    if machine not in ("x86_64", "amd64", "x64"):
        return "portable"
    flags = _cpu_flags()
    if not flags:  # no /proc/cpuinfo: ask torch (its capability includes the OS's AVX state)
        try:
            cap = torch.backends.cpu.get_cpu_capability().upper()
        except (AttributeError, RuntimeError):
            cap = ""
        return "avx512" if cap.startswith("AVX512") else "avx2" if cap == "AVX2" else "portable"
    if {"avx512f", "avx512bw", "avx512vl"} <= flags:
        return "avx512"
    if {"avx2", "fma", "f16c"} <= flags:
        return "avx2"
    return "portable"


def _chain(isa: str) -> list[str]:
    out = []
    while isa is not None:
        out.append(isa)
        isa = ISA_FALLBACK[isa]
    return out


def _requested_isa() -> tuple[str, str | None]:
    """(path to start from, note): the detected path, or NORMFOLD_CPU_ISA when the CPU can run it."""
    best = detect_isa()
    want = os.environ.get("NORMFOLD_CPU_ISA", "").strip().lower()
    if not want or want in ("auto", "native"):
        return best, None
    want = ISA_ALIASES.get(want, want)
    if want not in ISA_FLAGS:
        return best, f"NORMFOLD_CPU_ISA={want!r} is not one of {', '.join(ISA_FLAGS)}; using {best}"
    if want not in _chain(best):
        return best, f"NORMFOLD_CPU_ISA={want} cannot run on this CPU (best: {best}); using {best}"
    return want, None


def _compiler() -> str | None:
    """$CC when set (and only it: CC=/nonexistent means no compiler), else cc, gcc or clang."""
    env = os.environ.get("CC")
    if env:
        return env if shutil.which(env) else None
    for cc in ("cc", "gcc", "clang"):
        if shutil.which(cc):
            return cc
    return None


def _compiler_id(cc: str) -> str:
    try:
        return subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return cc


def _cpu_signature() -> str:
    # -march=native code must not be reused on a different CPU sharing the cache directory.
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return hashlib.sha256(line.encode()).hexdigest()[:16]
    except OSError:
        pass
    return platform.processor()


def _sources() -> bytes:
    """Every file the build reads (the .c and its headers), for the cache key."""
    return _SOURCE.read_bytes() + b"".join(h.read_bytes() for h in sorted(_CSRC.glob("*.h")))


def _build(cc: str, flags: list[str], target: Path) -> None:
    compile_to([cc, *flags, str(_SOURCE), "-lm"], target, timeout=300)


def _declare(lib: ctypes.CDLL) -> None:
    P, I64, F, I = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int
    for name in ("nf_abi_version", "nf_isa"):
        getattr(lib, name).restype = I
        getattr(lib, name).argtypes = []
    lib.nf_supports_dtype.argtypes = [I]
    lib.nf_supports_dtype.restype = I
    # dtype, x, xs, res, rst, w, wdt, b, bdt, y, s, rstd, rows, n, eps, compressed, nthreads
    lib.nf_forward.argtypes = [I, P, I64, P, I64, P, I, P, I, P, P, P, I64, I64, F, I, I]
    lib.nf_forward.restype = I
    # dtype, x, w, wdt, b, bdt, y, rows, n, eps, compressed, nthreads
    lib.nf_forward_simple.argtypes = [I, P, P, I, P, I, P, I64, I64, F, I, I]
    lib.nf_forward_simple.restype = I
    # dtype, dy, ds, x, xs, w, wdt, rstd, dx, dw_part, db_part, rows, n, compressed, nthreads
    lib.nf_backward.argtypes = [I, P, P, P, I64, P, I, P, P, P, P, I64, I64, I, I]
    lib.nf_backward.restype = I


def library() -> ctypes.CDLL | None:
    """The loaded kernel library, building it on first call; None when unavailable or disabled."""
    if not _tried:
        _load()
    return _lib


def _load() -> None:
    global _lib, _tried, _build_error, _lib_path, _dtypes, _disabled, _isa_detected, _isa_requested, _isa_note
    note = None
    with _lock:
        if _tried:
            return
        _disabled = disabled()
        if _disabled:
            _tried = True
            return
        _isa_detected = detect_isa()
        _isa_requested, _isa_note = _requested_isa()
        note = _isa_note
        cc = _compiler()
        if cc is None or platform.system() != "Linux":
            _build_error = ("no C compiler found" if cc is None else f"unsupported platform {platform.system()}")
            _tried = True
            return
        source = _sources()
        ident = _compiler_id(cc).encode() + platform.machine().encode() + _cpu_signature().encode()
        errors = []
        for isa in _chain(_isa_requested):
            for omp in (["-fopenmp"], []):
                flags = _COMMON + ISA_FLAGS[isa] + omp
                key = hashlib.sha256(source + " ".join(flags).encode() + ident).hexdigest()[:16]
                target = cache_dir() / f"librmsnorm_cpu-{isa}-{key}.so"
                try:
                    if not target.exists():
                        _build(cc, flags, target)
                    lib = ctypes.CDLL(str(target))
                    _declare(lib)
                    if lib.nf_abi_version() != _ABI_VERSION:
                        raise OSError("kernel ABI version mismatch")
                    _dtypes = frozenset(dt for dt, code in DTYPE_CODES.items() if lib.nf_supports_dtype(code))
                    _lib, _lib_path, _tried = lib, str(target), True
                    _bind_calls(lib, cc, ident.decode(errors="replace"))
                    if errors:
                        _build_error = "; ".join(errors)
                    break
                except (OSError, subprocess.SubprocessError) as exc:
                    detail = getattr(exc, "stderr", "") or str(exc)
                    errors.append(f"{isa} ({' '.join(flags)}): {detail.strip()[:500]}")
            if _lib is not None:
                break
        else:
            _build_error = "; ".join(errors)
        _tried = True
    if note:
        warnings.warn(f"normfold: {note}", RuntimeWarning, stacklevel=3)
    if _lib is None:
        warnings.warn(f"normfold: CPU kernel build failed, using PyTorch fallback ({_build_error})",
                      RuntimeWarning, stacklevel=3)


def _bind_calls(lib: ctypes.CDLL, cc: str, compiler_id: str) -> None:
    """Call the kernels through the pycall extension when it loads, else through ctypes."""
    mod, why = pycall.load(cc, compiler_id, cache_dir())
    if mod is not None:
        fwd, simple, bwd = pycall.entry_points(mod, lib)
        _calls.update(forward=fwd, backward=bwd, via="pycall", note=None)
    else:
        fwd, simple, bwd = lib.nf_forward, lib.nf_forward_simple, lib.nf_backward
        _calls.update(forward=fwd, backward=bwd, via="ctypes", note=why)
    _fast[:] = [simple, {dt: DTYPE_CODES[dt] for dt in _dtypes}]


def _require() -> ctypes.CDLL:
    lib = library()
    if lib is None:
        raise RuntimeError(f"normfold CPU kernel unavailable ({_build_error or 'disabled'}); "
                           "use normfold.ops, which falls back to the reference ops")
    return lib


def reset() -> None:
    """Forget the loaded library and re-read the environment on next use (tests, switches)."""
    global _lib, _tried, _build_error, _lib_path, _dtypes, _isa_requested, _isa_note
    with _lock:
        _lib, _tried, _build_error, _lib_path, _dtypes = None, False, None, None, frozenset()
        _isa_requested = _isa_note = None
        _fast[:] = [None, {}]
        _calls.update(forward=None, backward=None, via=None, note=None)


def status() -> dict:
    """What the CPU path is doing, for `normfold bench` and bug reports."""
    lib = library()
    return {"available": lib is not None, "disabled": _disabled, "error": _build_error,
            "isa": ISA_NAMES.get(lib.nf_isa()) if lib is not None else None,
            "cpu_isa": _isa_detected or detect_isa(), "requested_isa": _isa_requested, "isa_note": _isa_note,
            "library": _lib_path, "cache": str(cache_dir()),
            "call": _calls["via"], "call_note": _calls["note"]}


def supports(x: Tensor) -> bool:
    if not _tried:
        if _tracing():
            return False  # loading cannot be traced; nn modules load it when they are built
        _load()
    return x.is_cpu and x.dtype in _dtypes and x.dim() >= 1 and x.numel() > 0


def _tracing() -> bool:
    try:
        return torch.compiler.is_compiling()
    except AttributeError:  # torch < 2.3
        return False


# ---- raw kernel calls (no autograd) -----------------------------------------------------------------

def fast_forward(x: Tensor, weight: Tensor | None, bias: Tensor | None, eps: float, compressed: bool):
    """y = norm(x) for the common inference case (contiguous x with rows, parameters contiguous in
    float32 or x's dtype), with as little Python as possible: the modules call this first on every
    call, so at decode sizes (one row) it is most of the time a norm takes. Returns None when the
    case is not that one (the caller then takes the general path, which also raises user errors)."""
    f, codes = _fast
    if f is None:
        if _tried or _tracing():
            return None
        _load()
        f, codes = _fast
        if f is None:
            return None
    code = codes.get(x.dtype)
    if code is None or not x.is_cpu or not x.is_contiguous() or x.dim() == 0:
        return None
    n = x.shape[-1]
    numel = x.numel()
    if numel == 0:
        return None
    wp = bp = None
    wdt = bdt = 0
    if weight is not None:
        wdt = codes.get(weight.dtype)
        if (weight.dtype is not x.dtype and wdt != 0) or wdt is None or weight.shape != (n,) or \
                not weight.is_contiguous() or not weight.is_cpu:
            return None
        wp = weight.data_ptr()
    if bias is not None:
        bdt = codes.get(bias.dtype)
        if (bias.dtype is not x.dtype and bdt != 0) or bdt is None or bias.shape != (n,) or \
                not bias.is_contiguous() or not bias.is_cpu:
            return None
        bp = bias.data_ptr()
    y = torch.empty_like(x)
    if f(code, x.data_ptr(), wp, wdt, bp, bdt, y.data_ptr(), numel // n, n, eps, compressed,
         torch.get_num_threads()) != 0:
        return None
    return y


def _rows(t: Tensor, n: int) -> tuple[Tensor, int]:
    """t as (rows, n) with a unit last stride, and the distance between its rows (a view when
    possible: a slice x[..., :k] of a contiguous tensor is read in place)."""
    if t.is_contiguous():
        return t, n
    t2 = t.reshape(-1, n)
    if t2.stride(1) != 1 or (t2.shape[0] > 1 and t2.stride(0) < n):
        t2 = t2.contiguous()
    return t2, (t2.stride(0) if t2.shape[0] > 1 else n)


def _param(p: Tensor | None, n: int, x: Tensor, name: str) -> tuple[Tensor | None, int]:
    """A weight/bias the kernel can read (contiguous, float32 or x's dtype) and its dtype code."""
    if p is None:
        return None, 0
    if p.dtype in _PARAM_FAST and p.is_contiguous() and p.is_cpu and p.numel() == n and (
            p.dtype == torch.float32 or p.dtype == x.dtype):
        return p, DTYPE_CODES[p.dtype]  # the common case, without extra tensor ops
    if p.numel() != n:
        raise ValueError(f"{name} has {p.numel()} elements, expected the normalized width {n}")
    p = p.detach()
    if p.dtype not in (torch.float32, x.dtype):
        p = p.float()
    if p.device.type != "cpu":
        raise ValueError(f"{name} is on {p.device}, the input on cpu")
    return p.contiguous(), DTYPE_CODES[p.dtype]


def _empty(x: Tensor) -> Tensor:
    # empty_like is the cheaper call, and contiguous for a contiguous x
    return torch.empty_like(x) if x.is_contiguous() else torch.empty(x.shape, dtype=x.dtype)


def _launch_fwd(x: Tensor, residual: Tensor | None, weight, bias, eps: float, compressed: bool, want_rstd: bool,
                want_y: bool = True):
    _lib or _require()
    n = x.shape[-1]
    x2, xs = _rows(x, n)
    rows = x.numel() // n
    r2, rst = _rows(residual, n) if residual is not None else (None, 0)
    (w, wdt), (b, bdt) = _param(weight, n, x, "weight"), _param(bias, n, x, "bias")
    y = _empty(x) if want_y else None
    s = _empty(x) if residual is not None else None
    rstd = torch.empty(x.shape[:-1], dtype=torch.float32) if want_rstd else None
    rc = _calls["forward"](DTYPE_CODES[x.dtype], x2.data_ptr(), xs, None if r2 is None else r2.data_ptr(), rst,
                            None if w is None else w.data_ptr(), wdt, None if b is None else b.data_ptr(), bdt,
                            None if y is None else y.data_ptr(), None if s is None else s.data_ptr(),
                            None if rstd is None else rstd.data_ptr(), rows, n, float(eps), int(compressed),
                            torch.get_num_threads())
    if rc != 0:
        raise RuntimeError(f"normfold CPU kernel failed (code {rc}) for dtype {x.dtype}")
    return s, y, rstd


def forward(x: Tensor, weight: Tensor | None, bias: Tensor | None, eps: float, compressed: bool,
            want_rstd: bool) -> tuple[Tensor, Tensor | None]:
    """Raw kernel call (no autograd). Returns (y, rstd or None); rstd is float32 with x.shape[:-1]."""
    _, y, rstd = _launch_fwd(x, None, weight, bias, eps, compressed, want_rstd)
    return y, rstd


def _check_residual(x: Tensor, residual: Tensor) -> None:
    if residual.shape != x.shape or residual.dtype != x.dtype:
        raise ValueError(f"residual {tuple(residual.shape)} {residual.dtype} must match x "
                         f"{tuple(x.shape)} {x.dtype}")


def row_scale(x: Tensor, residual: Tensor | None, eps: float, compressed: bool) -> tuple[Tensor | None, Tensor]:
    """The per-row 1/rms of x (or of s = x + residual, also returned) without writing the normalized
    tensor: one read of x (and residual, and one write of s). Returns (s or None, rstd float32)."""
    if residual is not None:
        _check_residual(x, residual)
    s, _, rstd = _launch_fwd(x, residual, None, None, eps, compressed, True, want_y=False)
    return s, rstd


def add_forward(x: Tensor, residual: Tensor, weight: Tensor | None, bias: Tensor | None, eps: float,
                compressed: bool, want_rstd: bool) -> tuple[Tensor, Tensor, Tensor | None]:
    """Fused s = x + residual, y = norm(s) in one pass. Returns (s, y, rstd or None); s is rounded to
    x's dtype before it is normalized, exactly as the unfused `x + residual` would be."""
    _check_residual(x, residual)
    return _launch_fwd(x, residual, weight, bias, eps, compressed, want_rstd)


def backward(dy: Tensor, x: Tensor, weight: Tensor | None, rstd: Tensor, compressed: bool, need_dw: bool,
             need_db: bool, ds: Tensor | None = None) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """Gradients of y = norm(x) given dy; `x` is the normalized input (the sum s for the fused
    variant, whose own gradient `ds` is then added to dx in the same pass). Returns
    (dx, dweight or None, dbias or None); dweight/dbias in float32."""
    _lib or _require()
    n = x.shape[-1]
    x2, xs = _rows(x, n)
    rows = x.numel() // n
    dy2 = dy.to(x.dtype).reshape(rows, n).contiguous()
    ds2 = None if ds is None else ds.to(x.dtype).reshape(rows, n).contiguous()
    w, wdt = _param(weight, n, x, "weight")
    rstd = rstd.reshape(rows).contiguous()
    dx = _empty(x)
    threads = max(1, torch.get_num_threads())
    # Per-thread float32 partial rows; the kernel sums them into row 0.
    dw_part = torch.empty(threads, n, dtype=torch.float32) if need_dw else None
    db_part = torch.empty(threads, n, dtype=torch.float32) if need_db else None
    rc = _calls["backward"](DTYPE_CODES[x.dtype], dy2.data_ptr(), None if ds2 is None else ds2.data_ptr(),
                            x2.data_ptr(), xs, None if w is None else w.data_ptr(), wdt, rstd.data_ptr(),
                            dx.data_ptr(), None if dw_part is None else dw_part.data_ptr(),
                            None if db_part is None else db_part.data_ptr(), rows, n, int(compressed), threads)
    if rc != 0:
        raise RuntimeError(f"normfold CPU kernel failed (code {rc}) for dtype {x.dtype}")
    return dx, (dw_part[0] if need_dw else None), (db_part[0] if need_db else None)
