"""The norms in standard ATen ops, for graphs that leave the Python process: `torch.export`, the ONNX
exporter (`torch.onnx.export(..., dynamo=True)`), ExecuTorch / AOTInductor packages.

While `torch.compiler.is_exporting()` is true the dispatcher (`normfold.ops`) computes every norm
with these functions instead of the C kernel's custom op, so an exported program holds only ATen
ops and loads where normfold is not installed:

- RMSNorm is `aten.rms_norm` (+ bias): `ep.run_decompositions()` lowers it to core ATen
  (pow / mean / rsqrt / mul), and the ONNX exporter writes the standard `RMSNormalization` op at
  opset ≥ 23 and the decomposed form below it;
- CRMSNorm has no standard op: it is the reference formula (sum of squares plus the squared sum
  over d = width + 1), which every runtime has;
- half-precision inputs are normalized in float32 and cast back once, like the reference.

For graphs that already hold normfold's custom ops (`normfold::rms_norm_cpu`,
`normfold::add_rms_norm_cpu`, `normfold::rms_norm_cpu_backward`, e.g. traced by other means), the
same formulas are registered as their decompositions in `torch._decomp`'s table, which the ONNX
exporter applies by itself; pass `decompositions()` to `ExportedProgram.run_decompositions` to
lower them there (torch's default export table only decomposes ATen ops). `torch.compile` is not
affected: inductor keeps the opaque kernel (its decomposition table is its own).
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import Tensor

_F32 = torch.float32


def _up(t: Optional[Tensor], dtype: torch.dtype) -> Optional[Tensor]:
    return t if t is None or t.dtype == dtype else t.to(dtype)


def _acc(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else _F32


def rms_norm(x: Tensor, weight: Optional[Tensor], bias: Optional[Tensor], eps: float) -> Tensor:
    """x / sqrt(mean(x²) + eps) · weight + bias as `aten.rms_norm` (+ an add for the bias)."""
    acc = _acc(x.dtype)
    xf = _up(x, acc)
    if weight is None and torch.onnx.is_in_onnx_export():
        # ONNX's RMSNormalization needs a scale; without one the exporter builds ones of the input's
        # full shape in every call (ConstantOfShape(Shape(x))). A (d,) constant folds into the graph.
        weight = torch.ones(x.shape[-1], dtype=acc, device=x.device)
    y = F.rms_norm(xf, (x.shape[-1],), _up(weight, acc), eps)
    if bias is not None:
        y = y + _up(bias, acc)
    return _up(y, x.dtype)


def crms_norm(x: Tensor, weight: Optional[Tensor], bias: Optional[Tensor], eps: float) -> Tensor:
    """Compressed RMSNorm over the last dimension (d = width + 1) in plain ATen ops."""
    acc = _acc(x.dtype)
    xf = _up(x, acc)
    d = x.shape[-1] + 1
    ms = (xf.pow(2).sum(-1, keepdim=True) + xf.sum(-1, keepdim=True).pow(2)) / d
    y = xf * torch.rsqrt(ms + eps)
    if weight is not None:
        y = y * _up(weight, acc)
    if bias is not None:
        y = y + _up(bias, acc)
    return _up(y, x.dtype)


def norm(x: Tensor, weight: Optional[Tensor], bias: Optional[Tensor], eps: float, compressed: bool) -> Tensor:
    return (crms_norm if compressed else rms_norm)(x, weight, bias, eps)


def add_norm(x: Tensor, residual: Tensor, weight: Optional[Tensor], bias: Optional[Tensor], eps: float,
             compressed: bool) -> tuple[Tensor, Tensor]:
    s = x + residual
    return s, norm(s, weight, bias, eps, compressed)


def _rstd(x: Tensor, eps: float, compressed: bool) -> Tensor:
    xf = x.to(_F32)
    ms = xf.pow(2).sum(-1)
    if compressed:
        ms = ms + xf.sum(-1).pow(2)
    return torch.rsqrt(ms / (x.shape[-1] + int(compressed)) + eps)


# ---- decompositions of the custom ops (normfold.ops.cpu_library) ------------------------------------

def _norm_decomp(x, weight, bias, eps, compressed):
    return norm(x, weight, bias, eps, compressed), _rstd(x, eps, compressed)


def _add_norm_decomp(x, residual, weight, bias, eps, compressed):
    s, y = add_norm(x, residual, weight, bias, eps, compressed)
    return s, y, _rstd(s, eps, compressed)


def _backward_decomp(dy, ds, x, weight, rstd, compressed, need_dw, need_db):
    """Gradients of y = x·r·w + b, r = rstd = (ms + eps)^-½, in float32 (what the C kernel returns):
    RMSNorm: ms = Σx²/n, dx = r·g − r³·x·Σ(g·x)/n with g = dy·w;
    CRMSNorm: ms = (Σx² + (Σx)²)/d, dx = r·g − r³·(x + Σx)·Σ(g·x)/d."""
    xf, g = x.to(_F32), dy.to(_F32)
    if weight is not None:
        g = g * weight.to(_F32)
    r = rstd.to(_F32).unsqueeze(-1)
    gx = (g * xf).sum(-1, keepdim=True)
    n = x.shape[-1]
    if compressed:
        dx = r * g - r.pow(3) * (xf + xf.sum(-1, keepdim=True)) * gx / (n + 1)
    else:
        dx = r * g - r.pow(3) * xf * gx / n
    if ds is not None:
        dx = dx + ds.to(_F32)
    rows = dy.to(_F32).reshape(-1, n)
    dw = (rows * (xf * r).reshape(-1, n)).sum(0) if need_dw else x.new_empty(0, dtype=_F32)
    db = rows.sum(0) if need_db else x.new_empty(0, dtype=_F32)
    return dx.to(x.dtype), dw, db


def decompositions() -> dict[torch._ops.OpOverload, Callable]:
    """{normfold custom op: its ATen decomposition}, for `ep.run_decompositions(table)`:

        table = torch.export.default_decompositions()
        table.update(normfold.ops.decompositions())
        ep = ep.run_decompositions(table)
    """
    ops = torch.ops.normfold
    return {ops.rms_norm_cpu.default: _norm_decomp, ops.add_rms_norm_cpu.default: _add_norm_decomp,
            ops.rms_norm_cpu_backward.default: _backward_decomp}


def register_decompositions() -> None:
    """Put `decompositions()` into torch's global decomposition table (`torch._decomp`), where the
    ONNX exporter finds them. Idempotent; called when normfold.ops.cpu_library defines the ops."""
    table = torch._decomp.global_decomposition_table["post_autograd"]
    for op, fn in decompositions().items():
        if op not in table:
            torch._decomp.register_decomposition(op)(fn)
