"""Building the CPU kernel library: the compiler, the cache directory and the cache key (source, flags,
compiler and CPU), one build, and the ctypes declarations of its entry points. cpu.py decides which
builds to try and loads the result."""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
from pathlib import Path

from ._build import compile_to

CSRC = Path(__file__).with_name("csrc")
SOURCE = CSRC / "rmsnorm_cpu.c"
ABI_VERSION = 6
COMMON_FLAGS = ["-O3", "-shared", "-fPIC"]


def cache_dir() -> Path:
    root = os.environ.get("NORMFOLD_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "normfold")
    return Path(root) / "kernels"

def find_compiler() -> str | None:
    """$CC when set (and only it: CC=/nonexistent means no compiler), else cc, gcc or clang."""
    env = os.environ.get("CC")
    if env:
        return env if shutil.which(env) else None
    for cc in ("cc", "gcc", "clang"):
        if shutil.which(cc):
            return cc
    return None


def compiler_id(cc: str) -> str:
    try:
        return subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return cc


def cpu_signature() -> str:
    # -march=native code must not be reused on a different CPU sharing the cache directory.
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return hashlib.sha256(line.encode()).hexdigest()[:16]
    except OSError:
        pass
    return platform.processor()


def sources() -> bytes:
    """Every file the build reads (the .c and its headers), for the cache key."""
    return SOURCE.read_bytes() + b"".join(h.read_bytes() for h in sorted(CSRC.glob("*.h")))


def build(cc: str, flags: list[str], target: Path) -> None:
    compile_to([cc, *flags, str(SOURCE), "-lm"], target, timeout=300)


def declare(lib: ctypes.CDLL) -> None:
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
    # x, y, rows, m, p, core, scale, nthreads
    lib.nf_fwht_f32.argtypes = [P, P, I64, I64, I64, P, F, I]
    lib.nf_fwht_f32.restype = I



def library_path(isa: str, flags: list[str], source: bytes, ident: bytes) -> Path:
    """Where the library of `isa` built with `flags` from `source` by the compiler/CPU `ident` is cached."""
    key = hashlib.sha256(source + " ".join(flags).encode() + ident).hexdigest()[:16]
    return cache_dir() / f"librmsnorm_cpu-{isa}-{key}.so"
