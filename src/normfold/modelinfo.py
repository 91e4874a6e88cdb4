"""Facts read off a model that several layers need (convert, verify, io, analysis).

Kept in a module of its own so that those layers depend on it instead of on each other.
"""
from __future__ import annotations

import torch
from torch import nn


def working_dtype(model: nn.Module) -> torch.dtype:
    """The dtype the model computes in: that of its first floating-point parameter."""
    for p in model.parameters():
        if p.is_floating_point():
            return p.dtype
    return torch.float32
