"""Offline-norm fusion maths (paper 004, Algorithm 1), pure tensor functions in float64.

At inference an offline norm is a fixed per-channel affine z = x·scale + shift with
scale = γ/sqrt(σ² + ε) and shift = β − scale·μ. It folds into the linear that reads z
(`fold_offline_norm`, in tensors.py) or into the linear that writes x (`fold_into_writer`).
"""

from __future__ import annotations

import torch
from torch import Tensor


def offline_affine(gamma: Tensor | None, beta: Tensor | None, mean: Tensor | None, var: Tensor,
                   eps: float) -> tuple[Tensor, Tensor]:
    """(scale, shift) of y = γ(x − μ)/sqrt(σ² + ε) + β, in float64 (Algorithm 1, lines 1-2)."""
    scale = torch.rsqrt(var.detach().double() + eps)
    if gamma is not None:
        scale = scale * gamma.detach().double()
    shift = torch.zeros_like(scale) if beta is None else beta.detach().double().clone()
    if mean is not None:
        shift = shift - scale * mean.detach().double()
    return scale, shift


def fold_into_writer(weight: Tensor, bias: Tensor | None, scale: Tensor, shift: Tensor,
                     out_dim: int) -> tuple[Tensor, Tensor]:
    """Fold z = y·scale + shift into the layer writing y = f(x; W) + b (linear in W and b):
    every output channel o of W (axis `out_dim`) is scaled by scale[o], and b' = b·scale + shift.
    Returns (W', b') in the input dtypes (b' in W's dtype when there was no bias)."""
    w64 = weight.detach().double()
    shape = [1] * weight.dim()
    shape[out_dim] = -1
    new_w = w64 * scale.double().reshape(shape)
    b64 = torch.zeros_like(scale, dtype=torch.float64) if bias is None else bias.detach().double()
    new_b = b64 * scale.double() + shift.double()
    return new_w.to(weight.dtype), new_b.to(weight.dtype if bias is None else bias.dtype)
