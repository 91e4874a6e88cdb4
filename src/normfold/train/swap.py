"""The class swaps that make a prepared module compute with φ while keeping θ: a subclass with a property per
edited parameter, a LayerNorm subclass whose forward is RMSNorm / CRMSNorm, and the recentring hooks."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from .. import ops
from . import functional as F
from .phi import compiling, phi
from .prepared import StreamState

_CLASSES: dict[tuple, type] = {}


def _get(self: nn.Module, attr: str):
    # φ while this module's own forward runs (or inside torch.compile, which only traces forwards);
    # θ, the registered Parameter, everywhere else: FSDP2, transformers' weight tying, optimizers and
    # users reading `module.weight` between steps see the real parameter.
    if self.__dict__.get("_nf_active") or compiling():
        return phi(self, attr)
    return self._parameters[attr]


def _active_forward(base):
    def forward(self, *args, **kwargs):
        if compiling():
            return base(self, *args, **kwargs)
        d = self.__dict__
        d["_nf_active"] = d.get("_nf_active", 0) + 1
        try:
            return base(self, *args, **kwargs)
        finally:
            d["_nf_active"] -= 1

    return forward


def prepared_class(cls: type, attrs: tuple[str, ...]) -> type:
    key = (cls, attrs)
    if key not in _CLASSES:
        props = {a: property(lambda self, a=a: _get(self, a)) for a in attrs}
        props["_normfold_original_class"] = cls
        props["forward"] = _active_forward(cls.forward)
        _CLASSES[key] = type(f"Prepared{cls.__name__}", (cls,), props)
    return _CLASSES[key]


# ---- the norms -------------------------------------------------------------------------------------

@dataclass
class NormSpec:
    to: str
    keep_weight: bool
    keep_bias: bool
    stream: StreamState


def _crms_scale(x: Tensor) -> Tensor:
    """ops.crms_norm on width d uses d+1 in its statistic; a constant √(d/(d+1)) weight corrects it."""
    d = x.shape[-1]
    return torch.full((d,), (d / (d + 1)) ** 0.5, dtype=x.dtype, device=x.device)


def _norm_forward(self: nn.Module, x: Tensor, residual: Tensor | None = None):
    """The prepared norm. With `residual` (normfold.fastpath's fused blocks call it so) it returns
    (x + residual, norm(x + residual)), the add fused into the norm's pass where the kernel allows."""
    s: NormSpec = self.__dict__["_nf_norm"]
    eps = float(self.eps)
    w = self.weight if s.keep_weight else None
    b = self.bias if s.keep_bias else None
    fallback = self.training and s.stream.layernorm_in_training
    if residual is not None:
        if s.to == "rmsnorm" and not fallback:
            return ops.add_rms_norm(x, residual, w, b, eps)
        if s.to == "crmsnorm" and not fallback and w is None and b is None:
            d = x.shape[-1]
            return ops.add_crms_norm(x, residual, _crms_scale(x), None, eps * d / (d + 1))
        total = x + residual
        return total, _norm_forward(self, total)
    if s.to == "rmsnorm":
        if fallback:
            x = x - x.mean(-1, keepdim=True)
        return ops.rms_norm(x, w, b, eps)
    if fallback:
        x = F.compress_padded(x)
    d = x.shape[-1]
    if w is None and b is None:
        # the readers were folded and compressed: they ignore the last coordinate, no decompression
        return ops.crms_norm(x, _crms_scale(x), None, eps * d / (d + 1))
    y = F.decompress_padded(F.crms_norm_padded(x, eps))
    if w is not None:
        y = y * w
    if b is not None:
        y = y + b
    return y


_NORM_CLASSES: dict[type, type] = {}


def prepared_norm_class(cls: type) -> type:
    if cls not in _NORM_CLASSES:
        _NORM_CLASSES[cls] = type(f"Prepared{cls.__name__}", (cls,),
                                  {"forward": _norm_forward, "_normfold_original_class": cls,
                                   # normfold.fastpath may fuse the residual add before it into this norm
                                   "fuses_residual_add": True})
    return _NORM_CLASSES[cls]



# ---- hooks -------------------------------------------------------------------------------------------

def recenter_hook(crms: bool):
    def hook(module, args, output):
        return F.compress_padded(output) if crms else output - output.mean(-1, keepdim=True)

    return hook


def recenter_pre_hook(crms: bool):
    def fix(x):
        return F.compress_padded(x) if crms else x - x.mean(-1, keepdim=True)

    def hook(module, args, kwargs):
        if args and isinstance(args[0], Tensor):
            return (fix(args[0]), *args[1:]), kwargs
        if isinstance(kwargs.get("hidden_states"), Tensor):
            return args, {**kwargs, "hidden_states": fix(kwargs["hidden_states"])}
        raise TypeError(f"normfold: cannot find the stream input of {type(module).__name__} to recenter")

    return hook


def dropout_hook(crms: bool):
    def hook(module, args, output):
        if module.training and module.p > 0:
            return F.compress_padded(output) if crms else output - output.mean(-1, keepdim=True)
        return output

    return hook
