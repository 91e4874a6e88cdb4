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


def pack_nibbles(u: torch.Tensor, block_size: int, pad_value: int = 8) -> np.ndarray:
    """uint8 levels u [N, K] in [0, 15] → MatMulNBits' B: uint8 [N, blocks, block_size / 2], low nibble first."""
    n, k = u.shape
    pad = (-k) % block_size
    u = u.to(torch.uint8)
    if pad:
        u = torch.nn.functional.pad(u, (0, pad), value=pad_value)
    u = u.reshape(n, -1, block_size)
    return (u[..., 0::2] | (u[..., 1::2] << 4)).numpy().astype(np.uint8)


def pack4(q: torch.Tensor, block_size: int) -> np.ndarray:
    """int8 q [N, K] in [-7, 7] → MatMulNBits' B (q + 8: the default zero point 8)."""
    return pack_nibbles((q.to(torch.int16) + 8).to(torch.uint8), block_size)


def pack_zero_points(zero: torch.Tensor) -> np.ndarray:
    """uint8 zero points [N, blocks] in [0, 15] → MatMulNBits' zero_points: uint8 [N · ceil(blocks / 2)],
    two per byte, low nibble first, each row padded to whole bytes."""
    z = zero.to(torch.uint8)
    if z.shape[1] % 2:
        z = torch.nn.functional.pad(z, (0, 1), value=0)
    return (z[:, 0::2] | (z[:, 1::2] << 4)).reshape(-1).numpy().astype(np.uint8)


def unpack_nibbles(b: np.ndarray, k: int) -> torch.Tensor:
    """MatMulNBits' B [N, blocks, block_size / 2] → uint8 levels [N, K] (the inverse of `pack_nibbles`)."""
    t = torch.from_numpy(np.array(b, dtype=np.uint8))
    u = torch.stack([t & 15, t >> 4], dim=-1).reshape(t.shape[0], -1)
    return u[:, :k]


def nbits_block(k: int, group_size: int | None) -> int:
    """MatMulNBits' block_size for a weight of K input columns: the group size, or (one scale per output row)
    the smallest power of two ≥ max(K, 16), so that one block covers the row."""
    if group_size is not None:
        return group_size
    b = 16
    while b < k:
        b *= 2
    return b


def _nbits_arrays(weight: torch.Tensor, block_size: int, method: str, weights) -> tuple:
    """(B, scales, zero_points or None, block_size) for weight [N, K]."""
    from ..quant import quantize_weight

    if weights is None:
        iw = quantize_weight(weight.contiguous(), bits=4, group_size=block_size, method=method)
        return pack4(iw.q, block_size), iw.scale.reshape(-1).numpy().astype(np.float32), None, block_size
    qw = weights(weight)
    if qw.bits != 4 or qw.q.shape != weight.shape:
        raise ExportError(f"MatMulNBits writes 4-bit weights: got {qw.bits}-bit levels of shape {tuple(qw.q.shape)}")
    bs = nbits_block(weight.shape[1], qw.group_size)
    scales = qw.scale.to(torch.float32).reshape(-1).numpy().astype(np.float32)
    if qw.zero is None:
        return pack4(qw.q, bs), scales, None, bs
    return (pack_nibbles(qw.q.to(torch.uint8), bs, pad_value=0), scales,
            pack_zero_points(qw.zero.to(torch.uint8)), bs)


