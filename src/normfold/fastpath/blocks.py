"""Residual add fused with the next norm inside transformers' blocks (Liger-Kernel's pattern), see
normfold.fastpath. A family adds one `FusedBlock` to the registry (`register`), in its own module under
`normfold.fastpath.families`: the block's class name, the transformers module that defines it, the norm
that reads the fused sum, a factory for the patched forward, and the forward's parameters the patch was
written against (a transformers release whose forward takes other parameters keeps its own code)."""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Callable

from torch import nn

from ..nn import CRMSNorm, RMSNorm

NORMS = (RMSNorm, CRMSNorm)  # normfold's norms: forward(x, residual) returns (x + residual, norm(x + residual))


@dataclass(frozen=True)
class FusedBlock:
    """How one transformers block class runs its residual add inside the next norm.

    `forward(base)` returns the patched forward, given the transformers class (the patch falls back to
    `base.forward` where it does not apply: cross-attention, a norm converted back to LayerNorm, ...).
    `norms` names every norm attribute that the patched forward calls with a residual: all must be
    normfold stream norms (`fusable`) for the block to be fused. `applies(block)`, when given, must also
    hold (a configuration the patch covers: GPT-NeoX's sequential residual, Falcon's non-parallel block).
    `hands_off`: the patched forward forms its last add with `handoff.add` (the cross-block hand-off to
    the next norm, see normfold.fastpath.handoff). `entry`: candidate attribute names of the norm that
    first reads the block's input (the first present one is the previous block's hand-off target)."""

    class_name: str
    module: str
    norms: tuple[str, ...]
    forward: Callable[[type], Callable]
    parameters: tuple[str, ...]
    applies: Callable[[nn.Module], bool] | None = None
    hands_off: bool = False
    entry: tuple[str, ...] = ()


FUSED_BLOCKS: dict[str, FusedBlock] = {}


def register(spec: FusedBlock) -> FusedBlock:
    if spec.class_name in FUSED_BLOCKS:
        raise ValueError(f"a fused block for {spec.class_name} is already registered")
    FUSED_BLOCKS[spec.class_name] = spec
    return spec


def fusable(norm: nn.Module | None) -> bool:
    """A normfold stream norm whose forward takes the fused `residual` argument and runs it fused: RMSNorm,
    CRMSNorm, and the compressed stream's CRMSNorm (normfold.compress.runtime.StreamCRMSNorm, recognized
    by its `width` / `pad` / `decompress` attributes: this module sits below compress) when it neither pads
    nor decompresses. Any other norm whose class sets `fuses_residual_add = True` takes the same
    `forward(x, residual) -> (x + residual, norm(x + residual))` contract: normfold.train's prepared
    LayerNorms (training on the fused path)."""
    if getattr(type(norm), "fuses_residual_add", False):
        return True
    if not isinstance(norm, NORMS):
        return False
    if hasattr(norm, "width"):
        return not getattr(norm, "pad", True) and not getattr(norm, "decompress", True)
    return type(norm) in (RMSNorm, CRMSNorm)


_FUSED_CLASSES: dict[type, type] = {}
_FUSED_MARK = "_normfold_fused_block"


def is_fused(block: nn.Module) -> bool:
    """Whether fuse_block has been applied to `block`."""
    return bool(getattr(type(block), _FUSED_MARK, False))


def fuse_block(block: nn.Module) -> bool:
    """Swap `block`'s class for a subclass (same name) whose forward fuses the residual add with the
    next norm, when the block is of a registered family and its norms are normfold stream norms."""
    spec = FUSED_BLOCKS.get(type(block).__name__)
    if spec is None or is_fused(block) or type(block).__module__ != spec.module \
            or not all(fusable(getattr(block, n, None)) for n in spec.norms) \
            or (spec.applies is not None and not spec.applies(block)):
        return False
    base = type(block)
    cls = _FUSED_CLASSES.get(base)
    if cls is None:
        if tuple(inspect.signature(base.forward).parameters) != spec.parameters:
            return False
        cls = type(base.__name__, (base,), {"forward": spec.forward(base), "__module__": __name__,
                                            "__qualname__": f"fused.{base.__name__}", _FUSED_MARK: True})
        _FUSED_CLASSES[base] = cls
    block.__class__ = cls
    return True


def unfuse_block(block: nn.Module) -> bool:
    """Undo fuse_block (the block gets its transformers class back)."""
    if not is_fused(block):
        return False
    block.__class__ = type(block).__mro__[1]
    return True


def fuse_blocks(model: nn.Module) -> int:
    return sum(fuse_block(m) for m in list(model.modules()))
