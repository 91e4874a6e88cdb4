"""Bake a prepared model's φ into a normal converted checkpoint."""

from __future__ import annotations

import copy
import os

from torch import nn

from ..errors import UnsupportedConversionError
from ..options import ConvertOptions, resolve as resolve_options
from .prepare import restore, state


def export(model: nn.Module, out: str | os.PathLike, *, to: str | None = None, options: ConvertOptions | None = None,
           keep_affine: bool | None = None, fold_final: bool | None = None, allow_new_bias: bool | None = None,
           untie: bool | None = None, force: bool = False, verify: bool = True,
           inputs: dict | None = None):
    """Write `out` exactly as `normfold convert` would for the LayerNorm model with the current θ:
    the model is copied, restored to its LayerNorm form and converted with `normfold.convert`
    (same variant as prepared unless `to` says otherwise, same folding options), verified, and
    saved with `normfold.save`. The prepared model is left as it is. Returns (converted, report).
    A tied embedding/head stays tied (the trained table itself, shared with the stock head, a Recenter after
    the embedding; loads with normfold.load) unless `untie=True` (the untied plain-transformers form,
    stock-reloadable), as in `normfold.convert`.

    `options` / keywords (`normfold.ConvertOptions` fields) choose the checkpoint's form; by default the
    prepared target and fold_final, with convert's own default of folding every affine.

    Raises UnsupportedConversionError if `normfold.convert` has no such target (crmsnorm checkpoints
    need a normfold with `convert(to="crmsnorm")`).
    """
    from .. import compress  # noqa: F401  (registers --to crmsnorm)
    from ..conversion import VARIANTS, convert
    from ..io import save

    st = state(model)
    options = resolve_options(options, "train.export", to=to or (options.to if options else st.to),
                              keep_affine=keep_affine, allow_new_bias=allow_new_bias, untie=untie,
                              fold_final=st.fold_final if fold_final is None and options is None else fold_final)
    target = options.to
    if target not in VARIANTS:
        raise UnsupportedConversionError(
            f"normfold.convert has no target {target!r} in this version (available: {', '.join(VARIANTS)}); "
            f"export with to='rmsnorm', or keep the LayerNorm checkpoint (restore(model).save_pretrained(...))")
    plain = restore(copy.deepcopy(model))
    was = plain.training
    plain.eval()
    # convert's own defaults (fold the affines), whatever the training form folded
    converted, report = convert(plain, options=options, verify=verify, inputs=inputs, inplace=True)
    plain.train(was)
    save(converted, report, out, force=force)
    return converted, report
