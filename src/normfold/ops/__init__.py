"""Norm operators: reference definitions and the dispatching fast paths.

`rms_norm` / `crms_norm` pick, per call, the fastest correct implementation:

- CPU tensors in float32 / bfloat16 / float16: the C kernel of `normfold.ops.cpu` (forward and
  backward), unless NORMFOLD_CPU_KERNEL=0 or it could not be built;
- CUDA tensors in float32 / bfloat16 / float16: the Triton kernels of `normfold.ops.triton_kernels`
  when the `triton` package is installed, unless NORMFOLD_TRITON=0;
- inside `torch.compile`: the reference formula, which inductor fuses with its neighbours;
- anything else (float64, other devices without a fast path): the reference formula.

NORMFOLD_BACKEND=reference forces the reference path everywhere (for debugging and A/B tests).
"""

from __future__ import annotations

import os

import torch
from torch import Tensor

from . import cpu, reference, triton_kernels
from .reference import layer_norm

__all__ = ["layer_norm", "rms_norm", "crms_norm", "backend_for", "reference"]


def _forced_reference() -> bool:
    return os.environ.get("NORMFOLD_BACKEND", "").lower() == "reference"


def _compiling() -> bool:
    try:
        return torch.compiler.is_compiling()
    except AttributeError:  # torch < 2.3
        return False


def backend_for(x: Tensor) -> str:
    """Name of the implementation `rms_norm(x, ...)` would use: 'cpu-kernel', 'triton' or 'reference'."""
    if _forced_reference() or _compiling():
        return "reference"
    if cpu.supports(x):
        return "cpu-kernel"
    if triton_kernels.supports(x):
        return "triton"
    return "reference"


class _CPUNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, eps, compressed):
        y, rstd = cpu.forward(x, weight, bias, eps, compressed, want_rstd=True)
        ctx.save_for_backward(x, weight, rstd)
        ctx.compressed = compressed
        ctx.has_bias = bias is not None
        ctx.bias_dtype = None if bias is None else bias.dtype
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight, rstd = ctx.saved_tensors
        need_dx, need_dw, need_db = ctx.needs_input_grad[:3]
        dx, dw, db = cpu.backward(dy, x.contiguous(), weight, rstd, ctx.compressed,
                                  need_dw=need_dw and weight is not None,
                                  need_db=need_db and ctx.has_bias)
        dw = dw.to(weight.dtype) if dw is not None else None
        db = db.to(ctx.bias_dtype) if db is not None else None
        return (dx if need_dx else None), dw, db, None, None


def _dispatch(x: Tensor, weight, bias, eps: float, compressed: bool) -> Tensor:
    backend = backend_for(x)
    if backend == "triton":
        return triton_kernels.norm(x, weight, bias, eps, compressed)
    if backend == "cpu-kernel":
        if torch.is_grad_enabled() and (x.requires_grad or any(p is not None and p.requires_grad
                                                               for p in (weight, bias))):
            return _CPUNormFunction.apply(x, weight, bias, eps, compressed)
        return cpu.forward(x, weight, bias, eps, compressed, want_rstd=False)[0]
    ref = reference.crms_norm if compressed else reference.rms_norm
    return ref(x, weight, bias, eps)


def rms_norm(x: Tensor, weight: Tensor | None = None, bias: Tensor | None = None, eps: float = 1e-5) -> Tensor:
    """x / sqrt(mean(x²) + eps) · weight + bias over the last dimension (fast path when available)."""
    return _dispatch(x, weight, bias, eps, compressed=False)


def crms_norm(x: Tensor, weight: Tensor | None = None, bias: Tensor | None = None, eps: float = 1e-5) -> Tensor:
    """Compressed RMSNorm of paper 001 eq. 5 over the last dimension (d = x.shape[-1] + 1)."""
    return _dispatch(x, weight, bias, eps, compressed=True)
