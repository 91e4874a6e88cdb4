"""φ = h(θ): differentiable versions of the weight algebra, for training.

`normfold.algebra` edits weights once, detached, in float64 (conversion). Training needs the same
maps as autograd-traced functions of the live parameters θ, in the parameters' own dtype, so that
gradients flow from φ back to θ. Each function here is the differentiable twin of an
`normfold.algebra` function (tests/train/test_functional.py checks each against its twin in
float64); the padded-compression pair is the width-d form of `compress_reader` / `compress_writer`
used for Pre-CRMSNorm training (see docs/training.md, "Pre-CRMSNorm at width d").
"""

from __future__ import annotations

import torch
from torch import Tensor


def center(t: Tensor, dim: int) -> Tensor:
    """t − mean(t) along `dim` (twin of `algebra.center`). A symmetric projection: it is its own transpose."""
    return t - t.mean(dim=dim, keepdim=True)


def fold_weight(weight: Tensor, gamma: Tensor, in_dim: int) -> Tensor:
    """W·diag(γ) over the input axis (the weight half of `algebra.fold_affine`)."""
    shape = [1] * weight.dim()
    shape[in_dim] = -1
    return weight * gamma.reshape(shape)


def fold_bias(bias: Tensor | None, weight: Tensor, beta: Tensor, in_dim: int) -> Tensor:
    """b + βW (the bias half of `algebra.fold_affine`; W is the reader's un-folded weight)."""
    shift = torch.tensordot(weight, beta, dims=([in_dim % weight.dim()], [0]))
    return shift if bias is None else bias + shift


def compress_reader_padded(weight: Tensor, in_dim: int) -> Tensor:
    """W_i − a_d·1ᵀ (paper 001 eq. 6) kept at width d: the last input column becomes exactly zero,
    so the reader ignores the stream's last coordinate. `algebra.compress_reader` = this, then drop
    that column."""
    return weight - weight.narrow(in_dim, weight.shape[in_dim] - 1, 1)


def compress_reader_padded_adjoint(grad: Tensor, in_dim: int) -> Tensor:
    """The transpose of `compress_reader_padded` (for its VJP): the last input slice also receives
    −Σ grad over the input axis, the other slices pass unchanged."""
    out = grad.clone()
    out.narrow(in_dim, grad.shape[in_dim] - 1, 1).sub_(grad.sum(in_dim, keepdim=True))
    return out


def zero_last(t: Tensor, dim: int) -> Tensor:
    """t with its last slice along `dim` set to zero (a writer of the padded compressed stream:
    `algebra.compress_writer` drops that output, here it is kept as a structural zero). Diagonal: its
    own transpose."""
    mask = torch.ones(t.shape[dim], dtype=t.dtype, device=t.device)
    mask[-1] = 0
    shape = [1] * t.dim()
    shape[dim] = -1
    return t * mask.reshape(shape)


def crms_norm_padded(x: Tensor, eps: float) -> Tensor:
    """CRMSNorm (paper 001 eq. 5) of a width-d tensor whose last coordinate is the structural zero:
    x / sqrt((Σx² + (Σx)²)/d + ε). With x_d = 0 the sums equal those over the first d−1
    coordinates, so this is exactly eq. 5 with d = x.shape[-1]. Reference formula (float32 statistics
    for half-precision input)."""
    xf = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
    d = x.shape[-1]
    ms = (xf.square().sum(-1, keepdim=True) + xf.sum(-1, keepdim=True).square()) / d
    return (xf * torch.rsqrt(ms + eps)).to(x.dtype)


def decompress_padded(y: Tensor) -> Tensor:
    """(y₁..y_{d−1}, 0) → (y₁..y_{d−1}, −Σ y): the zero-mean vector the padded stream stands for."""
    return y - _last_onehot(y) * y.sum(-1, keepdim=True)


def compress_padded(x: Tensor) -> Tensor:
    """Any stream vector → its padded compressed representative: centre, then zero the last coordinate."""
    z = x - x.mean(-1, keepdim=True)
    return z - _last_onehot(z) * z.narrow(-1, z.shape[-1] - 1, 1)


def _last_onehot(t: Tensor) -> Tensor:
    e = torch.zeros(t.shape[-1], dtype=t.dtype, device=t.device)
    e[-1] = 1
    return e
