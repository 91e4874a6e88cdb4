"""Modules users put in models."""

from __future__ import annotations

from torch import nn

from .norm_linear import NormLinear
from .norms import AddCRMSNorm, AddRMSNorm, CRMSNorm, Recenter, RMSNorm
from .tied import TiedHead
from .offline import METHODS, FixedAffine, FoldedNorm, Method, OfflineNorm, UnifiedNorm, padding, reset_steps

# Norm classes a saved report may name (normfold.load looks them up here); later modules register more.
NORM_TYPES: dict[str, type[nn.Module]] = {"RMSNorm": RMSNorm, "CRMSNorm": CRMSNorm}


def register_norm_type(cls: type[nn.Module]) -> type[nn.Module]:
    NORM_TYPES[cls.__name__] = cls
    return cls


def norm_type(name: str) -> type[nn.Module]:
    try:
        return NORM_TYPES[name]
    except KeyError:
        raise KeyError(f"unknown normfold norm type {name!r}; known: {', '.join(NORM_TYPES)}") from None


for _cls in (OfflineNorm, UnifiedNorm, FixedAffine, FoldedNorm):
    register_norm_type(_cls)

__all__ = ["RMSNorm", "CRMSNorm", "AddRMSNorm", "AddCRMSNorm", "Recenter", "NormLinear", "NORM_TYPES", "register_norm_type",
           "norm_type", "OfflineNorm", "UnifiedNorm", "Method", "METHODS", "FixedAffine", "FoldedNorm", "padding",
           "reset_steps", "TiedHead"]
