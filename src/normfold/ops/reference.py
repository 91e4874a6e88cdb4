"""Reference norms in plain PyTorch: the definitions every fast path is tested against.

Statistics accumulate in float32 for half-precision inputs (float64 stays float64), the affine
is applied in that precision, and the result is cast back to the input dtype once. All three
normalize over the last dimension.
"""

from __future__ import annotations

import torch
from torch import Tensor


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _affine(y: Tensor, weight: Tensor | None, bias: Tensor | None) -> Tensor:
    if weight is not None:
        y = y * weight.to(y.dtype)
    if bias is not None:
        y = y + bias.to(y.dtype)
    return y


def layer_norm(x: Tensor, weight: Tensor | None = None, bias: Tensor | None = None, eps: float = 1e-5) -> Tensor:
    """(x − μ(x)) / sqrt(Var(x) + eps) · weight + bias (biased variance, like torch.nn.LayerNorm)."""
    xf = x.to(_acc_dtype(x.dtype))
    xc = xf - xf.mean(dim=-1, keepdim=True)
    y = xc * torch.rsqrt(xc.square().mean(dim=-1, keepdim=True) + eps)
    return _affine(y, weight, bias).to(x.dtype)


def rms_norm(x: Tensor, weight: Tensor | None = None, bias: Tensor | None = None, eps: float = 1e-5) -> Tensor:
    """x / sqrt(mean(x²) + eps) · weight + bias. Equals layer_norm(x) when μ(x) = 0 (same eps)."""
    xf = x.to(_acc_dtype(x.dtype))
    y = xf * torch.rsqrt(xf.square().mean(dim=-1, keepdim=True) + eps)
    return _affine(y, weight, bias).to(x.dtype)


def crms_norm(x: Tensor, weight: Tensor | None = None, bias: Tensor | None = None, eps: float = 1e-5) -> Tensor:
    """Compressed RMSNorm (paper 001 eq. 5) on x ∈ ℝ^{d−1} holding the first d−1 coordinates of a
    zero-mean vector: x / sqrt((Σx² + (Σx)²)/d + eps) · weight + bias, with d = x.shape[-1] + 1."""
    xf = x.to(_acc_dtype(x.dtype))
    d = x.shape[-1] + 1
    ms = (xf.square().sum(dim=-1, keepdim=True) + xf.sum(dim=-1, keepdim=True).square()) / d
    y = xf * torch.rsqrt(ms + eps)
    return _affine(y, weight, bias).to(x.dtype)
