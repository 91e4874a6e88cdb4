"""LayerNorm -> Unified Normalization for fine-tuning (`normfold convert MODEL --to un`).

    model, report = normfold.convert(model, to="un", variant_options={"warmup": 500})
    ... fine-tune model ...
    fused, fusion = normfold.fuse_offline_norms(model)

Unlike the other variants this one changes the model's function: UN normalizes with statistics
gathered over training batches, not per token, so the converted model must be fine-tuned (the
`un` variant is registered with exact=False and its report says that no equivalence check ran).
Each UnifiedNorm starts from its LayerNorm's γ, β and eps.
"""

from __future__ import annotations

from typing import Callable

from torch import nn

from ..adapters.base import parent_and_leaf
from ..conversion import Variant, register_variant
from ..options import ConvertOptions
from ..errors import UnsupportedConversionError
from ..nn.offline import METHODS, OfflineNorm, UnifiedNorm
from ..report import ConversionReport, NormRecord


def swap_layernorms(model: nn.Module, method: str = "un",
                    filter_fn: Callable[[str, nn.Module], bool] | None = None, **options) -> list[str]:
    """Replace (in place) every nn.LayerNorm of `model` over its last dimension for which
    `filter_fn(name, module)` holds with an offline norm (`method` = un, bn, mabn, pn) initialised
    from its γ, β and eps; `options` go to `OfflineNorm` (M, M_grad, alpha, eta, warmup, ...).
    Returns the names of the swapped modules."""
    if method not in METHODS:
        raise ValueError(f"unknown offline norm method {method!r}; known: {', '.join(METHODS)}")
    cls = UnifiedNorm if method == "un" else OfflineNorm
    names = [n for n, m in model.named_modules() if isinstance(m, nn.LayerNorm) and len(m.normalized_shape) == 1
             and (filter_fn is None or filter_fn(n, m))]
    for name in names:
        parent, leaf = parent_and_leaf(model, name)
        ln = getattr(parent, leaf)
        new = cls.from_layernorm(ln, method=method, **options)
        new.train(ln.training)
        setattr(parent, leaf, new)
    return names


_OPTION_TYPES = {"M": int, "M_grad": int, "warmup": int, "alpha": float, "eta": float, "outlier_filtration": bool}


def check_options(options: dict) -> dict:
    """Validate user-given UnifiedNorm options (from `--option KEY=VALUE` or `variant_options`)."""
    unknown = sorted(set(options) - set(_OPTION_TYPES))
    if unknown:
        raise UnsupportedConversionError(f"unknown option(s) for --to un: {', '.join(unknown)}; "
                                         f"known: {', '.join(_OPTION_TYPES)}")
    for key, value in options.items():
        want = _OPTION_TYPES[key]
        ok = isinstance(value, bool) if want is bool else (
            isinstance(value, want if want is int else (int, float)) and not isinstance(value, bool))
        if not ok:
            raise UnsupportedConversionError(f"option {key} must be {want.__name__}, got {value!r}")
    return options


def apply_un(model: nn.Module, plan, options: ConvertOptions, report: ConversionReport) -> None:
    """The "un" variant: every LayerNorm (on the residual stream or not) becomes a UnifiedNorm."""
    try:
        names = swap_layernorms(model, method="un", **check_options(options.variant_options))
    except ValueError as exc:
        raise UnsupportedConversionError(f"cannot build UnifiedNorm with these options: {exc}") from exc
    for name in names:
        norm = model.get_submodule(name)
        report.structure.norms.append(NormRecord(
            name=name, type=type(norm).__name__, eps=norm.eps, weight=norm.weight is not None,
            bias=norm.bias is not None, options=norm.options()))
    # Stock transformers would load γ/β into LayerNorms and silently compute something else.
    report.stock_reloadable = False
    sample = model.get_submodule(names[0]).extra_repr() if names else ""
    report.notes.append(
        f"{len(names)} LayerNorm(s) replaced by UnifiedNorm ({sample}): the model must be fine-tuned before use; "
        "its eval mode uses the running statistics. After training, `normfold fuse DIR --out DIR2` folds every "
        "UnifiedNorm into its adjacent linear layer.")


register_variant(Variant("un", "LayerNorm -> Unified Normalization (paper 004) for fine-tuning; not output-exact",
                         apply_un, exact=False, takes_options=True))
