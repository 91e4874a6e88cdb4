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
- anything else (float64, devices without a backend): the reference formula;
- while exporting (`torch.export`, `torch.onnx.export(dynamo=True)`): standard ATen ops
  (`normfold.ops.portable`: `aten.rms_norm`, hence ONNX `RMSNormalization` at opset ≥ 23), so the
  exported program runs without normfold;
- while `torch.jit.trace` records (and the TorchScript-based `torch.onnx.export`, which traces): the
  same ATen ops, since the tracer cannot see a kernel that writes through a raw pointer
  (`registry.jit_tracing`).

NORMFOLD_BACKEND=reference forces the reference path everywhere (for debugging and A/B tests);
NORMFOLD_CPU_KERNEL=0 disables the C kernels. Both are read once (at import / first use): call
`reload_environment()` after changing them in a running process.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..errors import NormInputError
from . import cpu, cpu_library, portable, reference, registry, triton_kernels
from .reference import layer_norm
from .autograd import add_norm_with, norm_with
from .registry import REFERENCE, Backend, backends, jit_tracing, register_backend, select, unregister_backend

__all__ = ["info", "layer_norm", "rms_norm", "crms_norm", "add_rms_norm", "add_crms_norm", "row_scale", "backend_for",
           "prepare", "decompositions", "portable",
           "register_backend", "unregister_backend", "backends", "Backend", "reload_environment", "reference"]

# Backends, highest priority first where devices overlap. triton_kernels only claims CUDA tensors
# (and imports triton lazily, so CPU-only installs never load it).
registry.builtin_impls.update({"cpu-kernel": cpu, "triton": triton_kernels})
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


def info() -> dict:
    """What computes the norms in this process: the CPU kernel's ISA path (and the CPU's best),
    its library and build errors, the backends in dispatch order, forced settings. `normfold bench`
    prints and stores it."""
    return {"cpu": cpu.status(), "backends": [b.name for b in backends()], "forced_backend": registry._forced,
            "module_fast_path": registry.cpu_fast_path[0], "ln_route_max_numel": registry.LN_ROUTE_MAX_NUMEL}


def load_kernels() -> None:
    """Load (building if needed) the CPU kernel now rather than on the first call. torch.compile
    cannot load it while tracing, so normfold's nn modules call this when they are built."""
    cpu.library()


def prepare() -> None:
    """Deprecated name of `load_kernels` (it never prepared a model: that is `normfold.train.prepare`)."""
    import warnings

    warnings.warn("normfold.ops.prepare() is deprecated; use normfold.ops.load_kernels()", DeprecationWarning,
                  stacklevel=2)
    load_kernels()


def reload_environment() -> None:
    """Re-read NORMFOLD_BACKEND / NORMFOLD_CPU_KERNEL / NORMFOLD_CPU_ISA (they are read once)."""
    registry.reload_environment()
    cpu.reset()


def _compiling() -> bool:
    try:
        return torch.compiler.is_compiling()
    except AttributeError:  # torch < 2.3
        return False


def _exporting() -> bool:
    try:
        return torch.compiler.is_exporting()
    except AttributeError:  # torch < 2.6: exports take the torch.compile path (custom ops, decomposable)
        return False


def decompositions() -> dict:
    """ATen decompositions of normfold's custom ops, for `ExportedProgram.run_decompositions`
    (see `normfold.ops.portable`)."""
    return portable.decompositions()


def backend_for(x: Tensor) -> str:
    """Name of the implementation `rms_norm(x, ...)` would use: a backend name or 'reference'."""
    compiling = _compiling()
    if not compiling and jit_tracing():
        return REFERENCE
    b = _select(x, compiling)
    return REFERENCE if b is None else b.name


def _check_params(x: Tensor, weight: Tensor | None, bias: Tensor | None) -> None:
    n = x.shape[-1] if x.dim() else None
    for name, p in (("weight", weight), ("bias", bias)):
        if p is not None and (p.dim() != 1 or p.shape[0] != n):
            raise NormInputError(f"{name} has shape {tuple(p.shape)}; a norm over the last dimension of an "
                                 f"input of shape {tuple(x.shape)} needs shape ({n},)")


def _norm(x: Tensor, weight, bias, eps: float, compressed: bool) -> Tensor:
    _check_params(x, weight, bias)
    compiling = _compiling()
    if (_exporting() if compiling else jit_tracing()):  # (dynamo cannot trace jit_tracing)
        return portable.norm(x, weight, bias, eps, compressed)
    b = _select(x, compiling)
    if b is None:
        return (reference.crms_norm if compressed else reference.rms_norm)(x, weight, bias, eps)
    if compiling:
        return b.compiled.norm(x, weight, bias, eps, compressed)
    return norm_with(b.impl, x, weight, bias, eps, compressed)


def _add_norm(x: Tensor, residual: Tensor, weight, bias, eps: float, compressed: bool) -> tuple[Tensor, Tensor]:
    _check_params(x, weight, bias)
    compiling = _compiling()
    if (_exporting() if compiling else jit_tracing()):  # (dynamo cannot trace jit_tracing)
        return portable.add_norm(x, residual, weight, bias, eps, compressed)
    b = _select(x, compiling)
    # The fused kernels take equal shapes and dtypes; anything else (broadcasting, promotion) is
    # left to torch's own `+`.
    if b is None or residual.shape != x.shape or residual.dtype != x.dtype or residual.device != x.device:
        s = x + residual
        return s, (reference.crms_norm if compressed else reference.rms_norm)(s, weight, bias, eps)
    if compiling:
        return b.compiled.add_norm(x, residual, weight, bias, eps, compressed)
    return add_norm_with(b.impl, x, residual, weight, bias, eps, compressed)


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


def row_scale(x: Tensor, residual: Tensor | None = None, eps: float = 1e-5,
              compressed: bool = False) -> tuple[Tensor | None, Tensor]:
    """The per-row scale of (C)RMSNorm, 1/sqrt(ms + eps) of shape x.shape[:-1] (float32, float64 for
    float64 input), without the normalized tensor: for an affine-free norm,
    Linear(norm(x)) = (x·Wᵀ)·scale + b (`normfold.nn.NormLinear`). With `residual`, s = x + residual
    is formed first and returned too: (s or None, scale). One pass over x (the C kernel without its
    normalize pass) where the kernel runs and no gradient is needed; the reference formula otherwise."""
    grad = torch.is_grad_enabled() and (x.requires_grad or (residual is not None and residual.requires_grad))
    same = residual is None or (residual.shape == x.shape and residual.dtype == x.dtype)
    if not grad and same and x.is_cpu and x.dtype in cpu.DTYPE_CODES and x.numel() and not _compiling() \
            and not jit_tracing() and cpu.library() is not None:
        return cpu.row_scale(x, residual, eps, compressed)
    s = None if residual is None else x + residual
    src = (x if s is None else s).to(reference._acc_dtype(x.dtype))
    ms = src.pow(2).sum(-1)
    if compressed:
        ms = ms + src.sum(-1).pow(2)
    return s, torch.rsqrt(ms / (src.shape[-1] + int(compressed)) + eps)
