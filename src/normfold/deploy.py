"""Deploying converted models: ONNX export (torch's dynamo exporter), an onnxruntime run to check it,
onnxruntime's transformer optimizer. Used by `normfold export` and `normfold bench onnx`; docs/deploy.md.

Nothing here is needed to export a normfold model: `torch.onnx.export(model, args, dynamo=True)`
works as for the original (the norms become `RMSNormalization` at opset ≥ 23, their decomposition
below; `normfold.ops.portable`). This module adds what a command needs around it: a flat
inputs → outputs wrapper with names, dynamic batch / sequence axes, an opset check, and running the
result in onnxruntime against the PyTorch model.

onnx, onnxscript and onnxruntime are the optional `onnx` extra; a missing one is a NormfoldError.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import logging
import re
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor, nn

from .errors import NormfoldError

# torch's dynamo exporter writes opset 18 and newer: asked for less, it warns and writes 18 anyway.
MIN_OPSET = 18
# The first opset with the standard RMSNormalization op.
RMSNORM_OPSET = 23
DEFAULT_OPSET = 23


class ExportError(NormfoldError):
    """An ONNX export that cannot be done as asked (opset, missing packages, a model the exporter rejects)."""


def require_onnx() -> None:
    missing = [m for m in ("onnx", "onnxscript", "onnxruntime") if importlib.util.find_spec(m) is None]
    if missing:
        raise ExportError(f"ONNX export needs {', '.join(missing)}: pip install 'normfold[onnx]'")


def max_opset() -> int:
    """The newest opset the installed onnx package knows."""
    require_onnx()
    import onnx

    return int(onnx.defs.onnx_opset_version())


def check_opset(opset: int) -> None:
    """Refuse an opset the exporter cannot write the model in, with what to do instead."""
    top = max_opset()
    if opset < MIN_OPSET:
        raise ExportError(f"opset {opset} cannot express this model: torch's ONNX exporter (dynamo=True) writes "
                          f"opset {MIN_OPSET} or newer (the norms' ReduceMean takes its axes as an input from opset "
                          f"18 on, and converting such graphs down fails). Use --opset {MIN_OPSET} to "
                          f"{RMSNORM_OPSET - 1} for the decomposed norms, {RMSNORM_OPSET}+ for RMSNormalization.")
    if opset > top:
        raise ExportError(f"opset {opset} is newer than the installed onnx package knows (up to {top}); "
                          f"use --opset {top} or lower, or upgrade onnx")


def _safe(name: str) -> str:
    return re.sub(r"[^0-9A-Za-z_]+", "_", name).strip("_") or "output"


class FlatModel(nn.Module):
    """`model(**inputs)` as positional tensors in, a flat tuple of named floating outputs out: the
    form an ONNX graph has. Non-tensor inputs and `call_kwargs` are fixed at construction."""

    def __init__(self, model: nn.Module, inputs: dict, call_kwargs: dict | None = None) -> None:
        super().__init__()
        from .verify import flatten_outputs

        self.model = model
        self.input_names = [k for k, v in inputs.items() if isinstance(v, Tensor)]
        self.fixed = {**{k: v for k, v in inputs.items() if k not in self.input_names}, **(call_kwargs or {})}
        with torch.no_grad():
            self.output_names = list(flatten_outputs(model(**inputs, **self.fixed)))

    def args(self, inputs: dict) -> tuple:
        return tuple(inputs[k] for k in self.input_names)

    def forward(self, *args):
        from .verify import flatten_outputs

        out = flatten_outputs(self.model(**dict(zip(self.input_names, args)), **self.fixed))
        return tuple(out[n] for n in self.output_names)


def call_kwargs(model: nn.Module) -> dict:
    """use_cache=False where the model takes it: a deployed graph without the KV-cache outputs."""
    import inspect

    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return {}
    return {"use_cache": False} if "use_cache" in params else {}


@dataclass
class OnnxExport:
    path: Path
    opset: int
    input_names: list[str]
    output_names: list[str]  # ONNX names (sanitized); `outputs` maps them to the model's output names
    outputs: dict[str, str]
    dynamic: bool
    op_counts: dict[str, int] = field(default_factory=dict)
    note: str | None = None
    quantized: dict | None = None  # outputs of the integer model, when one was made


def _dynamic_shapes(args: tuple):
    from torch.export import Dim

    shapes = []
    for a in args:
        dims = {0: Dim.DYNAMIC} if a.dim() >= 1 else {}
        if a.dim() == 2 and not a.is_floating_point():  # token ids / masks: batch × sequence
            dims[1] = Dim.DYNAMIC
        shapes.append(dims)
    return (tuple(shapes),)  # one entry: FlatModel.forward(*args) takes them as one var-positional


def _export(flat: FlatModel, args: tuple, opset: int, dynamic: bool):
    # the exporter logs a warning per missing torchvision op on every export: not the user's concern
    logging.getLogger("torch.onnx._internal.exporter._registration").setLevel(logging.ERROR)
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")
        return torch.onnx.export(flat, args, dynamo=True, opset_version=opset, verbose=False,
                                 input_names=list(flat.input_names),
                                 output_names=[_safe(n) for n in flat.output_names],
                                 dynamic_shapes=_dynamic_shapes(args) if dynamic else None)


def broadcast_rotary_caches(model) -> int:
    """Give every standard `RotaryEmbedding` node of `model` (an onnx_ir Model) cos / sin caches with the
    batch size of its input. Returns the number of nodes changed.

    At opset 23 the exporter's optimizer (onnxscript's opset-23 fusions) replaces transformers' rotary
    arithmetic (GPT-NeoX/Pythia, Phi, ...) by the RotaryEmbedding op. transformers computes cos / sin
    from position ids of batch 1 and lets them broadcast over the batch; the op does not broadcast
    (onnxruntime: "Inputs 'cos_cache' and 'sin_cache' are expected to have the same shape as input
    'x'"), so such a graph failed on any batch above 1. Each cache is expanded to
    (batch of x, sequence, rotary width / 2) in front of the node; the op's numbers are unchanged."""
    import onnx_ir as ir

    changed = 0
    for graph in (model.graph, *model.functions.values()):
        for node in list(graph):
            if node.op_type != "RotaryEmbedding" or node.domain not in ("", "ai.onnx") or len(node.inputs) < 3:
                continue
            if len(node.inputs) > 3 and node.inputs[3] is not None:  # position_ids given: caches are tables
                continue
            x, cos, sin = node.inputs[:3]
            batch = ir.node("Shape", [x], {"start": 0, "end": 1})
            rest = ir.node("Shape", [cos], {"start": 1})
            shape = ir.node("Concat", [batch.outputs[0], rest.outputs[0]], {"axis": 0})
            cos_b = ir.node("Expand", [cos, shape.outputs[0]])
            sin_b = ir.node("Expand", [sin, shape.outputs[0]])
            graph.insert_before(node, [batch, rest, shape, cos_b, sin_b])
            node.replace_input_with(1, cos_b.outputs[0])
            node.replace_input_with(2, sin_b.outputs[0])
            changed += 1
    return changed


def export_onnx(model: nn.Module, inputs: dict, path, opset: int = DEFAULT_OPSET, dynamic: bool = True) -> OnnxExport:
    """Export `model` (called as model(**inputs)) to an ONNX file at `path` with torch's dynamo exporter.

    Batch (and, for token inputs, sequence) axes are dynamic; when the exporter cannot make them so
    for a model, the export is retried with static shapes and `note` says so."""
    require_onnx()
    check_opset(opset)
    model = model.eval()
    flat = FlatModel(model, inputs, call_kwargs(model)).eval()
    args = flat.args(inputs)
    note = None
    try:
        program = _export(flat, args, opset, dynamic)
    except Exception as exc:
        if not dynamic:
            raise ExportError(f"torch.onnx.export failed: {type(exc).__name__}: {str(exc)[:500]}") from exc
        note = f"dynamic axes failed ({type(exc).__name__}); exported with the inputs' static shapes"
        dynamic = False
        try:
            program = _export(flat, args, opset, dynamic)
        except Exception as exc2:
            raise ExportError(f"torch.onnx.export failed: {type(exc2).__name__}: {str(exc2)[:500]}") from exc2
    written = int(program.model.opset_imports.get("", 0))
    if written != opset:
        raise ExportError(f"asked for opset {opset}, the exporter wrote {written}: the model cannot be "
                          f"expressed in opset {opset}; use --opset {written}")
    broadcast_rotary_caches(program.model)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    program.save(str(path))
    return OnnxExport(path, opset, list(flat.input_names), [_safe(n) for n in flat.output_names],
                      {_safe(n): n for n in flat.output_names}, dynamic, op_counts(path), note)


def op_counts(path) -> dict[str, int]:
    """{op type: number of nodes} of the ONNX model at `path` (main graph and its functions)."""
    import onnx

    model = onnx.load(str(path), load_external_data=False)
    counts: dict[str, int] = {}
    for node in [*model.graph.node, *(n for f in model.functions for n in f.node)]:
        counts[node.op_type] = counts.get(node.op_type, 0) + 1
    return counts


def session(path, threads: int | None = None, optimization: str = "all"):
    """An onnxruntime CPU InferenceSession of the model at `path`."""
    require_onnx()
    import onnxruntime as ort

    so = ort.SessionOptions()
    if threads:
        so.intra_op_num_threads = threads
        so.inter_op_num_threads = 1
    so.graph_optimization_level = {"all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
                                   "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
                                   "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
                                   "none": ort.GraphOptimizationLevel.ORT_DISABLE_ALL}[optimization]
    try:
        return ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
    except Exception as exc:  # e.g. an opset newer than this onnxruntime implements
        raise ExportError(f"onnxruntime {ort.__version__} cannot load {path}: {str(exc)[:400]}") from exc


def feeds(sess, inputs: dict) -> dict:
    names = {i.name for i in sess.get_inputs()}
    return {k: v.detach().cpu().numpy() for k, v in inputs.items() if k in names and isinstance(v, Tensor)}


def run_onnx(path_or_session, exported: OnnxExport, inputs: dict, threads: int | None = None) -> dict[str, Tensor]:
    """Run the exported model in onnxruntime; outputs by the model's own output names."""
    sess = path_or_session if not isinstance(path_or_session, (str, Path)) else session(path_or_session, threads)
    outs = sess.run(None, feeds(sess, inputs))
    names = [o.name for o in sess.get_outputs()]
    return {exported.outputs.get(n, n): torch.from_numpy(o) for n, o in zip(names, outs)}


def _heads_hidden(config) -> tuple[int, int]:
    cfg = getattr(config, "text_config", None) or config
    heads = next((getattr(cfg, k) for k in ("num_attention_heads", "n_head", "num_heads", "encoder_attention_heads")
                  if isinstance(getattr(cfg, k, None), int)), 0)
    hidden = next((getattr(cfg, k) for k in ("hidden_size", "n_embd", "d_model", "dim")
                   if isinstance(getattr(cfg, k, None), int)), 0)
    return heads, hidden


def optimize(path, out, config=None) -> str:
    """Apply onnxruntime's transformer optimizer (its fusions: attention, SkipLayerNormalization,
    SimplifiedLayerNormalization, ...) to the model at `path`, writing `out`. The model type is the
    config's where the optimizer knows it, else its generic "bert" fusions (also the fallback when the
    specific one fails). Returns the model type used."""
    require_onnx()
    from onnxruntime.transformers import optimizer

    model_type = getattr(config, "model_type", None)
    heads, hidden = _heads_hidden(config) if config is not None else (0, 0)
    kinds = [model_type] if model_type in optimizer.MODEL_TYPES else []
    errors = []
    for kind in dict.fromkeys(kinds + ["bert"]):
        try:
            # the optimizer's modules log under top-level names ("onnx_model", ...): mute warnings meanwhile
            with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
                warnings.simplefilter("ignore")
                logging.disable(logging.WARNING)
                try:
                    opt = optimizer.optimize_model(str(path), model_type=kind, num_heads=heads, hidden_size=hidden,
                                                   opt_level=0, use_gpu=False)
                    opt.save_model_to_file(str(out))
                finally:
                    logging.disable(logging.NOTSET)
            return kind
        except Exception as exc:  # the optimizer's pattern code fails on graphs it does not expect
            errors.append(f"{kind}: {type(exc).__name__}: {str(exc)[:200]}")
    raise ExportError("onnxruntime's transformer optimizer failed on this model (" + "; ".join(errors)
                      + "); export without --optimize")
