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

Runtime fast path (`pack`, applied by `normfold.load` / `normfold.convert` unless fast=False):
in bfloat16 on the CPU the separate rank-2 update is a second pass over the V-wide logits (GPT-2 small:
the head ran 1.07x the stock tied matmul). `pack` moves the table into a (V, d+p) buffer
A = [E' | μ | μ | 0…] whose first d columns the embedding's weight becomes a view of (the same
Parameter object, its `.data` re-pointed: state dict, `normfold.save` bytes, optimizers and
`load_state_dict` see the same values), and the head runs one GEMM [z, s_hi, s_lo, 0…]·Aᵀ: the mean term
is accumulated inside the GEMM in float32 instead of added afterwards. The μ columns are copied from
`mean` whenever its or the buffer's version counter moved. It runs only while the weight still lives in
the buffer (data pointer and strides checked each call), with no gradient wanted, outside
torch.compile / torch.export / jit tracing, on the CPU, in AUG_DTYPES (bfloat16); otherwise the formula
above runs.
"""

from __future__ import annotations

import copy

import torch
from torch import Tensor, nn


def _acc(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


# dtypes where `pack` applies: bfloat16 only, where it was measured to pay (GPT-2 small's head, 1x256
# tokens, one thread: 0.98-1.02x the stock tied matmul instead of 1.06-1.07x). float32 keeps the in-place
# addcmul_ (1.01x; the augmented GEMM measured 1.03-1.12x there), and so does float64 (1.03x vs 1.11x);
# tests add float64 to exercise the packed form exactly (monkeypatching this set).
AUG_DTYPES = frozenset({torch.bfloat16})
AUG_PAD = 8  # extra columns: s_hi, s_lo and zeros (a row of 776 bf16 = 1552 bytes)
_AUG = "_normfold_aug"
_AUG_SYNC = "_normfold_aug_sync"
_AUG_WANT = "_normfold_aug_pad"  # set by pack(), cleared by unpack(): re-pack after .to() / .double()


def _tracing() -> bool:
    if torch.jit.is_tracing() or torch.jit.is_scripting():  # TorchScript ONNX export: trace the formula
        return True
    c = getattr(torch, "compiler", None)
    if c is None:
        return False
    for f in ("is_compiling", "is_exporting"):
        fn = getattr(c, f, None)
        if fn is not None and fn():
            return True
    return False


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
        # the copied table's Parameter is a fresh contiguous clone: the buffer would only be dead weight
        saved = {k: self.__dict__.pop(k) for k in (_AUG, _AUG_SYNC, _AUG_WANT) if k in self.__dict__}
        try:
            return deepcopy_module(self, memo)
        finally:
            self.__dict__.update(saved)

    # ---- the packed (one-GEMM) runtime form ----
    def packed(self) -> bool:
        """Whether the table's weight lives in this head's augmented buffer (the fast path may run)."""
        aug = self.__dict__.get(_AUG)
        if aug is None:
            return False
        w = self._table.weight
        return (isinstance(w, Tensor) and w.dtype is aug.dtype and w.device == aug.device and w.dim() == 2
                and w.data_ptr() == aug.data_ptr() and w.shape[0] == aug.shape[0]
                and w.stride() == (aug.shape[1], 1) and aug.shape[1] - w.shape[1] >= 2)

    def pack(self, pad: int = AUG_PAD) -> bool:
        """Move the table's weight into a (V, d+pad) buffer [E' | μ | μ | 0…] (the weight Parameter keeps its
        identity; its data becomes a view of the buffer's first d columns). Returns whether it did."""
        if self.packed():
            return False
        self.__dict__.pop(_AUG, None)
        self.__dict__.pop(_AUG_SYNC, None)
        self.__dict__[_AUG_WANT] = pad
        w = self._table.weight
        if not isinstance(w, nn.Parameter) or w.dim() != 2 or w.dtype not in AUG_DTYPES or w.device.type != "cpu" \
                or pad < 2 or self.mean.shape != (w.shape[0],):
            return False
        with torch.no_grad():
            aug = torch.zeros(w.shape[0], w.shape[1] + pad, dtype=w.dtype, device=w.device)
            aug[:, :w.shape[1]].copy_(w)
            w.data = aug[:, :w.shape[1]]
        self.__dict__[_AUG] = aug
        return True

    def unpack(self) -> bool:
        """Undo `pack`: the table's weight gets contiguous data of its own again."""
        aug = self.__dict__.pop(_AUG, None)
        self.__dict__.pop(_AUG_SYNC, None)
        self.__dict__.pop(_AUG_WANT, None)
        w = self._table.weight
        if aug is None or not isinstance(w, Tensor) or w.data_ptr() != aug.data_ptr():
            return False
        with torch.no_grad():
            w.data = w.data.clone(memory_format=torch.contiguous_format)
        return True

    def _apply(self, fn, *args, **kwargs):
        out = super()._apply(fn, *args, **kwargs)
        pad = self.__dict__.get(_AUG_WANT)
        if pad is not None and not self.packed():
            # .to(dtype) / .cuda() re-homed the table (or will): drop the stale buffer, re-pack where it fits
            self.__dict__.pop(_AUG, None)
            self.__dict__.pop(_AUG_SYNC, None)
            self.pack(pad)
        return out

    def _aug_ready(self, y: Tensor) -> Tensor | None:
        aug = self.__dict__.get(_AUG)
        if aug is None or _tracing():
            return None
        if not self.packed():  # the link broke (the weight was re-homed): the buffer is dead weight
            self.__dict__.pop(_AUG, None)
            self.__dict__.pop(_AUG_SYNC, None)
            return None
        if y.dtype is not aug.dtype or y.device != aug.device:
            return None
        if torch.is_grad_enabled() and (y.requires_grad or any(
                t is not None and t.requires_grad for t in (self._table.weight, self.mean, self.scale, self.bias))):
            return None
        m = self.mean
        if m.device != aug.device:
            return None
        key = (m.data_ptr(), m._version, aug._version)
        if self.__dict__.get(_AUG_SYNC) != key:
            d = self._table.weight.shape[1]
            with torch.no_grad():
                aug[:, d].copy_(m)
                aug[:, d + 1].copy_(m)
            self.__dict__[_AUG_SYNC] = (m.data_ptr(), m._version, aug._version)
        return aug

    def _forward_aug(self, y: Tensor, aug: Tensor) -> Tensor:
        d = y.shape[-1]
        za = y.new_zeros(y.shape[:-1] + (aug.shape[1],))
        z = za[..., :d]
        if self.scale is None:
            z.copy_(y)
        else:
            torch.mul(y, self.scale.to(y.dtype), out=z)
        s = z.sum(dim=-1, dtype=_acc(y.dtype))
        hi = s.to(y.dtype)
        za[..., d] = hi
        if s.dtype is not y.dtype:
            za[..., d + 1] = (s - hi.to(s.dtype)).to(y.dtype)
        return torch.nn.functional.linear(za, aug, None if self.bias is None else self.bias.to(y.dtype))

    def extra_repr(self) -> str:
        return (f"tied to a centred table {tuple(self.weight.shape)}, scale={self.scale is not None}, "
                f"bias={self.bias is not None}")

    def forward(self, y: Tensor) -> Tensor:
        aug = self._aug_ready(y)
        if aug is not None:
            return self._forward_aug(y, aug)
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


def pack_tied_heads(model: nn.Module, pad: int = AUG_PAD) -> int:
    """`TiedHead.pack` on every tied head of `model` (the runtime fast path); returns how many packed."""
    return sum(m.pack(pad) for m in model.modules() if isinstance(m, TiedHead))


def unpack_tied_heads(model: nn.Module) -> int:
    """Undo `pack_tied_heads`."""
    return sum(m.unpack() for m in model.modules() if isinstance(m, TiedHead))
