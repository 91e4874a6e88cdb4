"""Differentiable entry points that run one backend implementation directly (the generic autograd
Functions of the dispatcher). A module of its own so that backends (triton_kernels) can use them without
importing the `normfold.ops` package that imports them (no import cycle)."""

from __future__ import annotations

import torch
from torch import Tensor


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


def norm_with(impl, x: Tensor, weight, bias, eps: float, compressed: bool) -> Tensor:
    """Run a backend implementation directly (differentiable), bypassing selection (kernel tests)."""
    if _needs_grad(x, weight, bias):
        return _NormFunction.apply(x, weight, bias, eps, compressed, impl)
    return impl.forward(x, weight, bias, eps, compressed, want_rstd=False)[0]


def add_norm_with(impl, x: Tensor, residual: Tensor, weight, bias, eps: float, compressed: bool):
    """The fused add + norm of a backend implementation, differentiable, bypassing selection."""
    if _needs_grad(x, residual, weight, bias):
        return _AddNormFunction.apply(x, residual, weight, bias, eps, compressed, impl)
    s, y, _ = impl.add_forward(x, residual, weight, bias, eps, compressed, want_rstd=False)
    return s, y
