"""Norm modules that converted models use: RMSNorm (optional weight and bias), CRMSNorm, Recenter,
and the fused residual-add variants AddRMSNorm / AddCRMSNorm."""

from __future__ import annotations

import numbers

import torch
from torch import Tensor, nn

from .. import ops


def _last_dim(normalized_shape) -> int:
    if isinstance(normalized_shape, numbers.Integral):
        return int(normalized_shape)
    shape = tuple(normalized_shape)
    if len(shape) != 1:
        raise ValueError(f"normfold norms normalize over the last dimension only; got normalized_shape={shape}")
    return int(shape[0])


class _AffineNorm(nn.Module):
    """Shared parameter handling: `weight` and `bias` are each optional (None when folded away)."""

    def __init__(self, normalized_shape, eps: float = 1e-5, weight: bool = True, bias: bool = False,
                 device=None, dtype=None) -> None:
        super().__init__()
        self.normalized_shape = (_last_dim(normalized_shape),)
        self.eps = float(eps)
        factory = {"device": device, "dtype": dtype}
        self.weight = nn.Parameter(torch.ones(self.normalized_shape, **factory)) if weight else None
        self.bias = nn.Parameter(torch.zeros(self.normalized_shape, **factory)) if bias else None
        ops.prepare()  # load the fast kernels now: torch.compile cannot load them while tracing

    def extra_repr(self) -> str:
        return (f"{self.normalized_shape[0]}, eps={self.eps}, weight={self.weight is not None}, "
                f"bias={self.bias is not None}")


class RMSNorm(_AffineNorm):
    """y = x / sqrt(mean(x²) + eps) · weight + bias over the last dimension.

    On a zero-mean input this equals LayerNorm with the same eps, weight and bias; that is what
    makes a converted Pre-LN model exact. Uses normfold's fast kernels (see `normfold.ops`).
    """

    def forward(self, x: Tensor) -> Tensor:
        return ops.rms_norm(x, self.weight, self.bias, self.eps)

    @classmethod
    def from_layernorm(cls, ln: nn.LayerNorm, weight: Tensor | None = None, bias: Tensor | None = None,
                       keep_weight: bool = True, keep_bias: bool = True) -> "RMSNorm":
        """An RMSNorm with `ln`'s eps and shape, taking `weight`/`bias` (default: ln's own)."""
        eps = getattr(ln, "eps", getattr(ln, "variance_epsilon", 1e-5))
        shape = getattr(ln, "normalized_shape", None) or (ln.weight.shape[-1],)
        ref = ln.weight if ln.weight is not None else next(iter(ln.parameters()), None)
        factory = {"device": ref.device, "dtype": ref.dtype} if ref is not None else {}
        w = ln.weight if weight is None else weight
        b = getattr(ln, "bias", None) if bias is None else bias
        keep_weight = keep_weight and w is not None
        keep_bias = keep_bias and b is not None
        out = cls(shape, eps=eps, weight=keep_weight, bias=keep_bias, **factory)
        with torch.no_grad():
            if keep_weight:
                out.weight.copy_(w)
            if keep_bias:
                out.bias.copy_(b)
        return out


class CRMSNorm(_AffineNorm):
    """Compressed RMSNorm (paper 001 eq. 5) on the first d−1 coordinates of a zero-mean stream.

    `normalized_shape` is the compressed width d−1; the statistic uses d = width + 1.
    """

    def forward(self, x: Tensor) -> Tensor:
        return ops.crms_norm(x, self.weight, self.bias, self.eps)


class AddRMSNorm(_AffineNorm):
    """Residual add fused with RMSNorm: `forward(x, residual)` returns `(s, RMSNorm(s))`, s = x + residual.

    Same parameters as RMSNorm; one pass over memory instead of an add and a norm (the CPU kernel
    and the GPU backends fuse it). s is rounded to the input dtype before it is normalized, so the
    result equals the unfused pair.
    """

    def forward(self, x: Tensor, residual: Tensor) -> tuple[Tensor, Tensor]:
        return ops.add_rms_norm(x, residual, self.weight, self.bias, self.eps)


class AddCRMSNorm(_AffineNorm):
    """Residual add fused with CRMSNorm on the compressed (d−1)-wide stream: returns (s, CRMSNorm(s))."""

    def forward(self, x: Tensor, residual: Tensor) -> tuple[Tensor, Tensor]:
        return ops.add_crms_norm(x, residual, self.weight, self.bias, self.eps)


class Recenter(nn.Module):
    """x − mean(x) over the last dimension (paper 001 §3.1, step 1)."""

    def forward(self, x: Tensor) -> Tensor:
        return x - x.mean(dim=-1, keepdim=True)
