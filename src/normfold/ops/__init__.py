"""Norm operators: reference definitions and the dispatching fast paths.

`rms_norm`, `crms_norm` and the fused `add_rms_norm` / `add_crms_norm` pick, per call, the first
registered backend (see `normfold.ops.registry`) that supports the input:

- CPU tensors in float32 / bfloat16 / float16: the C kernels of `normfold.ops.cpu` (forward and
  backward), unless NORMFOLD_CPU_KERNEL=0 or they could not be built; inside `torch.compile` the
  same kernels as torch.library custom ops (`normfold.ops.cpu_library`), which measured faster
  than inductor's own code for the norm (docs/kernels-cpu.md);
- inside `torch.compile`, for a backend without traceable ops: the reference formula, which the
  compiler fuses itself;
- CUDA tensors: the Triton kernels of `normfold.ops.triton_kernels` when triton is installed
  (NORMFOLD_TRITON=0 disables them);
- anything else (float64, devices without a backend): the reference formula.

NORMFOLD_BACKEND=reference forces the reference path everywhere (for debugging and A/B tests);
NORMFOLD_CPU_KERNEL=0 disables the C kernels. Both are read once (at import / first use): call
`reload_environment()` after changing them in a running process.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..errors import NormInputError
from . import cpu, cpu_library, reference, registry, triton_kernels
from .reference import layer_norm
from .registry import REFERENCE, Backend, backends, register_backend, select, unregister_backend

__all__ = ["layer_norm", "rms_norm", "crms_norm", "add_rms_norm", "add_crms_norm", "backend_for", "prepare",
           "register_backend", "unregister_backend", "backends", "Backend", "reload_environment", "reference"]

# Backends, highest priority first where devices overlap. triton_kernels only claims CUDA tensors
# (and imports triton lazily, so CPU-only installs never load it).
register_backend("cpu-kernel", cpu, priority=0, compiled=cpu_library)
register_backend("triton", triton_kernels, priority=10)


# Under torch.compile, inputs smaller than this many elements are left to the compiler, which traces
# the reference formula and fuses it with neighbouring ops: at such sizes the opaque kernel call
# costs more than the work. Measured on the README's machine, compiled ViT-Ti/16 at batch 1 (197 x 192
# per norm): 1.02-1.05x the compiled LayerNorm model with the kernel, 0.98-1.00x without; GPT-3
# Small's width at 256 tokens (196,608 elements): 0.985-0.99x with the kernel.
COMPILE_KERNEL_MIN_NUMEL = 1 << 17


def _select(x: Tensor, compiling: bool):
    b = select(x, compiling)
    if compiling and b is not None and x.numel() < COMPILE_KERNEL_MIN_NUMEL:
        return None
    return b


def prepare() -> None:
    """Load (building if needed) the CPU kernel now rather than on the first call. torch.compile
    cannot load it while tracing, so normfold's nn modules call this when they are built."""
    cpu.library()


def reload_environment() -> None:
    """Re-read NORMFOLD_BACKEND / NORMFOLD_CPU_KERNEL / NORMFOLD_CPU_ISA (they are read once)."""
    registry.reload_environment()
    cpu.reset()


def _compiling() -> bool:
    try:
        return torch.compiler.is_compiling()
    except AttributeError:  # torch < 2.3
        return False


def backend_for(x: Tensor) -> str:
    """Name of the implementation `rms_norm(x, ...)` would use: a backend name or 'reference'."""
    b = _select(x, _compiling())
    return REFERENCE if b is None else b.name


def _check_params(x: Tensor, weight: Tensor | None, bias: Tensor | None) -> None:
    n = x.shape[-1] if x.dim() else None
    for name, p in (("weight", weight), ("bias", bias)):
        if p is not None and (p.dim() != 1 or p.shape[0] != n):
            raise NormInputError(f"{name} has shape {tuple(p.shape)}; a norm over the last dimension of an "
                                 f"input of shape {tuple(x.shape)} needs shape ({n},)")


def _needs_grad(*ts) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in ts)


def _cast(g: Tensor | None, like: Tensor | None) -> Tensor | None:
    return None if g is None or like is None else g.to(like.dtype)


class _NormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, eps, compressed, impl):
        y, rstd = impl.forward(x, weight, bias, eps, compressed, want_rstd=True)
        ctx.save_for_backward(x, weight, bias, rstd)
        ctx.compressed, ctx.impl = compressed, impl
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight, bias, rstd = ctx.saved_tensors
        need_dx, need_dw, need_db = ctx.needs_input_grad[:3]
        dx, dw, db = ctx.impl.backward(dy, x, weight, rstd, ctx.compressed, need_dw=need_dw and weight is not None,
                                       need_db=need_db and bias is not None)
        return (dx if need_dx else None), _cast(dw, weight), _cast(db, bias), None, None, None


