"""Residual add fused with the next norm inside transformers' blocks (Liger-Kernel's pattern), see
normfold.fastpath. A family lists its `FusedBlock`s in `BLOCKS` of its own module under
`normfold.fastpath.families` (each: the block's class name, the transformers module that defines it, the
norm that reads the fused sum, a factory for the patched forward, and the digests of the transformers
source the patch was copied from, `sources`); that package registers them here (`register`) for every
family whose registry entry (normfold.adapters.families) names the module in `Family.fused`.

The patched forwards are hand copies of transformers code. A copy is used only while the installed
transformers' source of what it copied (the block's forward, and any method the patch relies on, such as
BloomAttention.forward) has one of the recorded digests (`source_digest`: a hash of the code's syntax
tree, so comments, docstrings and formatting do not count). Any other source runs transformers' own
block, unfused (same outputs, without the fusion), with one warning naming the class and the release;
tests/fastpath/test_fused_sources.py fails until the copy is refreshed for that release. Several
copies of one class may be registered, one per source (Falcon's layer dropped `alibi` in 5.25)."""

from __future__ import annotations

import ast
import hashlib
import importlib
import inspect
import textwrap
import warnings
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
    normfold stream norms (`fusable`) for the block to be fused. `sources`: the `source_digest` of the
    transformers code this copy was written from, one per release whose code differs in form only
    (`{digest: "5.24.0"}`, the first release seen with it); `watches`: what that digest covers, as
    "Class.method" names in `module` (the block's forward, and whatever else the patch relies on).
    `applies(block)`, when given, must also hold (a configuration the patch covers: GPT-NeoX's
    sequential residual, Falcon's non-parallel block).
    `hands_off`: the patched forward forms its last add with `handoff.add` (the cross-block hand-off to
    the next norm, see normfold.fastpath.handoff). `entry`: candidate attribute names of the norm that
    first reads the block's input (the first present one is the previous block's hand-off target)."""

    class_name: str
    module: str
    norms: tuple[str, ...]
    forward: Callable[[type], Callable]
    sources: dict[str, str]
    watches: tuple[str, ...] = ()
    applies: Callable[[nn.Module], bool] | None = None
    hands_off: bool = False
    entry: tuple[str, ...] = ()

    def watched(self) -> tuple[str, ...]:
        return self.watches or (f"{self.class_name}.forward",)


FUSED_BLOCKS: dict[str, tuple[FusedBlock, ...]] = {}  # class name -> its copies, one per transformers source


def register(spec: FusedBlock) -> FusedBlock:
    known = FUSED_BLOCKS.get(spec.class_name, ())
    if any(set(spec.sources) & set(k.sources) for k in known):
        raise ValueError(f"a fused block for {spec.class_name} is already registered for that source")
    FUSED_BLOCKS[spec.class_name] = known + (spec,)
    return spec


def _code_digest(fn) -> str:
    """SHA-256 of a function's syntax tree without its docstring (comments and layout do not count)."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(inspect.unwrap(fn))))
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and body \
                and isinstance(body[0], ast.Expr) and isinstance(getattr(body[0], "value", None), ast.Constant) \
                and isinstance(body[0].value.value, str):
            node.body = body[1:] or [ast.Pass()]
    return hashlib.sha256(ast.dump(tree, annotate_fields=False).encode()).hexdigest()[:16]


def source_digest(module: str, watches: tuple[str, ...]) -> str | None:
    """One digest over the installed source of every "Class.method" in `watches` (None where one is missing
    or has no source)."""
    try:
        mod = transformers_module(module)
        parts = []
        for qual in watches:
            cls_name, _, meth = qual.partition(".")
            parts.append(_code_digest(getattr(getattr(mod, cls_name), meth)))
    except (ImportError, AttributeError, OSError, TypeError, SyntaxError):
        return None
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16] if len(parts) > 1 else parts[0]


def transformers_module(path: str):
    """The transformers module `path` names (where a FusedBlock's class lives); nothing outside transformers."""
    if not path.startswith("transformers."):
        raise ImportError(f"{path} is not a transformers module")
    return importlib.import_module(f"transformers.{path.removeprefix('transformers.')}")


def spec_for(cls: type) -> FusedBlock | None:
    """The registered copy written from the installed source of transformers class `cls`, if any."""
    return _spec_for(cls)[0]


_SPEC_CACHE: dict[type, tuple[FusedBlock | None, str | None]] = {}
_WARNED: set[type] = set()


def _spec_for(cls: type) -> tuple[FusedBlock | None, str | None]:
    if cls not in _SPEC_CACHE:
        found, digest = None, None
        for spec in FUSED_BLOCKS.get(cls.__name__, ()):
            if cls.__module__ != spec.module:
                continue
            digest = source_digest(spec.module, spec.watched())
            if digest in spec.sources:
                found = spec
                break
        _SPEC_CACHE[cls] = (found, digest)
    return _SPEC_CACHE[cls]


def _warn_stale(cls: type) -> None:
    if cls in _WARNED:
        return
    _WARNED.add(cls)
    specs = [s for s in FUSED_BLOCKS.get(cls.__name__, ()) if s.module == cls.__module__]
    if not specs:
        return
    try:
        version = importlib.import_module("transformers").__version__
    except (ImportError, AttributeError):
        version = "unknown"
    known = sorted({v for s in specs for v in s.sources.values()})
    warnings.warn(f"normfold: {cls.__name__}'s code in transformers {version} differs from the copy normfold fuses "
                  f"(written for transformers {', '.join(known)}): it runs unfused, with the same outputs and "
                  f"without the fused residual add; a normfold release with a refreshed copy brings it back",
                  RuntimeWarning, stacklevel=3)


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
    next norm, when the block is of a registered family, its transformers source is the one the copy
    was written from, and its norms are normfold stream norms."""
    base = type(block)
    if base.__name__ not in FUSED_BLOCKS or is_fused(block):
        return False
    spec = spec_for(base)
    if spec is None:
        _warn_stale(base)
        return False
    if not all(fusable(getattr(block, n, None)) for n in spec.norms) \
            or (spec.applies is not None and not spec.applies(block)):
        return False
    cls = _FUSED_CLASSES.get(base)
    if cls is None:
        cls = type(base.__name__, (base,), {"forward": spec.forward(base), "__module__": __name__,
                                            "__qualname__": f"fused.{base.__name__}", _FUSED_MARK: True})
        _FUSED_CLASSES[base] = cls
    block.__class__ = cls
    return True


def spec_of(block: nn.Module) -> FusedBlock | None:
    """The copy `block` runs (fused) or would run (its transformers class, when the installed source matches)."""
    return spec_for(type(block).__mro__[1] if is_fused(block) else type(block))


def unfuse_block(block: nn.Module) -> bool:
    """Undo fuse_block (the block gets its transformers class back)."""
    if not is_fused(block):
        return False
    block.__class__ = type(block).__mro__[1]
    return True


def fuse_blocks(model: nn.Module) -> int:
    return sum(fuse_block(m) for m in list(model.modules()))


def installed_sources() -> dict[str, str | None]:
    """{class name: digest of the installed transformers source it watches}, for every registered block (what a
    refreshed copy records in `sources`)."""
    return {name: source_digest(specs[0].module, specs[0].watched()) for name, specs in FUSED_BLOCKS.items()}

