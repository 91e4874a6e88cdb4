"""A faster way to call the CPU kernels than ctypes: a tiny CPython extension (csrc/nf_pycall.c).

At decode sizes a norm's kernel runs for well under a microsecond, and ctypes' generic argument
conversion and libffi call frame cost about 2 µs for `nf_forward_simple`'s 12 arguments: more than
LayerNorm's whole aten call leaves room for. The extension reads each argument with one C-API call.

It is optional. It needs the Python headers besides the C compiler the kernels already need, is
built on first use (well under a second: Python.h only) and cached next to the kernel libraries,
keyed by its source, the compiler and the Python build. When it cannot be built or loaded the
kernels are called through ctypes as before, and `normfold.ops.info()["cpu"]["call"]` says which
is in use and why. NORMFOLD_CPU_PYCALL=0 forces ctypes (to measure one against the other).
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import subprocess
import sys
import sysconfig
from pathlib import Path
from types import ModuleType
from typing import Callable

from ._build import compile_to

_SOURCE = Path(__file__).with_name("csrc") / "nf_pycall.c"
_MODULE = "_nf_pycall"  # must match PyInit__nf_pycall in the source
_FLAGS = ["-O2", "-shared", "-fPIC"]


def disabled() -> bool:
    return os.environ.get("NORMFOLD_CPU_PYCALL", "1").lower() in ("0", "false", "off", "no")


def _include_dir() -> str:
    return sysconfig.get_paths()["include"]


def _build(cc: str, include: str, target: Path) -> None:
    compile_to([cc, *_FLAGS, f"-I{include}", str(_SOURCE)], target, timeout=120)


def _import(path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"normfold.ops.{_MODULE}", path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {path} as an extension module")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def load(cc: str, compiler_id: str, cache: Path) -> tuple[ModuleType | None, str | None]:
    """(the extension module, None), or (None, why not). Never raises for a build or load failure."""
    if disabled():
        return None, "NORMFOLD_CPU_PYCALL=0"
    include = _include_dir()
    if not (Path(include) / "Python.h").is_file():
        return None, f"no Python.h in {include} (install the Python development headers)"
    ident = (_SOURCE.read_bytes() + " ".join(_FLAGS).encode() + compiler_id.encode() + sys.version.encode()
             + include.encode() + (sysconfig.get_config_var("EXT_SUFFIX") or "").encode())
    target = cache / f"nf_pycall-{hashlib.sha256(ident).hexdigest()[:16]}.so"
    try:
        if not target.exists():
            _build(cc, include, target)
        return _import(target), None
    except subprocess.CalledProcessError as exc:
        return None, f"build failed: {(exc.stderr or str(exc)).strip()[:300]}"
    except (OSError, ImportError, subprocess.SubprocessError) as exc:
        return None, f"{type(exc).__name__}: {str(exc)[:300]}"


def entry_points(mod: ModuleType, lib) -> tuple[Callable, Callable, Callable]:
    """Bind the extension to `lib` (a ctypes.CDLL of the kernels) and return its
    (forward, forward_simple, backward), drop-in replacements for the ctypes functions."""
    import ctypes

    def address(fn) -> int:
        return ctypes.cast(fn, ctypes.c_void_p).value

    mod.bind(address(lib.nf_forward), address(lib.nf_forward_simple), address(lib.nf_backward))
    return mod.forward, mod.forward_simple, mod.backward
