"""TiedHead: a linear head that stays tied to a centred embedding table.

Centring a tied embedding table E (V×d) for a zero-mean residual stream gives E' = E − μ1ᵀ, μ the
table's row means. The head that shared E still has to compute the original logits. Since
E = E' + μ1ᵀ, for any head input y (a row of d numbers):

    y·Eᵀ = y·E'ᵀ + (y·1)·μᵀ = y·E'ᵀ + (Σ_k y_k)·μ

so the head reads the centred table itself plus one vector μ (V numbers). When the affine of the
norm before the head was folded into it (`fold_final`), the head computed y·(E·diag γ)ᵀ + b' with
b' = b + β·Eᵀ; that is the same formula on z = y⊙γ, with the folded bias:

    logits = z·E'ᵀ + (Σ_k z_k)·μ + b',    z = y⊙γ (or y when nothing was folded)

The table is referenced, not registered (its module lives elsewhere in the model), so the state
dict holds it once under the embedding's name, plus `mean` (and `scale`, `bias` where present).
Only standard aten ops: linear, mul, sum, add (torch.export / ONNX export keep working).
"""

from __future__ import annotations

import copy

import torch
from torch import Tensor, nn


def _acc(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def deepcopy_module(module: nn.Module, memo: dict) -> nn.Module:
    """`copy.deepcopy` of a head that holds its table's module outside `_modules` (so the table is not a
    submodule twice): every attribute copied through the same memo, so a deep copy of the whole model keeps
    the head reading the copied table. Shared by the Pre-CRMSNorm tied head."""
    new = module.__class__.__new__(module.__class__)
    memo[id(module)] = new
    for k, v in module.__dict__.items():
        object.__setattr__(new, k, copy.deepcopy(v, memo))
    return new


class TiedHead(nn.Module):
    """logits = z·E'ᵀ + (Σz)·mean (+ bias), z = y⊙scale; E' = `table.weight`, shared with the embedding.

    `table`: the embedding module whose (centred) weight is the head's matrix. `mean`: the original
    table's row means (V). `scale`: the folded norm scale γ (d) or None. `bias`: the head's bias
    Parameter (used as given, so an alias such as RoBERTa's lm_head.bias stays shared) or None."""

    def __init__(self, table: nn.Module, mean: Tensor, scale: Tensor | None = None,
                 bias: Tensor | None = None) -> None:
        super().__init__()
        object.__setattr__(self, "_table", table)  # not a submodule: no duplicate in state_dict / parameters()
        self.mean = nn.Parameter(mean.detach().clone(), requires_grad=False)
        self.scale = None if scale is None else nn.Parameter(scale.detach().clone(), requires_grad=False)
        if isinstance(bias, nn.Parameter) or bias is None:
            self.bias = bias
        else:
            self.bias = nn.Parameter(bias.detach().clone(), requires_grad=False)

    @property
    def weight(self) -> Tensor:
        """The shared (centred) table, V×d, as nn.Linear's weight would be."""
        return self._table.weight

    @property
    def in_features(self) -> int:
        return int(self.weight.shape[1])

    @property
    def out_features(self) -> int:
        return int(self.weight.shape[0])

    def __deepcopy__(self, memo):
        return deepcopy_module(self, memo)

    def extra_repr(self) -> str:
        return (f"tied to a centred table {tuple(self.weight.shape)}, scale={self.scale is not None}, "
                f"bias={self.bias is not None}")

    def forward(self, y: Tensor) -> Tensor:
        z = y if self.scale is None else y * self.scale.to(y.dtype)
        w = self.weight.to(y.dtype)
        out = torch.nn.functional.linear(z, w, None if self.bias is None else self.bias.to(y.dtype))
        if z.dtype in (torch.float32, torch.float64):
            # in place on the fresh logits: one pass over them, no V-sized temporary (measured within noise
            # of the stock tied Linear at GPT-2 small's shapes: benchmarks/scripts/tied_head_cost.py)
            return out.addcmul_(z.sum(dim=-1, keepdim=True), self.mean.to(out.dtype))
        # 16-bit: the sum in float32, split into a 16-bit head and tail (s = hi + lo to ~16 bits), then one
        # rank-2 GEMM update in place: the same values as adding in float32 (checked against float64), without
        # the float32 temporary of the whole logits that cost 2x the head's time in bfloat16
        s = z.sum(dim=-1, keepdim=True, dtype=_acc(z.dtype))
        hi = s.to(out.dtype)
        lo = (s - hi.to(s.dtype)).to(out.dtype)
        mean = self.mean.to(out.dtype).reshape(1, -1)
        out.view(-1, out.shape[-1]).addmm_(torch.cat([hi, lo], dim=-1).reshape(-1, 2), mean.expand(2, -1))
        return out

    def untied_linear(self) -> nn.Linear:
        """The plain nn.Linear computing the same function: weight (E' + μ1ᵀ)·diag(scale), computed in
        float64 and rounded once (what stock transformers can load)."""
        w = self.weight.detach()
        full = w.double() + self.mean.detach().double()[:, None]
        if self.scale is not None:
            full = full * self.scale.detach().double()[None, :]
        lin = nn.Linear(w.shape[1], w.shape[0], bias=self.bias is not None, dtype=w.dtype, device=w.device)
        with torch.no_grad():
            lin.weight.copy_(full.to(w.dtype))
            if self.bias is not None:
                lin.bias.copy_(self.bias)
        return lin
