"""Adapter registry: the built-in families' adapters (named by the family registry, `families.FAMILIES`)
plus plug-ins.

Third-party packages register adapters with an entry point in the group ``normfold.adapters``
whose object is an `Adapter` (or a zero-argument callable returning one or a list of them), or by
calling `register_adapter` at import time.
"""

from __future__ import annotations

import importlib
import warnings
from importlib.metadata import entry_points

import torch
from torch import nn

from ..errors import UnsupportedModelError
from .base import (
    Adapter,
    BlockTemplate,
    Capabilities,
    ConversionPlan,
    KeptNorm,
    NormSite,
    StreamPlan,
    StreamTemplate,
    template_adapter,
)
from .examples import config_inputs
from .families import FAMILIES, Family, get_family

_REGISTRY: dict[str, Adapter] = {}
_loaded = False


def register_adapter(adapter: Adapter, *, replace: bool = False) -> Adapter:
    if adapter.name in _REGISTRY and not replace and _REGISTRY[adapter.name] is not adapter:
        raise ValueError(f"an adapter named {adapter.name!r} is already registered (pass replace=True)")
    _REGISTRY[adapter.name] = adapter
    return adapter


def _load() -> None:
    global _loaded
    if _loaded:
        return
    _loaded = True
    for family in FAMILIES:  # the family registry (families.py): each family's adapter module
        if family.adapter is None:
            continue
        mod = importlib.import_module(f"{__name__}.{family.adapter}")
        for adapter in getattr(mod, "ADAPTERS", None) or [mod.ADAPTER]:
            register_adapter(adapter)
    for ep in entry_points(group="normfold.adapters"):
        try:
            obj = ep.load()
            obj = obj() if callable(obj) and not isinstance(obj, Adapter) else obj
            for adapter in obj if isinstance(obj, (list, tuple)) else [obj]:
                register_adapter(adapter)
        except Exception as exc:  # a broken plug-in must not break normfold
            warnings.warn(f"normfold: adapter plug-in {ep.name!r} failed to load: {exc}", RuntimeWarning)


def list_adapters() -> list[Adapter]:
    _load()
    return list(_REGISTRY.values())


def supported_families() -> str:
    return ", ".join(f"{a.display_name} ({', '.join(a.model_types or a.model_classes)})" for a in list_adapters())


def adapter_for(model: nn.Module) -> Adapter | None:
    """The registered adapter for `model`, or None when no family matches."""
    for adapter in list_adapters():
        if adapter.matches(model):
            return adapter
    return None


def find_adapter(model: nn.Module) -> Adapter:
    """The adapter for `model`, or UnsupportedModelError listing what is supported."""
    adapter = adapter_for(model)
    if adapter is not None:
        return adapter
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    what = type(model).__name__ + (f" (model_type {model_type!r})" if model_type else "")
    raise UnsupportedModelError(
        f"no normfold adapter for {what}. Supported families: {supported_families()}. "
        f"Run `normfold analyze MODEL` to see which of its LayerNorms could be folded and why.")


def example_inputs(model: nn.Module, generator: torch.Generator | None = None, *, adapter: Adapter | None = None,
                   seq: int = 8) -> dict:
    """Forward kwargs to run `model` with: `adapter`'s (default: the registered adapter for `model`)
    example inputs, else inputs built from its config (`examples.config_inputs`, at most `seq` tokens).
    `generator` defaults to one seeded with 0. Every example input normfold makes comes from here."""
    g = generator if generator is not None else torch.Generator().manual_seed(0)
    if adapter is None:
        try:
            adapter = find_adapter(model)
        except UnsupportedModelError:
            return config_inputs(model, g, seq)
    return dict(adapter.example_inputs(model, g))


def family_examples(name: str) -> tuple:
    """The tiny examples (`TinyExample`) of the family called `name`: its adapter's `examples`, or the registry
    entry's own for a family without an adapter."""
    family = get_family(name)
    return get_adapter(family.name).examples if family.adapter is not None else family.examples


def get_adapter(name: str) -> Adapter:
    _load()
    try:
        return _REGISTRY[name]
    except KeyError:
        raise UnsupportedModelError(f"no adapter named {name!r}; known: {', '.join(sorted(_REGISTRY))}") from None


__all__ = [
    "Adapter", "BlockTemplate", "Capabilities", "ConversionPlan", "KeptNorm", "NormSite", "StreamPlan",
    "StreamTemplate", "template_adapter", "register_adapter", "list_adapters", "adapter_for", "find_adapter",
    "get_adapter", "supported_families", "example_inputs", "FAMILIES", "Family", "get_family", "family_examples",
]
