"""Where a module keeps its weight's input and output axes: the one piece of module knowledge the
algebra needs. A registry keyed by module class (by qualified name for classes we do not import,
like transformers' Conv1D), open to plug-ins via `register_layout`.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn


@dataclass(frozen=True)
class Layout:
    """Axes of `module.<weight>`: `out_dim` indexes output features, `in_dim` input features
    (None for tables and parameters that read no input)."""

    out_dim: int
    in_dim: int | None
    weight: str = "weight"
    bias: str | None = "bias"


_BY_CLASS: dict[type, Layout] = {
    nn.Linear: Layout(out_dim=0, in_dim=1),
    nn.Embedding: Layout(out_dim=1, in_dim=None, bias=None),
    nn.Conv1d: Layout(out_dim=0, in_dim=1),
    nn.Conv2d: Layout(out_dim=0, in_dim=1),
    nn.Conv3d: Layout(out_dim=0, in_dim=1),
}
_BY_NAME: dict[str, Layout] = {
    # transformers' GPT-2 style Conv1D stores W as (in, out) and computes x @ W + b.
    "transformers.pytorch_utils.Conv1D": Layout(out_dim=1, in_dim=0),
}


def register_layout(cls: type | str, layout: Layout) -> None:
    """Teach the algebra a new module type (class or 'module.qualname')."""
    if isinstance(cls, str):
        _BY_NAME[cls] = layout
    else:
        _BY_CLASS[cls] = layout


def layout_of(module: nn.Module) -> Layout | None:
    for cls in type(module).__mro__:
        if cls in _BY_CLASS:
            return _BY_CLASS[cls]
        name = f"{cls.__module__}.{cls.__qualname__}"
        if name in _BY_NAME:
            return _BY_NAME[name]
    return None


def is_linear_reader(module: nn.Module) -> bool:
    """A module computing x·W + b over the last axis of its input (foldable reader of a norm)."""
    lay = layout_of(module)
    return lay is not None and lay.in_dim is not None and not isinstance(module, (nn.Conv1d, nn.Conv2d, nn.Conv3d))