class _AddNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, residual, weight, bias, eps, compressed, impl):
        s, y, rstd = impl.add_forward(x, residual, weight, bias, eps, compressed, want_rstd=True)
        ctx.save_for_backward(s, weight, bias, rstd)
        ctx.compressed, ctx.impl = compressed, impl
        ctx.set_materialize_grads(False)  # ds or dy may be None when that output was not used
        return s, y

    @staticmethod
    def backward(ctx, ds, dy):
        s, weight, bias, rstd = ctx.saved_tensors
        need_x, need_r, need_dw, need_db = ctx.needs_input_grad[:4]
        dw = db = None
        if dy is None:
            dx = ds
        else:
            dx, dw, db = ctx.impl.backward(dy, s, weight, rstd, ctx.compressed,
                                           need_dw=need_dw and weight is not None,
                                           need_db=need_db and bias is not None, ds=ds)
        # x and residual get the same gradient; autograd copies before any in-place accumulation.
        return (dx if need_x else None), (dx if need_r else None), _cast(dw, weight), _cast(db, bias), None, None, None


def _norm(x: Tensor, weight, bias, eps: float, compressed: bool) -> Tensor:
    _check_params(x, weight, bias)
    compiling = _compiling()
    b = _select(x, compiling)
    if b is None:
        return (reference.crms_norm if compressed else reference.rms_norm)(x, weight, bias, eps)
    if compiling:
        return b.compiled.norm(x, weight, bias, eps, compressed)
    return norm_with(b.impl, x, weight, bias, eps, compressed)


def norm_with(impl, x: Tensor, weight, bias, eps: float, compressed: bool) -> Tensor:
    """Run a backend implementation directly (differentiable), bypassing selection (kernel tests)."""
    if _needs_grad(x, weight, bias):
        return _NormFunction.apply(x, weight, bias, eps, compressed, impl)
    return impl.forward(x, weight, bias, eps, compressed, want_rstd=False)[0]


def _add_norm(x: Tensor, residual: Tensor, weight, bias, eps: float, compressed: bool) -> tuple[Tensor, Tensor]:
    _check_params(x, weight, bias)
    compiling = _compiling()
    b = _select(x, compiling)
    # The fused kernels take equal shapes and dtypes; anything else (broadcasting, promotion) is
    # left to torch's own `+`.
    if b is None or residual.shape != x.shape or residual.dtype != x.dtype or residual.device != x.device:
        s = x + residual
        return s, (reference.crms_norm if compressed else reference.rms_norm)(s, weight, bias, eps)
    if compiling:
        return b.compiled.add_norm(x, residual, weight, bias, eps, compressed)
    return add_norm_with(b.impl, x, residual, weight, bias, eps, compressed)


def add_norm_with(impl, x: Tensor, residual: Tensor, weight, bias, eps: float, compressed: bool):
    """The fused add + norm of a backend implementation, differentiable, bypassing selection."""
    if _needs_grad(x, residual, weight, bias):
        return _AddNormFunction.apply(x, residual, weight, bias, eps, compressed, impl)
    s, y, _ = impl.add_forward(x, residual, weight, bias, eps, compressed, want_rstd=False)
    return s, y


def rms_norm(x: Tensor, weight: Tensor | None = None, bias: Tensor | None = None, eps: float = 1e-5) -> Tensor:
    """x / sqrt(mean(x²) + eps) · weight + bias over the last dimension (fast path when available)."""
    return _norm(x, weight, bias, eps, compressed=False)


def crms_norm(x: Tensor, weight: Tensor | None = None, bias: Tensor | None = None, eps: float = 1e-5) -> Tensor:
    """Compressed RMSNorm of paper 001 eq. 5 over the last dimension (d = x.shape[-1] + 1)."""
    return _norm(x, weight, bias, eps, compressed=True)


def add_rms_norm(x: Tensor, residual: Tensor, weight: Tensor | None = None, bias: Tensor | None = None,
                 eps: float = 1e-5) -> tuple[Tensor, Tensor]:
    """Fused residual add + RMSNorm: returns (s, rms_norm(s)) with s = x + residual.

    s is rounded to the input dtype before it is normalized, so the result equals the unfused
    `s = x + residual; rms_norm(s, ...)`; one pass over memory instead of three. Differentiable in
    x, residual, weight and bias (either output may be used or not).
    """
    return _add_norm(x, residual, weight, bias, eps, compressed=False)


def add_crms_norm(x: Tensor, residual: Tensor, weight: Tensor | None = None, bias: Tensor | None = None,
                  eps: float = 1e-5) -> tuple[Tensor, Tensor]:
    """Fused residual add + CRMSNorm on the compressed (d−1)-wide stream: returns (s, crms_norm(s))."""
    return _add_norm(x, residual, weight, bias, eps, compressed=True)
