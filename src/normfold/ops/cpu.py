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

This module loads the library (which builds to try, in which order) and keeps what it found; the parts
live beside it: `cpu_isa.py` (ISA detection and flags), `cpu_build.py` (compiler, cache, one build,
ctypes declarations), `cpu_calls.py` (the kernel calls). Their public names are re-exported here.
"""

from __future__ import annotations

import ctypes
import os
import platform
import subprocess
import threading
import warnings

from torch import Tensor

from . import cpu_calls, pycall
from .cpu_build import ABI_VERSION, COMMON_FLAGS, build, cache_dir, compiler_id, cpu_signature, declare, library_path
from .cpu_build import find_compiler as _compiler  # tests patch cpu._compiler
from .cpu_build import sources
from .cpu_calls import DTYPE_CODES, add_forward, backward, fast_add_forward, fast_forward, forward, row_scale, tracing
from .cpu_isa import ISA_ALIASES, ISA_FALLBACK, ISA_FLAGS, ISA_NAMES, detect_isa, requested_isa
from .cpu_isa import chain as _chain

__all__ = ["library", "reset", "status", "supports", "disabled", "cache_dir", "detect_isa", "fast_add_forward", "fast_forward", "forward",
           "row_scale", "add_forward", "backward", "DTYPE_CODES", "ISA_FLAGS", "ISA_FALLBACK", "ISA_ALIASES",
           "ISA_NAMES"]

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
_fast = cpu_calls.fast_table()  # [nf_forward_simple, {dtype: code}] of the loaded library (see fast_forward)
_calls = cpu_calls.calls()  # the bound entry points and how they are called (pycall.py)


def _env_off(name: str, default: str = "1") -> bool:
    return os.environ.get(name, default).lower() in ("0", "false", "off", "no")


def disabled() -> bool:
    return _env_off("NORMFOLD_CPU_KERNEL")


def _requested_isa() -> tuple[str, str | None]:
    """(path to start from, note): the detected path, or NORMFOLD_CPU_ISA when the CPU can run it."""
    return requested_isa(detect_isa())


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
        source = sources()
        ident = compiler_id(cc).encode() + platform.machine().encode() + cpu_signature().encode()
        errors = []
        for isa in _chain(_isa_requested):
            for omp in (["-fopenmp"], []):
                flags = COMMON_FLAGS + ISA_FLAGS[isa] + omp
                target = library_path(isa, flags, source, ident)
                try:
                    if not target.exists():
                        build(cc, flags, target)
                    lib = ctypes.CDLL(str(target))
                    declare(lib)
                    if lib.nf_abi_version() != ABI_VERSION:
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


def _bind_calls(lib: ctypes.CDLL, cc: str, ident: str) -> None:
    """Call the kernels through the pycall extension when it loads, else through ctypes."""
    mod, why = pycall.load(cc, ident, cache_dir())
    if mod is not None:
        fwd, simple, bwd = pycall.entry_points(mod, lib)
        cpu_calls.bind(fwd, simple, bwd, "pycall", None, _dtypes)
    else:
        cpu_calls.bind(lib.nf_forward, lib.nf_forward_simple, lib.nf_backward, "ctypes", why, _dtypes)


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
        cpu_calls.bind(None, None, None, None, None, frozenset())


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
        if tracing():
            return False  # loading cannot be traced; nn modules load it when they are built
        _load()
    return x.is_cpu and x.dtype in _dtypes and x.dim() >= 1 and x.numel() > 0



def _first_use() -> bool:
    """Load the library unless that was already tried; True when it was tried now."""
    if _tried:
        return False
    _load()
    return True


cpu_calls.set_loader(_first_use, _require)
