"""Which LayerNorms of a model can be folded into RMSNorms, and why the others cannot.

    report = normfold.analyze(model)              # traces model(**example inputs)
    print(report.table())
    converted, conv_report = normfold.convert(model, adapter=report.to_adapter())

The model is traced (torch.export; torch.fx for plain modules it cannot handle), and a zero-mean
property is propagated through the graph (propagate.py, with the op rules of rules.py). A
LayerNorm is foldable when its input is zero-mean for every input once some writers (embedding
tables, output projections, ...) are centred — writers whose change nothing but norms can see.
"""

from __future__ import annotations

import time
from typing import Callable

from torch import nn

from ..modelinfo import working_dtype
from ..forward import cast_inputs
from .graph import Graph
from .propagate import Options, Propagation
from .report import AnalysisReport, NormReport, WriterReport, build_report
from .rules import RULES, register_rule
from .trace import as_kwargs, example_inputs, output_names, trace


def _has_layernorm_like(model: nn.Module) -> bool:
    return any(isinstance(m, nn.LayerNorm) or "LayerNorm" in type(m).__name__ for m in model.modules())


def analyze(model: nn.Module, inputs=None, *, center_embeddings: bool = True, recenter: bool = False,
            structural: bool = False, recentred_outputs: tuple[str, ...] = (), tracer: str = "auto",
            graph: Graph | None = None,
            progress: Callable[[str], None] | None = None) -> AnalysisReport:
    """Trace `model` on `inputs` (default: example inputs from its adapter or HF config) and report,
    for every LayerNorm, whether it is foldable and why.

    center_embeddings: embedding tables and stream parameters may be centred (False reproduces the
        plain "Foldable" column of paper 002's Table 7).
    recenter: allow explicit Recenter ops after modules whose output joins the stream but cannot be
        centred by weights (BLOOM's embedding LayerNorm); the conversion is then not stock-reloadable.
    structural: a LayerNorm output counts as zero-mean only without affine, never because its γ is
        constant and β zero right now (verdicts that hold for any weights, e.g. for training).
    recentred_outputs: names (or fnmatch patterns, as normfold.verify names them: 'output[1]',
        'encoder_last_hidden_state') of model outputs that carry the residual stream and may come back
        recentred, besides '*hidden_states[i]' and '*last_hidden_state' (the raw stream of a model without
        a final norm). Any other output a centred writer would change blocks it.
    tracer: "auto" (torch.export, then torch.fx for non-HF modules), "export" or "fx".
    graph: a trace of `model(**inputs)` from `normfold.analysis.trace` to reuse (several option sets).
    """
    if _has_layernorm_like(model):  # inputs are made only for a model with something to analyse
        inputs = example_inputs(model) if inputs is None else as_kwargs(model, inputs)
        inputs = cast_inputs(inputs, working_dtype(model))  # floating inputs in the model's dtype, as verify runs it
    return analyze_inputs(model, inputs, center_embeddings=center_embeddings, recenter=recenter,
                          structural=structural, recentred_outputs=recentred_outputs, tracer=tracer, graph=graph,
                          progress=progress)


def analyze_inputs(model: nn.Module, inputs: dict, *, center_embeddings: bool = True, recenter: bool = False,
                   structural: bool = False, recentred_outputs: tuple[str, ...] = (), tracer: str = "auto",
                   graph: Graph | None = None,
                   progress: Callable[[str], None] | None = None) -> AnalysisReport:
    """`analyze` on `inputs` that are already the forward keyword arguments to trace with, floating inputs in
    the model's dtype (`trace.run_kwargs`, `trace.example_inputs`): the one traversal of `model` the analysis
    makes (trace, propagation, report). Options as `analyze`."""
    say = progress or (lambda msg: None)
    opts = Options(center_embeddings=center_embeddings, recenter=recenter, structural=structural,
                   recentred_outputs=tuple(recentred_outputs))
    t0 = time.perf_counter()
    traced = _has_layernorm_like(model)  # nothing to trace in a model without LayerNorms: an empty report
    if traced:
        if graph is None:
            say(f"tracing {type(model).__name__}")
            graph = trace(model, inputs, tracer)
        t1 = time.perf_counter()
        say(f"propagating zero mean through {len(graph.nodes)} nodes")
        if graph.output_names is None:
            graph.output_names = output_names(graph)
        prop = Propagation(graph, model, opts).run()
    else:
        prop = Propagation.empty(model, opts)
    report = build_report(prop, model, graph.output_names if traced else [])
    if not traced:
        report.seconds["analyze"] = round(time.perf_counter() - t0, 3)
        return report
    report.inputs = inputs
    report.graph = graph  # reusable for another option set (not serialized)
    report.seconds.update(trace=round(t1 - t0, 3), analyze=round(time.perf_counter() - t1, 3))
    return report


__all__ = ["analyze", "analyze_inputs", "AnalysisReport", "NormReport", "WriterReport", "Graph", "RULES",
           "register_rule", "trace", "example_inputs"]
