"""Symmetric integer weights: w ≈ q · scale, q in [-(2^(b-1) - 1), 2^(b-1) - 1] (int8: ±127, int4: ±7).

`scale` is per output row ([out]) when `group_size` is None, else per output row and block of
`group_size` input columns ([out, ceil(in / group_size)]). The engines' own formats are written from
this by the exporters: CTranslate2 stores `weight` int8 and `weight_scale` = 1 / scale (its
multiplier); MatMulNBits stores q + 8 as unsigned nibbles with the default zero point 8.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor


@dataclass
class IntWeight:
    q: Tensor  # int8 [out, in], values within ±(2^(bits-1) - 1)
    scale: Tensor  # float32 [out] or [out, blocks]
    bits: int
    group_size: int | None


def _blocks(weight: Tensor, group_size: int | None) -> Tensor:
    """weight [out, in] as [out, blocks, group] (zero-padded), one block per row without groups."""
    out, cols = weight.shape
    if group_size is None:
        return weight.reshape(out, 1, cols)
    pad = (-cols) % group_size
    if pad:
        weight = torch.nn.functional.pad(weight, (0, pad))
    return weight.reshape(out, -1, group_size)


def _absmax_round(weight: Tensor, bits: int, group_size: int | None, top: int) -> IntWeight:
    """Round to nearest on the grid ±top with the absmax scale of each row (or block), stored as `bits`-bit."""
    w = _blocks(weight.detach().to(torch.float64), group_size)
    amax = w.abs().amax(dim=-1)
    scale = torch.where(amax > 0, amax / top, torch.ones_like(amax))
    q = torch.clamp(torch.round(w / scale[..., None]), -top, top)
    q = q.reshape(weight.shape[0], -1)[:, :weight.shape[1]].to(torch.int8)
    scale = scale.to(torch.float32)
    return IntWeight(q, scale[:, 0] if group_size is None else scale, bits, group_size)


def rtn(weight: Tensor, bits: int, group_size: int | None) -> IntWeight:
    """Round to nearest with the absmax scale of each row (or block)."""
    return _absmax_round(weight, bits, group_size, 2 ** (bits - 1) - 1)


def rtn_reduced(weight: Tensor, bits: int, group_size: int | None) -> IntWeight:
    """Round to nearest within one bit less of range (int8: ±63), stored as `bits`-bit integers.

    For int8 GEMMs that multiply uint8 activations by int8 weights with `vpmaddubsw` (x86 AVX2 without
    VNNI: CTranslate2's and onnxruntime's CPU int8 paths), each pair of products is summed in int16 with
    saturation: 2 · 255 · 127 overflows it, 2 · 255 · 63 = 32130 does not. Halving the weight range costs
    one bit of weight precision and removes the saturation (onnxruntime calls this `reduce_range`)."""
    return _absmax_round(weight, bits, group_size, 2 ** (bits - 2) - 1)


METHODS: dict[str, Callable[[Tensor, int, int | None], IntWeight]] = {"rtn": rtn, "rtn-reduced": rtn_reduced}


def register_method(name: str, fn: Callable[[Tensor, int, int | None], IntWeight]) -> None:
    """Add a rounding (e.g. GPTQ, calibrated elsewhere and closed over its data) under `name`."""
    METHODS[name] = fn


def quantize_weight(weight: Tensor, bits: int = 8, group_size: int | None = None, method: str = "rtn") -> IntWeight:
    """The integer form of a float weight [out, in] (see the module docstring for the layout)."""
    if weight.dim() != 2:
        raise ValueError(f"quantize_weight takes a 2-D weight [out, in], got shape {tuple(weight.shape)}")
    if bits not in (4, 8):
        raise ValueError(f"bits must be 4 or 8, got {bits}")
    try:
        fn = METHODS[method]
    except KeyError:
        raise ValueError(f"unknown quantization method {method!r}; known: {', '.join(METHODS)}") from None
    return fn(weight, bits, group_size)


def dequantize(iw: IntWeight) -> Tensor:
    """The float32 weight [out, in] the integer form stands for."""
    q = iw.q.to(torch.float32)
    if iw.group_size is None:
        return q * iw.scale[:, None]
    cols = q.shape[1]
    s = iw.scale.repeat_interleave(iw.group_size, dim=1)[:, :cols]
    return q * s


def from_quantized(qw) -> IntWeight:
    """The engines' `IntWeight` for a symmetric `normfold.quant.gptq.QuantizedWeight` (GPTQ's or its RTN):
    the same integer levels and scales, so what GPTQ computed is what an exporter writes."""
    if qw.zero is not None:
        raise ValueError("the engines' integer weights are symmetric: quantize with symmetric=True")
    scale = qw.scale.to(torch.float32)
    return IntWeight(qw.q.to(torch.int8), scale[:, 0] if qw.group_size is None else scale, qw.bits, qw.group_size)
