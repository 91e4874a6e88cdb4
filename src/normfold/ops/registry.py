"""Backends of the norm ops: which implementation computes (C)RMSNorm for a given tensor.

A backend is any object (a module works) with these four callables; all normalize over the last
dimension, take `weight`/`bias` that may be None, and never build an autograd graph themselves:

    supports(x) -> bool
        Cheap check: can this backend handle x (device, dtype, shape)? Called on every op call.
    forward(x, weight, bias, eps, compressed, want_rstd) -> (y, rstd | None)
        y = norm(x); rstd (float32, x.shape[:-1]) = 1/sqrt(ms + eps), needed by backward.
        compressed=True is CRMSNorm: ms = (Σx² + (Σx)²)/(n + 1).
    add_forward(x, residual, weight, bias, eps, compressed, want_rstd) -> (s, y, rstd | None)
        s = x + residual rounded to x's dtype, y = norm(s). x and residual have equal shape/dtype.
    backward(dy, x, weight, rstd, compressed, need_dw, need_db, ds=None) -> (dx, dw | None, db | None)
        Gradients of y = norm(x) (x is the sum s for the fused op, and ds, the gradient reaching s,
        is added to dx). dw/db may be float32; the dispatcher casts them to the parameter dtype.

Register with `register_backend("name", impl, priority)`; the dispatcher asks backends in order of
priority (highest first) and uses the first whose `supports(x)` is true, else the reference ops.

Under torch.compile the dispatcher needs traceable code: pass `compiled=` an object with
    norm(x, weight, bias, eps, compressed) -> y
    add_norm(x, residual, weight, bias, eps, compressed) -> (s, y)
that are differentiable and traceable (torch.library custom ops with fake implementations and
registered autograd, or plain torch code). A backend without one is skipped while compiling, and
the reference formula (which the compiler fuses itself) is traced instead.
NORMFOLD_BACKEND=name restricts the choice to that backend (falling back to the reference when it
does not support the input); NORMFOLD_BACKEND=reference forces the reference everywhere. It is
read at import; `reload_environment()` reads it again.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

REFERENCE = "reference"
_REQUIRED = ("supports", "forward", "add_forward", "backward")


@dataclass(frozen=True)
class Backend:
    name: str
    impl: Any
    priority: int = 0
    compiled: Any = None  # traceable norm / add_norm for torch.compile, or None


_backends: list[Backend] = []
_forced: str | None = None
# [True] while the built-in set-up holds (only the built-in backends registered, no NORMFOLD_BACKEND
# other than "cpu-kernel"): the nn modules may then call the CPU kernel (or their exact LayerNorm
# route) directly, skipping selection. A list so importers see updates.
builtin_impls: dict = {}  # name -> impl, filled by normfold.ops
cpu_fast_path = [True]


# Inputs of at most this many elements take the LayerNorm route of a zero-mean RMSNorm (see
# RMSNorm.forward): below it aten's fused LayerNorm call costs less than the C kernel's ctypes call
# (measured on a 2-core AVX2 EPYC: (1, 768) to (16, 768) and (1, 4096) route, (16, 4096) kernel).
LN_ROUTE_MAX_NUMEL = 16384

# True while `torch.jit.trace` records a graph (`torch.jit.is_tracing()` without its is_scripting check:
# 40 ns a call). The tracer sees torch ops only: a kernel that writes its result through a raw pointer
# (the C kernel's ctypes / pycall call, a Triton launch) is recorded as the empty output buffer alone, so
# the graph would return uninitialized memory. While tracing, the dispatcher and the nn modules compute
# with the ATen formulas of `normfold.ops.portable` instead (tests/export/test_jit_trace.py). Ask it only
# when not compiling: dynamo cannot trace it (a torch.* call returning a bool).
jit_tracing = torch._C._is_tracing

def _refresh() -> None:
    cpu_fast_path[0] = _forced in (None, "cpu-kernel") and all(builtin_impls.get(b.name) is b.impl
                                                                for b in _backends)


def reload_environment() -> None:
    global _forced
    _forced = os.environ.get("NORMFOLD_BACKEND") or None
    _refresh()


reload_environment()


def register_backend(name: str, impl: Any, priority: int = 0, compiled: Any = None) -> Backend:
    """Add (or replace, by name) a backend. `impl` must provide supports/forward/add_forward/backward;
    `compiled` (optional) norm/add_norm for torch.compile."""
    missing = [a for a in _REQUIRED if not callable(getattr(impl, a, None))]
    missing += [f"compiled.{a}" for a in ("norm", "add_norm") if compiled is not None
                and not callable(getattr(compiled, a, None))]
    if missing:
        raise TypeError(f"backend {name!r} lacks {', '.join(missing)}")
    if name == REFERENCE:
        raise ValueError(f"{REFERENCE!r} is the built-in fallback and cannot be registered")
    entry = Backend(name, impl, priority, compiled)
    _backends[:] = sorted([b for b in _backends if b.name != name] + [entry], key=lambda b: -b.priority)
    _refresh()
    return entry


def unregister_backend(name: str) -> None:
    _backends[:] = [b for b in _backends if b.name != name]
    _refresh()


def backends() -> list[Backend]:
    """Registered backends, in the order the dispatcher asks them."""
    return list(_backends)


def select(x: Tensor, compiling: bool = False) -> Backend | None:
    """The backend that will compute ops on x, or None for the reference ops. While compiling, only
    backends with a traceable `compiled` part qualify."""
    forced = _forced
    for b in _backends:
        if (not forced or forced == b.name) and (not compiling or b.compiled is not None) and b.impl.supports(x):
            return b
    return None
