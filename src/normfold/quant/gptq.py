"""GPTQ and round-to-nearest weight quantization of one linear layer.

GPTQ (Frantar, Ashkboos, Hoefler, Alistarh, "GPTQ: Accurate Post-Training Quantization for Generative
Pre-trained Transformers", arXiv:2210.17323) rounds the columns of W (torch's (out, in) layout) one at a
time and, after each, moves the columns not yet rounded so as to cancel the rounding error on the layer's
calibration inputs X: it minimises ‖X·Wᵀ − X·Ŵᵀ‖² = tr((W − Ŵ)·H·(W − Ŵ)ᵀ), H = XᵀX, greedily. The update
uses the upper Cholesky factor of H⁻¹ (damped: H + λ·mean(diag H)·I) and is applied lazily in blocks of
columns, as in the paper.

Both quantizers return a `QuantizedWeight`: integer levels (int8 tensor, (out, in)), a scale per output
row and group of `group_size` input columns (one group = the whole row when `group_size` is None), and,
asymmetric, an integer zero point per row and group. Dequantized: Ŵ = (q − zero)·scale, group by group.
Symmetric levels are −(2^(b−1) − 1) … 2^(b−1) − 1 (scale = max|w|/qmax); asymmetric 0 … 2^b − 1.

With `act_order` (columns in order of decreasing H_ii) and groups, the group scales are computed up front
from the original weights ("static groups"), so groups stay contiguous runs of input columns in the
stored layout (what int4 engine formats expect).

`clip` (a grid of ratios ≤ 1) searches, per output row, the ratio r of the range that minimises the
row's Hessian-weighted round-to-nearest error e·H·eᵀ (the same objective GPTQ minimises); without a
Hessian, the plain squared error.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ..errors import NormfoldError

DEFAULT_CLIP_GRID = (1.0, 0.95, 0.9, 0.85, 0.8, 0.75, 0.7, 0.65, 0.6, 0.55, 0.5)


class QuantizationError(NormfoldError):
    """Bad quantization settings (bits, group size, shapes)."""


@dataclass
class QuantizedWeight:
    """q: int8 (out, in) levels; scale: (out, groups) float32; zero: (out, groups) int8 or None (symmetric)."""

    q: Tensor
    scale: Tensor
    zero: Tensor | None
    bits: int
    group_size: int | None

    def dequantize(self, dtype: torch.dtype = torch.float32) -> Tensor:
        out, cols = self.q.shape
        g = cols if self.group_size is None else self.group_size
        idx = torch.arange(cols) // g
        scale = self.scale.to(torch.float64)[:, idx]
        q = self.q.to(torch.float64)
        if self.zero is not None:
            q = q - self.zero.to(torch.float64)[:, idx]
        return (q * scale).to(dtype)


def _check(weight: Tensor, bits: int, group_size: int | None) -> None:
    if weight.dim() != 2:
        raise QuantizationError(f"expected a 2-D (out, in) weight, got shape {tuple(weight.shape)}")
    if not 2 <= bits <= 8:
        raise QuantizationError(f"bits must be 2..8, got {bits}")
    if group_size is not None and (group_size <= 0 or weight.shape[1] % group_size):
        raise QuantizationError(f"group size {group_size} must divide the input width {weight.shape[1]}; "
                                "use 32, 64, 128 or none (per output channel)")


def grid_params(w: Tensor, bits: int, symmetric: bool, ratio: Tensor | float = 1.0) -> tuple[Tensor, Tensor | None]:
    """Scale (and zero point) per row of `w` (rows, cols) for a range shrunk by `ratio` (per row or scalar)."""
    if symmetric:
        qmax = 2 ** (bits - 1) - 1
        scale = (w.abs().amax(1) * ratio / qmax).clamp_min(1e-12)
        return scale, None
    qmax = 2 ** bits - 1
    lo = (w.amin(1).clamp_max(0) * ratio)
    hi = (w.amax(1).clamp_min(0) * ratio)
    scale = ((hi - lo) / qmax).clamp_min(1e-12)
    zero = (-lo / scale).round().clamp(0, qmax)
    return scale, zero


def round_to_grid(w: Tensor, scale: Tensor, zero: Tensor | None, bits: int) -> Tensor:
    """Integer levels of `w` (rows, …) on the per-row grid (scale, zero), as float."""
    shape = (-1,) + (1,) * (w.dim() - 1)
    s = scale.reshape(shape)
    if zero is None:
        qmax = 2 ** (bits - 1) - 1
        return (w / s).round().clamp(-qmax, qmax)
    return ((w / s).round() + zero.reshape(shape)).clamp(0, 2 ** bits - 1)


def _levels_to_values(q: Tensor, scale: Tensor, zero: Tensor | None) -> Tensor:
    shape = (-1,) + (1,) * (q.dim() - 1)
    return (q - (0 if zero is None else zero.reshape(shape))) * scale.reshape(shape)


def _group_params(w: Tensor, bits: int, symmetric: bool, group_size: int | None, hessian: Tensor | None,
                  clip) -> tuple[Tensor, Tensor | None]:
    """(out, groups) scale / zero of `w` (float64), with the per-row clip-ratio search when `clip`."""
    out, cols = w.shape
    g = cols if group_size is None else group_size
    wg = w.reshape(out, cols // g, g)

    def params(ratio):
        flat = wg.reshape(-1, g)
        r = ratio if isinstance(ratio, float) else ratio.repeat_interleave(cols // g)
        s, z = grid_params(flat, bits, symmetric, r)
        return s.reshape(out, -1), None if z is None else z.reshape(out, -1)

    if not clip:
        return params(1.0)
    best, best_err = None, None
    for r in clip:
        s, z = params(float(r))
        q = _rtn_levels(w, s, z, bits, g)
        e = w - _deq(q, s, z, g)
        err = ((e @ hessian) * e).sum(1) if hessian is not None else e.pow(2).sum(1)
        if best is None:
            best, best_err = (s, z), err
            continue
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        bs = torch.where(better[:, None], s, best[0])
        bz = None if z is None else torch.where(better[:, None], z, best[1])
        best = (bs, bz)
    return best


def _rtn_levels(w: Tensor, scale: Tensor, zero: Tensor | None, bits: int, g: int) -> Tensor:
    out, cols = w.shape
    idx = torch.arange(cols) // g
    s = scale[:, idx]
    if zero is None:
        qmax = 2 ** (bits - 1) - 1
        return (w / s).round().clamp(-qmax, qmax)
    return ((w / s).round() + zero[:, idx]).clamp(0, 2 ** bits - 1)


def _deq(q: Tensor, scale: Tensor, zero: Tensor | None, g: int) -> Tensor:
    idx = torch.arange(q.shape[1]) // g
    return (q - (0 if zero is None else zero[:, idx])) * scale[:, idx]


def _result(q: Tensor, scale: Tensor, zero: Tensor | None, bits: int, group_size: int | None) -> QuantizedWeight:
    return QuantizedWeight(q=q.round().to(torch.int8), scale=scale.to(torch.float32),
                           zero=None if zero is None else zero.round().to(torch.int8), bits=bits,
                           group_size=group_size)


def rtn_quantize(weight: Tensor, *, bits: int = 4, group_size: int | None = None, symmetric: bool = True,
                 hessian: Tensor | None = None, clip=None) -> QuantizedWeight:
    """Round-to-nearest, per output row (and group of `group_size` input columns). `clip`: a grid of range
    ratios searched per row (Hessian-weighted error when `hessian` is given)."""
    _check(weight, bits, group_size)
    w = weight.detach().to(torch.float64)
    h = None if hessian is None else hessian.detach().to(torch.float64)
    scale, zero = _group_params(w, bits, symmetric, group_size, h, clip)
    g = w.shape[1] if group_size is None else group_size
    return _result(_rtn_levels(w, scale, zero, bits, g), scale, zero, bits, group_size)


def gptq_quantize(weight: Tensor, hessian: Tensor, *, bits: int = 4, group_size: int | None = None,
                  symmetric: bool = True, act_order: bool = False, damp: float = 0.01, block_size: int = 128,
                  clip=None) -> QuantizedWeight:
    """GPTQ of `weight` ((out, in), torch's Linear layout) given `hessian` = XᵀX ((in, in), summed over the
    calibration rows X of the layer's input). Computes in float64. `damp`: λ, added as λ·mean(diag H) to
    the diagonal; `block_size`: columns per lazy batch (rounded to a multiple of `group_size`); `clip`: the
    range-ratio grid searched per row (on the Hessian-weighted round-to-nearest error) before GPTQ."""
    _check(weight, bits, group_size)
    out, cols = weight.shape
    if hessian.shape != (cols, cols):
        raise QuantizationError(f"Hessian shape {tuple(hessian.shape)} does not match input width {cols}")
    w = weight.detach().to(torch.float64).clone()
    h = hessian.detach().to(torch.float64).clone()
    dead = torch.diag(h) == 0
    h[dead, dead] = 1
    w[:, dead] = 0
    g = cols if group_size is None else group_size
    if group_size is not None:
        block_size = max(group_size, block_size // group_size * group_size)
    static = group_size is None or act_order
    if static:  # grids fixed up front from the original weights
        scale, zero = _group_params(w, bits, symmetric, group_size, h, clip)
    else:
        scale = torch.zeros(out, cols // g, dtype=torch.float64)
        zero = None if symmetric else torch.zeros_like(scale)
    perm = torch.argsort(torch.diag(h), descending=True, stable=True) if act_order else torch.arange(cols)
    w = w[:, perm]
    h = h[perm][:, perm]
    group_of = (perm // g)  # group of each processed column
    h = h + damp * torch.mean(torch.diag(h)) * torch.eye(cols, dtype=torch.float64)
    try:
        hinv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True)
    except torch.linalg.LinAlgError as exc:
        raise QuantizationError("the damped Hessian is not positive definite: raise damp or give more "
                                "calibration tokens") from exc
    q = torch.zeros_like(w)
    for i1 in range(0, cols, block_size):
        i2 = min(i1 + block_size, cols)
        w1 = w[:, i1:i2].clone()
        q1 = torch.zeros_like(w1)
        err1 = torch.zeros_like(w1)
        hinv1 = hinv[i1:i2, i1:i2]
        for i in range(i2 - i1):
            col = i1 + i
            if not static and col % g == 0:  # dynamic groups: grid from the updated weights of the group
                s, z = _group_params(w1[:, i:i + g], bits, symmetric, None, None, clip if clip else None)
                scale[:, col // g] = s[:, 0]
                if zero is not None:
                    zero[:, col // g] = z[:, 0]
            grp = int(group_of[col])
            s = scale[:, grp]
            z = None if zero is None else zero[:, grp]
            wc = w1[:, i]
            lev = round_to_grid(wc, s, z, bits)
            q1[:, i] = lev
            e = (wc - _levels_to_values(lev, s, z)) / hinv1[i, i]
            w1[:, i:] -= e[:, None] * hinv1[i, i:][None, :]
            err1[:, i] = e
        q[:, i1:i2] = q1
        w[:, i2:] -= err1 @ hinv[i1:i2, i2:]
    inv = torch.argsort(perm)
    return _result(q[:, inv], scale, zero, bits, group_size)


def objective(weight: Tensor, approx: Tensor, hessian: Tensor) -> float:
    """tr((W − Ŵ)·H·(W − Ŵ)ᵀ) = ‖X·Wᵀ − X·Ŵᵀ‖² for H = XᵀX (float64)."""
    e = weight.to(torch.float64) - approx.to(torch.float64)
    return float(((e @ hessian.to(torch.float64)) * e).sum())


__all__ = ["QuantizedWeight", "QuantizationError", "rtn_quantize", "gptq_quantize", "objective", "grid_params",
           "DEFAULT_CLIP_GRID"]
