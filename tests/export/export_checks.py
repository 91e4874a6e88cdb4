"""Shared helpers for the deployment tests: ONNX export (dynamo exporter) and an onnxruntime run.

onnx, onnxruntime and onnxscript are the optional `onnx` extra: tests that need them skip without.
"""

from __future__ import annotations

import contextlib
import io
import warnings

import pytest
import torch

from normfold import ops


def need_onnx():
    for name in ("onnx", "onnxscript", "onnxruntime"):
        pytest.importorskip(name)


@pytest.fixture
def kernel_sizes(monkeypatch):
    """Make every input big enough for the C kernel's custom op under torch.compile / export (the
    size at which a converted GPT-2 used to fail to export), whatever the test's shapes."""
    monkeypatch.setattr(ops, "COMPILE_KERNEL_MIN_NUMEL", 0)


def export_onnx(module, args=(), kwargs=None, opset=18):
    """torch.onnx.export(..., dynamo=True) with the exporter's progress printing silenced."""
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")
        return torch.onnx.export(module, args, kwargs=kwargs, dynamo=True, opset_version=opset, verbose=False)


def op_types(program) -> list[str]:
    """Every node type of the ONNX model, functions included."""
    model = program.model
    types = [n.op_type for n in model.graph]
    for fn in model.functions.values():
        types += [n.op_type for n in fn]
    return types


def run_ort(program, path, feeds):
    """Save the ONNX model, open it in onnxruntime (CPU) and run it on `feeds`: {input name: tensor}
    or a list of tensors in the graph's input order. Returns the outputs (numpy arrays)."""
    import onnxruntime as ort

    program.save(str(path))
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    sess = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
    names = [i.name for i in sess.get_inputs()]
    if not isinstance(feeds, dict):
        feeds = dict(zip(names, feeds))
    return sess.run(None, {k: torch.as_tensor(v).numpy() for k, v in feeds.items() if k in names})


def rel(a, b) -> float:
    a, b = torch.as_tensor(a).double(), torch.as_tensor(b).double()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))
