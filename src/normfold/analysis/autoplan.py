"""Automatic conversion plans: any LayerNorm model converts, with or without a hand-written adapter.

    adapter, analysis = normfold.analysis.autoplan.resolve(model)            # registered adapter, else derived
    converted, report = normfold.convert(model)                      # the same, inside convert()
    converted, report = normfold.convert(model, auto=True)           # the derived plan even with an adapter

A model whose family has a registered adapter uses it. Otherwise the plan comes from the analysis
(`normfold.analyze`): the model is traced on inputs made from its config's modality (token ids, pixel
values, audio features; `inputs=` or `normfold convert --inputs FILE.safetensors` to choose them),
every foldable LayerNorm is converted, the others are kept with the analysis' reason, and the result
is verified exactly as an adapter's conversion is (float64 and working dtype).
"""

from __future__ import annotations

import os
from dataclasses import replace
from typing import Callable

from torch import nn

from ..adapters import Adapter, find_adapter
from ..adapters.examples import modality_inputs, trace_inputs  # noqa: F401  (modality_inputs: its old home)
from ..errors import NormfoldError, UnsupportedModelError
from ..modelinfo import working_dtype


def load_inputs(path: str | os.PathLike) -> dict:
    """Forward keyword arguments from a safetensors file (tensor name = argument name)."""
    from safetensors.torch import load_file

    if not os.path.isfile(path):
        raise NormfoldError(f"--inputs: no such file {path}")
    try:
        inputs = load_file(os.fspath(path))
    except Exception as exc:
        raise NormfoldError(f"--inputs: {path} is not a safetensors file ({exc})") from exc
    if not inputs:
        raise NormfoldError(f"--inputs: {path} holds no tensors")
    return dict(inputs)


def derive_adapter(model: nn.Module, inputs: dict | None = None, *, seed: int = 0,
                   progress: Callable[[str], None] | None = None, **analyze_options):
    """(Adapter, AnalysisReport): the plan `normfold.analyze` derives for `model`, traced on `inputs`
    (default: `modality_inputs`). Raises UnsupportedModelError when no LayerNorm can be converted."""
    # traced as normfold.verify runs the model: floats in its dtype, hidden states (outputs too), no cache
    return adapter_from_inputs(model, trace_inputs(model, inputs, working_dtype(model), seed), progress=progress,
                               **analyze_options)


def adapter_from_inputs(model: nn.Module, inputs: dict, *, progress: Callable[[str], None] | None = None,
                        **analyze_options):
    """`derive_adapter` on inputs already made as the analysis traces them (`adapters.examples.trace_inputs`)."""
    from . import analyze_inputs

    say = progress or (lambda msg: None)
    say(f"no adapter for {type(model).__name__}: deriving the plan from the analysis")
    report = analyze_inputs(model, inputs, progress=say, **analyze_options)
    if "recenter" not in analyze_options and len(report.foldable) < report.total:
        # An explicit Recenter after a module whose output joins the stream (BLOOM's embedding norm) may
        # fold more norms; worth it only then, since it costs one centring per call (the checkpoint stays
        # stock-reloadable: stock LayerNorms re-centre what the Recenter would have).
        graph = getattr(report, "graph", None)
        alt = analyze_inputs(model, inputs, recenter=True, graph=graph, **analyze_options)
        if len([n for n in alt.foldable if n.module]) > len([n for n in report.foldable if n.module]):
            report = alt
    modules = [n for n in report.norms if n.module]
    if not any(n.foldable for n in modules):
        why = "; ".join(f"{n.name}: {n.reason}" for n in modules[:3]) or "it has no LayerNorm module"
        raise UnsupportedModelError(
            f"no LayerNorm of {type(model).__name__} can be converted (the analysis found 0 of {len(modules)} "
            f"foldable: {why}). See `normfold analyze MODEL` for every reason.")
    adapter = report.to_adapter()
    return replace(adapter, display_name=f"derived from the analysis of {report.architecture}"), report


def resolve(model: nn.Module, *, auto: bool = False, inputs: dict | None = None, seed: int = 0,
            progress: Callable[[str], None] | None = None):
    """(Adapter, AnalysisReport | None): the registered adapter for `model`, or with `auto=True` or when
    none is registered, the plan derived from the analysis (see `derive_adapter`)."""
    if not auto:
        try:
            return find_adapter(model), None
        except UnsupportedModelError:
            pass
    return derive_adapter(model, inputs, seed=seed, progress=progress)


def describe(report) -> list[str]:
    """One line per LayerNorm of a derived plan: converted (and where its affine goes) or kept and why."""
    lines = []
    for n in report.norms:
        if not n.module:
            continue
        if n.foldable:
            where = ("affine folded into " + ", ".join(n.readers[:3]) + (" ..." if len(n.readers) > 3 else "")
                     if n.affine_foldable and not n.final else "affine kept in the norm")
            if n.beta_cancels and n.affine_foldable and not n.final:
                where += f"; β's term in bias-free {', '.join(n.beta_cancels)} dropped (it cancels in the softmax)"
            lines.append(f"converted: {n.name} ({where})")
        else:
            lines.append(f"kept: {n.name}: {n.reason}")
    return lines