def quantize_int4(src, dst, block_size: int = 32, method: str = "rtn", accuracy_level: int = 1,
                  weights=None) -> int:
    """Rewrite every MatMul / Gemm with a constant weight as MatMulNBits with normfold's 4-bit weights;
    returns how many nodes were rewritten. `weights`: a callable float weight [N, K] → 4-bit
    `QuantizedWeight` (symmetric: B = q + 8, no zero points; asymmetric: B = q, zero points packed),
    e.g. a GPTQ `RowTable.lookup`; its group size is the node's block_size (per output row: one block ≥ K).
    Without it, `normfold.quant.quantize_weight(method)` with `block_size`."""
    require_onnx()
    import onnx
    from onnx import helper, numpy_helper

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
        b, scales, zeros, bs = _nbits_arrays(weight.contiguous(), block_size, method,
                                             None if weights is None else (lambda x, _w=w_name: weights(x, _w)))
        base = f"{w_name}_nbits{count}"
        new_inits.append(numpy_helper.from_array(b, base + "_q4"))
        new_inits.append(numpy_helper.from_array(scales, base + "_scales"))
        inputs = [node.input[0], base + "_q4", base + "_scales"]
        if zeros is not None:
            new_inits.append(numpy_helper.from_array(zeros, base + "_zp"))
            inputs.append(base + "_zp")
        kw = dict(domain="com.microsoft", K=k, N=n, bits=4, block_size=bs, accuracy_level=accuracy_level)
        if node.op_type == "Gemm" and len(node.input) > 2 and node.input[2]:
            bias = node.input[2]
            if bias in inits and list(inits[bias].dims) == [n]:
                inputs += [""] * (5 - len(inputs)) + [bias]  # zero_points, g_idx, bias
            else:  # a broadcast C: keep it as an Add
                out = node.output[0] + "_nbits"
                new_nodes.append(helper.make_node("MatMulNBits", inputs, [out], name=node.name + "_nbits", **kw))
                new_nodes.append(helper.make_node("Add", [out, bias], [node.output[0]], name=node.name + "_bias"))
                used.add(w_name)
                count += 1
                continue
        new_nodes.append(helper.make_node("MatMulNBits", inputs, list(node.output), name=node.name + "_nbits", **kw))
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


def gemm_as_matmul(src, dst) -> int:
    """Rewrite each Gemm (transA 0, alpha = beta = 1) with a constant weight as MatMul (+ Add of its bias), so
    that onnxruntime's own `MatMulNBitsQuantizer`, which converts MatMul only, sees every linear; returns how
    many. The function is the same (the weight is transposed once where transB is set)."""
    require_onnx()
    import onnx
    from onnx import helper, numpy_helper

    model = onnx.load(str(src))
    graph = model.graph
    inits = {t.name: t for t in graph.initializer}
    new_nodes, new_inits, count = [], [], 0
    for node in graph.node:
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        if (node.op_type != "Gemm" or node.input[1] not in inits or attrs.get("transA", 0)
                or attrs.get("alpha", 1.0) != 1.0 or attrs.get("beta", 1.0) != 1.0):
            new_nodes.append(node)
            continue
        w = numpy_helper.to_array(inits[node.input[1]])
        if attrs.get("transB", 0):
            name = node.input[1] + "_kn"
            new_inits.append(numpy_helper.from_array(np.ascontiguousarray(w.T), name))
        else:
            name = node.input[1]
        has_bias = len(node.input) > 2 and node.input[2]
        mm_out = node.output[0] + "_mm" if has_bias else node.output[0]
        new_nodes.append(helper.make_node("MatMul", [node.input[0], name], [mm_out], name=node.name + "_mm"))
        if has_bias:
            new_nodes.append(helper.make_node("Add", [mm_out, node.input[2]], [node.output[0]], name=node.name + "_add"))
        count += 1
    graph.initializer.extend(new_inits)
    del graph.node[:]
    graph.node.extend(new_nodes)
    still = {i for nd in graph.node for i in nd.input}
    keep = [t for t in graph.initializer if t.name in still]
    del graph.initializer[:]
    graph.initializer.extend(keep)
    onnx.save(model, str(dst))
    return count


def quantize_int4_onnxruntime(src, dst, block_size: int = 32, symmetric: bool = True, accuracy_level: int = 1) -> None:
    """onnxruntime's own 4-bit quantizer (`MatMulNBitsQuantizer`, round to nearest per block) on every linear:
    Gemm rewritten as MatMul first (`gemm_as_matmul`)."""
    require_onnx()
    import onnx
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    tmp = Path(str(dst) + ".mm.onnx")
    try:
        gemm_as_matmul(src, tmp)
        logging.getLogger().setLevel(logging.ERROR)
        with contextlib.redirect_stdout(io.StringIO()):
            q = MatMulNBitsQuantizer(onnx.load(str(tmp)), bits=4, block_size=block_size, is_symmetric=symmetric,
                                     accuracy_level=accuracy_level)
            q.process()
        q.model.save_model_to_file(str(dst))
    finally:
        tmp.unlink(missing_ok=True)


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
