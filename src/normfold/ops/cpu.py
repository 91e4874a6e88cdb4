"""Fast CPU RMSNorm / CRMSNorm: a small C library built on first use and called through ctypes.

Why this path: on CPU, torch's F.layer_norm is a fused kernel while F.rms_norm is composed of
several ops and runs 1.2–16× slower than LayerNorm, so a plain swap would make converted models
slower. A C kernel compiled with -O3 -march=native for the running machine is a single pass over
memory. It needs only a C compiler (no torch headers, so it builds in well under a second), and is
cached under $NORMFOLD_CACHE (default ~/.cache/normfold) keyed by source, flags and compiler.

If no compiler is found or the build fails, `library()` returns None and callers use the
reference PyTorch ops. Set NORMFOLD_CPU_KERNEL=0 to force that fallback.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
import warnings
from pathlib import Path

import torch

_SOURCE = Path(__file__).with_name("csrc") / "rmsnorm_cpu.c"
_ABI_VERSION = 1
_FLAG_SETS = (
    ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC"],
    ["-O3", "-fopenmp", "-shared", "-fPIC"],
)
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_tried = False
_build_error: str | None = None


def cache_dir() -> Path:
    root = os.environ.get("NORMFOLD_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "normfold")
    return Path(root) / "kernels"


def disabled() -> bool:
    return os.environ.get("NORMFOLD_CPU_KERNEL", "1").lower() in ("0", "false", "off", "no")


def _compiler() -> str | None:
    for cc in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if cc and shutil.which(cc):
            return cc
    return None


def _compiler_id(cc: str) -> str:
    try:
        return subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return cc


def _build(cc: str, flags: list[str], target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    # Build to a temp name, then rename: concurrent processes never see a half-written library.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        subprocess.run([cc, *flags, str(_SOURCE), "-o", tmp, "-lm"], check=True, capture_output=True,
                       text=True, timeout=300)
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _declare(lib: ctypes.CDLL) -> None:
    P, I64, F, I = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int
    lib.nf_abi_version.restype = I
    lib.nf_max_threads.restype = I
    lib.nf_rms_forward.argtypes = [I, P, P, P, P, P, I64, I64, F, I]
    lib.nf_rms_forward.restype = I
    lib.nf_rms_backward.argtypes = [I, P, P, P, P, P, P, P, I64, I64, I]
    lib.nf_rms_backward.restype = I


def library() -> ctypes.CDLL | None:
    """The loaded kernel library, building it on first call; None when unavailable."""
    global _lib, _tried, _build_error
    if disabled():
        return None
    if _tried:
        return _lib
    with _lock:
        if _tried:
            return _lib
        _tried = True
        cc = _compiler()
        if cc is None or platform.system() != "Linux":
            _build_error = "no C compiler found" if cc is None else f"unsupported platform {platform.system()}"
            return None
        source = _SOURCE.read_bytes()
        errors = []
        for flags in _FLAG_SETS:
            key = hashlib.sha256(source + " ".join(flags).encode() + _compiler_id(cc).encode()
                                 + platform.machine().encode() + _cpu_signature().encode()).hexdigest()[:16]
            target = cache_dir() / f"librmsnorm_cpu-{key}.so"
            try:
                if not target.exists():
                    _build(cc, flags, target)
                lib = ctypes.CDLL(str(target))
                _declare(lib)
                if lib.nf_abi_version() != _ABI_VERSION:
                    raise OSError("kernel ABI version mismatch")
                _lib = lib
                return _lib
            except (OSError, subprocess.SubprocessError) as exc:
                detail = getattr(exc, "stderr", "") or str(exc)
                errors.append(f"{' '.join(flags)}: {detail.strip()[:500]}")
        _build_error = "; ".join(errors)
        warnings.warn(f"normfold: CPU kernel build failed, using PyTorch fallback ({_build_error})",
                      RuntimeWarning, stacklevel=2)
        return None


def _cpu_signature() -> str:
    # -march=native code must not be reused on a different CPU sharing the cache directory.
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return hashlib.sha256(line.encode()).hexdigest()[:16]
    except OSError:
        pass
    return platform.processor()


def status() -> dict:
    """What the CPU path is doing, for `normfold bench` and bug reports."""
    lib = library()
    return {"available": lib is not None, "disabled": disabled(), "error": _build_error,
            "cache": str(cache_dir())}


def supports(x: torch.Tensor) -> bool:
    return (x.device.type == "cpu" and x.dtype in DTYPE_CODES and x.dim() >= 1 and x.shape[-1] > 0
            and x.numel() > 0 and library() is not None)


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _prep_param(p: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor | None:
    if p is None:
        return None
    return p.detach().to(dtype=x.dtype).contiguous()


def forward(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float,
            compressed: bool, want_rstd: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Raw kernel call (no autograd). Returns (y, rstd or None); rstd has x.shape[:-1]."""
    lib = library()
    x = x.contiguous()
    n = x.shape[-1]
    rows = x.numel() // n
    y = torch.empty_like(x)
    rstd = torch.empty(x.shape[:-1], dtype=torch.float32) if want_rstd else None
    w, b = _prep_param(weight, x), _prep_param(bias, x)
    rc = lib.nf_rms_forward(DTYPE_CODES[x.dtype], x.data_ptr(), _ptr(w), _ptr(b), y.data_ptr(),
                            _ptr(rstd), rows, n, float(eps), int(compressed))
    if rc != 0:
        raise RuntimeError(f"normfold CPU kernel: unsupported dtype {x.dtype}")
    return y, rstd


def backward(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor | None, rstd: torch.Tensor,
             compressed: bool, need_dw: bool, need_db: bool):
    """Returns (dx, dweight or None, dbias or None); dweight/dbias in float32."""
    lib = library()
    dy = dy.contiguous().to(x.dtype)
    n = x.shape[-1]
    rows = x.numel() // n
    dx = torch.empty_like(x)
    threads = max(1, lib.nf_max_threads())
    dw_part = torch.zeros(threads, n, dtype=torch.float32) if need_dw else None
    db_part = torch.zeros(threads, n, dtype=torch.float32) if need_db else None
    w = _prep_param(weight, x)
    rc = lib.nf_rms_backward(DTYPE_CODES[x.dtype], dy.data_ptr(), x.data_ptr(), _ptr(w), rstd.data_ptr(),
                             dx.data_ptr(), _ptr(dw_part), _ptr(db_part), rows, n, int(compressed))
    if rc != 0:
        raise RuntimeError(f"normfold CPU kernel: unsupported dtype {x.dtype}")
    dw = dw_part.sum(0) if need_dw else None
    db = db_part.sum(0) if need_db else None
    return dx, dw, db
