"""Tracing a model into a `Graph`: torch.export first (robust for transformers models, keeps the
module path of every op), torch.fx symbolic_trace as a fallback for plain nn.Modules that export
cannot handle (e.g. custom ops without fake kernels). Also: example inputs for models without an
adapter (from normfold.adapters), and the names of the model's outputs (as normfold.verify spells them)."""

from __future__ import annotations

import contextlib
import inspect
import io
import logging

import torch
from torch import nn

from ..adapters import example_inputs as adapter_examples
from ..adapters.examples import INPUT_BUILDERS, as_kwargs, forward_params, run_kwargs
from ..adapters.examples import config_inputs as generic_inputs
from ..errors import NormfoldError, UntraceableModelError, first_line
from .graph import Graph, from_export, from_fx

# the old homes of the config-built inputs (now normfold.adapters.examples)
__all__ = ["trace", "example_inputs", "as_kwargs", "output_names", "TRACERS", "INPUT_BUILDERS", "forward_params",
           "generic_inputs"]

TRACERS = ("auto", "export", "fx")


def trace(model: nn.Module, inputs: dict, tracer: str = "auto") -> Graph:
    """Trace `model(**inputs)`; raise UntraceableModelError saying what failed and what to try."""
    if tracer not in TRACERS:
        raise NormfoldError(f"unknown tracer {tracer!r}; choose one of {', '.join(TRACERS)}")
    errors = []
    if tracer in ("auto", "export"):
        try:
            with _quiet_torch_logs():
                ep = torch.export.export(model, (), dict(inputs), strict=False)
            return from_export(ep, model)
        except Exception as exc:  # export raises many types; all mean "cannot trace"
            errors.append(f"torch.export: {first_line(exc)}")
    if tracer == "fx" or (tracer == "auto" and not _is_hf(model)):
        try:
            return _fx(model, inputs)
        except Exception as exc:
            errors.append(f"torch.fx: {first_line(exc)}")
    raise UntraceableModelError(
        f"could not trace {type(model).__name__} with the example inputs ({'; '.join(errors)}). "
        "The analysis needs a graph of the forward pass: data-dependent Python control flow (if on a "
        "tensor's value) and ops without fake-tensor support prevent tracing. Try other inputs "
        "(normfold.analyze(model, inputs={...})), or describe the model with an adapter (docs/adapters.md).")


@contextlib.contextmanager
def _quiet_torch_logs():
    """A failing export prints the partial graph on stderr and logs warnings; the error we raise says
    what matters, so keep the user's terminal clean."""
    names = ("torch.fx.experimental.symbolic_shapes", "torch.export", "torch._export", "torch._dynamo")
    loggers = [logging.getLogger(n) for n in names]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


def _fx(model: nn.Module, inputs: dict) -> Graph:
    from torch.fx.passes.shape_prop import ShapeProp

    sig = inspect.signature(model.forward)
    concrete = {name: p.default for name, p in sig.parameters.items()
                if name not in inputs and p.default is not inspect.Parameter.empty}
    gm = torch.fx.symbolic_trace(model, concrete_args=concrete or None)
    args = []
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            name = node.target.lstrip("*")
            args.append(inputs[name] if name in inputs else concrete.get(name))
    with torch.no_grad():
        ShapeProp(gm).propagate(*args)
    return from_fx(gm, model)


def _is_hf(model: nn.Module) -> bool:
    return hasattr(model, "config") and hasattr(model, "base_model_prefix")


# ---- example inputs -----------------------------------------------------------------------------------

def example_inputs(model: nn.Module, seed: int = 0) -> dict:
    """Inputs to trace with: `normfold.adapters.example_inputs` (the adapter's own when normfold has one,
    else built from the HF config), run as normfold.verify runs the model."""
    from ..modelinfo import working_dtype

    # an adapter's float inputs may be float32
    return run_kwargs(model, adapter_examples(model, torch.Generator().manual_seed(seed)), working_dtype(model))


# ---- output names ---------------------------------------------------------------------------------------

def output_names(graph: Graph) -> list[str | None]:
    """normfold.verify's name ('logits', 'hidden_states[3]', 'output') of each graph output leaf, found
    by rebuilding the output structure around marker tensors (no forward pass needed)."""
    from ..forward import flatten_outputs

    leaves = graph.output.args[0]
    n_user = graph.n_user_outputs or len(leaves)
    names: list[str | None] = [None] * len(leaves)
    if graph.unflatten is None:
        return names
    markers = [torch.zeros(()) for _ in range(n_user)]
    try:
        flat = flatten_outputs(graph.unflatten(markers))
    except Exception:  # names are a nicety (centred-output patterns); never fail the analysis on them
        return names
    by_id = {id(t): name for name, t in flat.items()}
    offset = len(leaves) - n_user  # export lists buffer mutations before the user outputs
    for i, m in enumerate(markers):
        names[offset + i] = by_id.get(id(m))
    return names
