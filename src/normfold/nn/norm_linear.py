"""A norm folded into the matrix multiply that reads it.

After conversion every stream norm is affine-free (γ and β live in the next linear layers) and is
read only by linear layers, so

    Linear(RMSNorm(x)) = (x · Wᵀ) · s(x) + b,    s(x) = 1 / sqrt(mean(x²) + eps)

with one scalar per row: the normalized tensor need never be written. `NormLinear` computes s in
one read of x (`normfold.ops.row_scale`, which can also form the residual sum in the same pass) and
applies it to the output rows after the GEMM (`addcmul`: bias + out · s).

Whether this is faster is a measurement, not a given: in eager PyTorch the scale is a separate pass
over the GEMM's output, which is 3-4x wider than the norm's (QKV, MLP up-projection), in exchange
for the norm's write and re-read of x. `normfold bench epilogue` measures both forms; its result is
in docs/kernels-cpu.md. In exact arithmetic the two are the same function (tests/nn/test_norm_linear.py
checks ≤ 1e-9 in float64).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .. import ops


class NormLinear(nn.Module):
    """`linear(norm(x))` for an affine-free RMSNorm / CRMSNorm `norm`, with the norm's scale applied
    to the output rows instead of the input. Shares `linear`'s parameters (no copy)."""

    def __init__(self, linear: nn.Linear, eps: float = 1e-5, compressed: bool = False) -> None:
        super().__init__()
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"NormLinear needs an nn.Linear, got {type(linear).__name__}")
        self.linear, self.eps, self.compressed = linear, float(eps), bool(compressed)

    @classmethod
    def fold(cls, norm: nn.Module, linear: nn.Linear) -> "NormLinear":
        """From a normfold RMSNorm / CRMSNorm and the nn.Linear reading it. A norm with weight γ or
        bias β has them folded into a new linear (W·diag(γ), b + W·β, in float64, rounded once:
        `normfold.algebra.fold_affine`); an affine-free norm shares `linear` itself."""
        from ..algebra.tensors import fold_affine
        from .norms import CRMSNorm, RMSNorm

        if not isinstance(norm, (RMSNorm, CRMSNorm)):
            raise TypeError(f"NormLinear.fold needs a normfold RMSNorm or CRMSNorm, got {type(norm).__name__}")
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"NormLinear.fold needs an nn.Linear reader, got {type(linear).__name__}")
        if norm.weight is not None or norm.bias is not None:
            w, b = fold_affine(linear.weight.detach(), None if linear.bias is None else linear.bias.detach(),
                               norm.weight, norm.bias, in_dim=1)
            folded = nn.Linear(linear.in_features, linear.out_features, bias=b is not None,
                               device=w.device, dtype=w.dtype)
            with torch.no_grad():
                folded.weight.copy_(w)
                if b is not None:
                    folded.bias.copy_(b)
            linear = folded
        return cls(linear, norm.eps, compressed=isinstance(norm, CRMSNorm))

    def forward(self, x: Tensor, scale: Tensor | None = None) -> Tensor:
        """`scale`: the row scale of x when already computed (one `ops.row_scale` can serve every
        linear that reads the same norm, e.g. separate Q, K and V projections)."""
        if scale is None:
            _, scale = ops.row_scale(x, eps=self.eps, compressed=self.compressed)
        out = F.linear(x, self.linear.weight)
        scale = scale.unsqueeze(-1).to(out.dtype)
        if self.linear.bias is None:
            return out * scale
        return torch.addcmul(self.linear.bias.to(out.dtype), out, scale)

    def extra_repr(self) -> str:
        return f"eps={self.eps}, compressed={self.compressed}"
