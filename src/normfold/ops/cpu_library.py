"""The CPU kernels as torch.library custom ops, for code running under torch.compile.

Eager calls go straight through ctypes (`normfold.ops.cpu`): a Python custom op adds dispatcher
work that a small norm notices. Under torch.compile, though, a ctypes call would break the graph,
and tracing the reference formula instead lets inductor generate its own fused loop. Measured on
the AVX-512 EPYC this was developed on (one thread, docs/kernels-cpu.md), the opaque op beat
inductor's code by 10-30% in float32 and 25-50% in bfloat16, even where inductor fused the norm
with the residual add before it or a GELU after it. So `torch.compile` sees these ops: opaque to
inductor, with fake (shape-only) implementations for tracing and autograd formulas built on the
backward op, so compiled training uses the same kernels.

Exported graphs (`torch.export`, `torch.onnx.export(dynamo=True)`) do not get these ops: while
exporting the dispatcher computes the norms in plain ATen (`normfold.ops.portable`), and the ops
carry registered ATen decompositions for graphs that hold them anyway.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from . import cpu, portable

_F32 = torch.float32


def _rstd_like(x: Tensor) -> Tensor:
    return torch.empty(x.shape[:-1], dtype=_F32, device=x.device)


def _empty(x: Tensor) -> Tensor:
    return torch.empty(x.shape, dtype=x.dtype, device=x.device)


@torch.library.custom_op("normfold::rms_norm_cpu", mutates_args=(), device_types="cpu")
def _norm(x: Tensor, weight: Optional[Tensor], bias: Optional[Tensor], eps: float,
          compressed: bool) -> tuple[Tensor, Tensor]:
    return cpu.forward(x, weight, bias, eps, compressed, want_rstd=True)


@_norm.register_fake
def _(x, weight, bias, eps, compressed):
    return _empty(x), _rstd_like(x)


@torch.library.custom_op("normfold::add_rms_norm_cpu", mutates_args=(), device_types="cpu")
def _add_norm(x: Tensor, residual: Tensor, weight: Optional[Tensor], bias: Optional[Tensor], eps: float,
              compressed: bool) -> tuple[Tensor, Tensor, Tensor]:
    return cpu.add_forward(x, residual, weight, bias, eps, compressed, want_rstd=True)


@_add_norm.register_fake
def _(x, residual, weight, bias, eps, compressed):
    return _empty(x), _empty(x), _rstd_like(x)


@torch.library.custom_op("normfold::rms_norm_cpu_backward", mutates_args=(), device_types="cpu")
def _backward(dy: Tensor, ds: Optional[Tensor], x: Tensor, weight: Optional[Tensor], rstd: Tensor, compressed: bool,
              need_dw: bool, need_db: bool) -> tuple[Tensor, Tensor, Tensor]:
    dx, dw, db = cpu.backward(dy, x, weight, rstd, compressed, need_dw, need_db, ds=ds)
    # custom ops return tensors only: an empty one stands for "not requested" (one each: returns must
    # not alias each other, which torch checks when compiled training runs this op)
    return (dx, (x.new_empty(0, dtype=_F32) if dw is None else dw.clone()),
            (x.new_empty(0, dtype=_F32) if db is None else db.clone()))


@_backward.register_fake
def _(dy, ds, x, weight, rstd, compressed, need_dw, need_db):
    n = x.shape[-1]
    return (_empty(x), x.new_empty(n if need_dw else 0, dtype=_F32), x.new_empty(n if need_db else 0, dtype=_F32))


def _cast(g: Tensor, like: Optional[Tensor], needed: bool) -> Optional[Tensor]:
    return g.to(like.dtype) if needed and like is not None else None


def _setup_norm(ctx, inputs, output):
    x, weight, bias, _, compressed = inputs
    ctx.mark_non_differentiable(output[1])
    ctx.save_for_backward(x, weight, bias, output[1])
    ctx.compressed = compressed


def _norm_backward(ctx, dy, _drstd):
    x, weight, bias, rstd = ctx.saved_tensors
    need_dw = ctx.needs_input_grad[1] and weight is not None
    need_db = ctx.needs_input_grad[2] and bias is not None
    dx, dw, db = _backward(dy, None, x, weight, rstd, ctx.compressed, need_dw, need_db)
    return dx, _cast(dw, weight, need_dw), _cast(db, bias, need_db), None, None


def _setup_add(ctx, inputs, output):
    _, _, weight, bias, _, compressed = inputs
    ctx.mark_non_differentiable(output[2])
    ctx.save_for_backward(output[0], weight, bias, output[2])
    ctx.compressed = compressed


def _add_backward(ctx, ds, dy, _drstd):
    s, weight, bias, rstd = ctx.saved_tensors
    if dy is None:
        dy = torch.zeros_like(s)
    need_dw = ctx.needs_input_grad[2] and weight is not None
    need_db = ctx.needs_input_grad[3] and bias is not None
    dx, dw, db = _backward(dy, ds, s, weight, rstd, ctx.compressed, need_dw, need_db)
    return dx, dx, _cast(dw, weight, need_dw), _cast(db, bias, need_db), None, None


_norm.register_autograd(_norm_backward, setup_context=_setup_norm)
_add_norm.register_autograd(_add_backward, setup_context=_setup_add)
# ATen decompositions of the three ops (normfold.ops.portable): the ONNX exporter applies them itself.
portable.register_decompositions()


def norm(x: Tensor, weight: Optional[Tensor], bias: Optional[Tensor], eps: float, compressed: bool) -> Tensor:
    """Differentiable, traceable RMSNorm / CRMSNorm on CPU tensors the kernel supports."""
    return _norm(x, weight, bias, eps, compressed)[0]


def add_norm(x: Tensor, residual: Tensor, weight: Optional[Tensor], bias: Optional[Tensor], eps: float,
             compressed: bool) -> tuple[Tensor, Tensor]:
    """Differentiable, traceable fused residual add + norm: (x + residual, norm(x + residual))."""
    s, y, _ = _add_norm(x, residual, weight, bias, eps, compressed)
    return s, y
