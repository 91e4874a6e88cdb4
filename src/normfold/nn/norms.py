"""Norm modules that converted models use: RMSNorm (optional weight and bias), CRMSNorm, Recenter,
and the fused residual-add variants AddRMSNorm / AddCRMSNorm."""

from __future__ import annotations

import numbers

import torch
from torch import Tensor, nn

from .. import ops
from ..ops import cpu as _cpu
from ..ops.registry import LN_ROUTE_MAX_NUMEL  # noqa: F401  (normfold.nn.norms.LN_ROUTE_MAX_NUMEL)
from ..ops.registry import cpu_fast_path as _cpu_fast_path
from ..ops.registry import jit_tracing as _jit_tracing

_LN_DTYPES = frozenset((torch.float32, torch.bfloat16, torch.float16))


def _stashed(norm: nn.Module, x: Tensor) -> Tensor | None:
    """norm(x) if normfold.fastpath.handoff left it for exactly this x (the previous block's fused add),
    else None. The dict lookup comes first: most norms have no stash, and is_compiling costs more."""
    stash = norm.__dict__.get("_normfold_handoff")
    if stash is None or stash.ref is None or torch.compiler.is_compiling():
        return None
    return stash.take(norm, x)


def _no_grad_needed(x: Tensor, w, b) -> bool:
    return not torch.is_grad_enabled() or not (x.requires_grad or (w is not None and w.requires_grad)
                                               or (b is not None and b.requires_grad))


def _add_norm(x: Tensor, residual: Tensor, w, b, eps: float, compressed: bool) -> tuple[Tensor, Tensor]:
    """ops.add_(c)rms_norm(x, residual, w, b, eps); in the common CPU inference case the kernel is called
    directly (cpu.fast_add_forward: the same call, without the dispatcher's selection and set-up, a few µs
    of Python per fused block)."""
    if _cpu_fast_path[0] and x.is_cpu and _no_grad_needed(x, w, b) and not (torch.is_grad_enabled()
            and residual.requires_grad) and not torch.compiler.is_compiling() and not _jit_tracing():
        out = _cpu.fast_add_forward(x, residual, w, b, eps, compressed)
        if out is not None:
            return out
    return (ops.add_crms_norm if compressed else ops.add_rms_norm)(x, residual, w, b, eps)


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
        ops.load_kernels()  # load the fast kernels now: torch.compile cannot load them while tracing

    def _affine(self) -> tuple[Tensor | None, Tensor | None]:
        """(weight, bias) as `self.weight, self.bias` gives them, for less: nn.Module.__getattr__ costs
        ~0.4 µs per parameter (torch 2.13, measured), a tenth of a decode-sized norm call, while
        `_parameters` is the dict it reads them from. Anything not in it (None when folded away, a
        parametrization's property) is looked up the ordinary way."""
        p = self._parameters
        w = p["weight"] if "weight" in p else self.weight
        b = p["bias"] if "bias" in p else self.bias
        return w, b

    def extra_repr(self) -> str:
        return (f"{self.normalized_shape[0]}, eps={self.eps}, weight={self.weight is not None}, "
                f"bias={self.bias is not None}")


