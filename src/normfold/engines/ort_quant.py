"""Integer ONNX models for ONNX Runtime: `normfold export DIR --onnx OUT --quantize {int8,int4}`.

- int8: onnxruntime's `quantize_dynamic` (weights int8 per output channel, activations uint8 per tensor at
  run time) on MatMul / Gemm only (its attention rewrite, QAttention, rejects the opset-23 Attention op);
  the norms stay `RMSNormalization` in float.
- int4: normfold writes the weights itself: every MatMul / Gemm whose weight is a constant becomes
  `com.microsoft.MatMulNBits` (4-bit, blocks of `block_size` input columns, symmetric: q + 8 with the
  default zero point 8) with integer weights from `normfold.quant.quantize_weight`, so a rotated model's
  weights are rounded in its rotated basis. onnxruntime's own `MatMulNBitsQuantizer` converts MatMul only,
  which leaves the Gemm nodes torch's exporter writes for Linear layers in float.
"""

from __future__ import annotations

import contextlib
import io
import logging
from pathlib import Path

import numpy as np
import torch

from ..deploy import ExportError, require_onnx

QUANTIZE = ("int8", "int4")


def quantize_int8(src, dst, reduce_range: bool = False) -> None:
    """`reduce_range`: 7-bit weights (±63), which keeps AVX2 (non-VNNI) u8·s8 pair sums out of int16
    saturation (see normfold.quant.integer.rtn_reduced)."""
    require_onnx()
    from onnxruntime.quantization import QuantType, quantize_dynamic

    logging.getLogger().setLevel(logging.ERROR)  # its "consider pre-processing" advice on every call
    with contextlib.redirect_stdout(io.StringIO()):
        quantize_dynamic(str(src), str(dst), per_channel=True, weight_type=QuantType.QInt8,
                         op_types_to_quantize=["MatMul", "Gemm"], reduce_range=reduce_range)


def pack4(q: torch.Tensor, block_size: int) -> np.ndarray:
    """int8 q [N, K] in [-7, 7] → MatMulNBits' B: uint8 [N, blocks, block_size / 2], low nibble first."""
    n, k = q.shape
    pad = (-k) % block_size
    u = (q.to(torch.int16) + 8).to(torch.uint8)
    if pad:
        u = torch.nn.functional.pad(u, (0, pad), value=8)
    u = u.reshape(n, -1, block_size)
    return (u[..., 0::2] | (u[..., 1::2] << 4)).numpy().astype(np.uint8)


def quantize_int4(src, dst, block_size: int = 32, method: str = "rtn", accuracy_level: int = 1) -> int:
    """Rewrite every MatMul / Gemm with a constant weight as MatMulNBits with normfold's 4-bit weights;
    returns how many nodes were rewritten."""
    require_onnx()
    import onnx
    from onnx import helper, numpy_helper

    from ..quant import quantize_weight

    model = onnx.load(str(src))
    graph = model.graph
    inits = {t.name: t for t in graph.initializer}
    new_nodes, new_inits, used, count = [], [], set(), 0
    for node in graph.node:
        w_name = node.input[1] if len(node.input) > 1 else None
        if node.op_type not in ("MatMul", "Gemm") or w_name not in inits:
            new_nodes.append(node)
            continue
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        if node.op_type == "Gemm" and (attrs.get("transA", 0) or attrs.get("alpha", 1.0) != 1.0
                                       or attrs.get("beta", 1.0) != 1.0):
            new_nodes.append(node)
            continue
        w = torch.from_numpy(numpy_helper.to_array(inits[w_name]).astype(np.float32))
        if w.dim() != 2:
            new_nodes.append(node)
            continue
        weight = w if (node.op_type == "Gemm" and attrs.get("transB", 0)) else w.t()  # [N, K]
        n, k = weight.shape
        iw = quantize_weight(weight.contiguous(), bits=4, group_size=block_size, method=method)
        base = f"{w_name}_nbits{count}"
        new_inits.append(numpy_helper.from_array(pack4(iw.q, block_size), base + "_q4"))
        new_inits.append(numpy_helper.from_array(iw.scale.reshape(-1).numpy().astype(np.float32), base + "_scales"))
        inputs = [node.input[0], base + "_q4", base + "_scales"]
        if node.op_type == "Gemm" and len(node.input) > 2 and node.input[2]:
            bias = node.input[2]
            if bias in inits and list(inits[bias].dims) == [n]:
                inputs += ["", "", bias]  # zero_points, g_idx, bias
            else:  # a broadcast C: keep it as an Add
                out = node.output[0] + "_nbits"
                new_nodes.append(helper.make_node("MatMulNBits", inputs, [out], domain="com.microsoft", K=k, N=n,
                                                  bits=4, block_size=block_size, accuracy_level=accuracy_level,
                                                  name=node.name + "_nbits"))
                new_nodes.append(helper.make_node("Add", [out, bias], [node.output[0]], name=node.name + "_bias"))
                used.add(w_name)
                count += 1
                continue
        new_nodes.append(helper.make_node("MatMulNBits", inputs, list(node.output), domain="com.microsoft", K=k, N=n,
                                          bits=4, block_size=block_size, accuracy_level=accuracy_level,
                                                  name=node.name + "_nbits"))
        used.add(w_name)
        count += 1
    if not count:
        raise ExportError("no MatMul / Gemm with a constant weight in the model: nothing to quantize to int4")
    still = {i for nd in new_nodes for i in nd.input}
    keep = [t for t in graph.initializer if t.name not in used or t.name in still]
    del graph.initializer[:]
    graph.initializer.extend(keep + new_inits)
    del graph.node[:]
    graph.node.extend(new_nodes)
    if not any(o.domain == "com.microsoft" for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    onnx.save(model, str(dst))
    return count


def quantize_file(path, kind: str, **kw) -> None:
    """Quantize the ONNX model at `path` in place (through a temporary file beside it)."""
    if kind not in QUANTIZE:
        raise ExportError(f"--quantize {kind!r}: choose one of {', '.join(QUANTIZE)}")
    path = Path(path)
    tmp = path.with_name(path.stem + ".q" + path.suffix)
    if kind == "int8":
        quantize_int8(path, tmp, **kw)
    else:
        quantize_int4(path, tmp, **kw)
    tmp.replace(path)
