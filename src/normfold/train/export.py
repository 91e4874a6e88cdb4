"""Bake a prepared model's φ into a normal converted checkpoint."""

from __future__ import annotations

import copy
import os

from torch import nn

from ..errors import UnsupportedConversionError
from .prepare import restore, state


def export(model: nn.Module, out: str | os.PathLike, *, to: str | None = None, force: bool = False,
           verify: bool = True, inputs: dict | None = None, untie: bool = False):
    """Write `out` exactly as `normfold convert` would for the LayerNorm model with the current θ:
    the model is copied, restored to its LayerNorm form and converted with `normfold.convert`
    (same variant as prepared unless `to` says otherwise, same folding options), verified, and
    saved with `normfold.save`. The prepared model is left as it is. Returns (converted, report).
    A tied embedding/head stays tied (nn.TiedHead, loads with normfold.load) unless `untie=True` (the
    untied plain-transformers form, stock-reloadable), as in `normfold.convert`.

    Raises UnsupportedConversionError if `normfold.convert` has no such target (crmsnorm checkpoints
    need a normfold with `convert(to="crmsnorm")`).
    """
    import normfold
    from ..convert import VARIANTS

    st = state(model)
    target = to or st.to
    if target not in VARIANTS:
        raise UnsupportedConversionError(
            f"normfold.convert has no target {target!r} in this version (available: {', '.join(VARIANTS)}); "
            f"export with to='rmsnorm', or keep the LayerNorm checkpoint (restore(model).save_pretrained(...))")
    plain = restore(copy.deepcopy(model))
    was = plain.training
    plain.eval()
    # convert's own defaults (fold the affines), whatever the training form folded
    converted, report = normfold.convert(plain, to=target, fold_final=st.fold_final, verify=verify, inputs=inputs,
                                         inplace=True, untie=untie)
    plain.train(was)
    normfold.save(converted, report, out, force=force)
    return converted, report