class RMSNorm(_AffineNorm):
    """y = x / sqrt(mean(x²) + eps) · weight + bias over the last dimension.

    On a zero-mean input this equals LayerNorm with the same eps, weight and bias; that is what
    makes a converted Pre-LN model exact. Uses normfold's fast kernels (see `normfold.ops`).

    `zero_mean_input` (set by `from_layernorm`, i.e. on every norm a conversion swaps in, whose
    input is zero-mean by construction) allows the LayerNorm route: on CPU, when no gradient is
    needed and either the input is tiny (≤ LN_ROUTE_MAX_NUMEL elements: decode steps, where a call's
    fixed cost dominates) or the C kernel is unavailable (no compiler), the norm runs as aten's fused
    `layer_norm`. On a zero-mean x that is RMSNorm up to rounding: it subtracts the mean that the
    stored x has (zero in exact arithmetic, a rounding residue of the stream's dtype in practice:
    ≤ a few ulps of x / √d) and computes the variance about it, so the two results differ by
    rounding only (tests/nn/test_norm_routes.py measures it against the float64 reference).
    """

    zero_mean_input = False

    def forward(self, x: Tensor, residual: Tensor | None = None):
        """RMSNorm(x); with `residual`, the residual add fused in: returns (s, RMSNorm(s)) with
        s = x + residual (what `normfold.fastpath`'s fused blocks call; hooks on the module see it)."""
        if residual is not None:
            return self._add_forward(x, residual)
        y = _stashed(self, x)
        if y is not None:
            return y
        w, b = self._affine()
        if _cpu_fast_path[0] and x.is_cpu and _no_grad_needed(x, w, b) and not torch.compiler.is_compiling() \
                and not _jit_tracing():
            if self.zero_mean_input and x.dtype in _LN_DTYPES and (
                    x.numel() <= LN_ROUTE_MAX_NUMEL or _cpu.library() is None):
                return torch.layer_norm(x, self.normalized_shape, w, b, self.eps)
            y = _cpu.fast_forward(x, w, b, self.eps, False)
            if y is not None:
                return y
        return ops.rms_norm(x, w, b, self.eps)

    def _add_forward(self, x: Tensor, residual: Tensor) -> tuple[Tensor, Tensor]:
        # decode-sized inputs keep the unfused pair (the LayerNorm route: same result as the unfused model)
        if self.zero_mean_input and x.numel() <= LN_ROUTE_MAX_NUMEL and not torch.compiler.is_compiling():
            s = x + residual
            w, b = self._affine()
            if _cpu_fast_path[0] and s.is_cpu and s.dtype in _LN_DTYPES and _no_grad_needed(s, w, b):
                # forward(s)'s route for this case, without its second round of checks (decode steps)
                return s, torch.layer_norm(s, self.normalized_shape, w, b, self.eps)
            return s, self.forward(s)
        w, b = self._affine()
        return _add_norm(x, residual, w, b, self.eps, False)

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
        out.zero_mean_input = True  # it replaces a LayerNorm: its input is the zero-mean stream
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

    def forward(self, x: Tensor, residual: Tensor | None = None):
        """CRMSNorm(x); with `residual`: (s, CRMSNorm(s)), s = x + residual, in one fused pass."""
        if residual is not None:
            w, b = self._affine()
            return _add_norm(x, residual, w, b, self.eps, True)
        y = _stashed(self, x)
        if y is not None:
            return y
        w, b = self._affine()
        if _cpu_fast_path[0] and x.is_cpu and _no_grad_needed(x, w, b) and not torch.compiler.is_compiling() \
                and not _jit_tracing():
            y = _cpu.fast_forward(x, w, b, self.eps, True)
            if y is not None:
                return y
        return ops.crms_norm(x, w, b, self.eps)


class AddRMSNorm(_AffineNorm):
    """Residual add fused with RMSNorm: `forward(x, residual)` returns `(s, RMSNorm(s))`, s = x + residual.

    Same parameters as RMSNorm; one pass over memory instead of an add and a norm (the CPU kernel
    and the GPU backends fuse it). s is rounded to the input dtype before it is normalized, so the
    result equals the unfused pair.
    """

    def forward(self, x: Tensor, residual: Tensor) -> tuple[Tensor, Tensor]:
        w, b = self._affine()
        return _add_norm(x, residual, w, b, self.eps, False)


class AddCRMSNorm(_AffineNorm):
    """Residual add fused with CRMSNorm on the compressed (d−1)-wide stream: returns (s, CRMSNorm(s))."""

    def forward(self, x: Tensor, residual: Tensor) -> tuple[Tensor, Tensor]:
        w, b = self._affine()
        return ops.add_crms_norm(x, residual, w, b, self.eps)


class Recenter(nn.Module):
    """x − mean(x) over the last dimension (paper 001 §3.1, step 1)."""

    def forward(self, x: Tensor) -> Tensor:
        return x - x.mean(dim=-1, keepdim=True)
