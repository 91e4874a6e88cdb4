"""GPTQ's integer weights in the engines' files: one quantizer, two engines.

`gptq_model` quantizes a copy of a model layer by layer on calibration batches (`normfold.quant.
quantize_model`, GPTQ with act-order) and returns it with its weights replaced by the dequantized
GPTQ values, plus a `RowTable` of the integer levels, scales and zero points behind every row.

The engines' layout steps then work on the dequantized float model as on any other: CTranslate2's
loaders transpose, concatenate (q/k/v) and permute rows (rotary), torch's ONNX exporter writes Gemm
or MatMul with either weight orientation. Each weight the engine's file is about to hold is looked up
row by row in the table (a row is found by its exact float32 bytes), which gives back the integers
GPTQ computed for that row, whatever the layout did. A row that is not found (a layout that changed
the values themselves) is an error, never a silent re-rounding.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from ..errors import NormfoldError
from ..quant import QuantizedWeight, quantize_model


class IntWeightsError(NormfoldError):
    """GPTQ integer weights that cannot be written as asked (settings, a layout the table cannot follow)."""


@dataclass
class GptqResult:
    model: nn.Module  # the copy, weights = dequantized GPTQ values (float32)
    table: RowTable
    weights: dict[str, QuantizedWeight]  # path → (out, in) levels / scales / zero points
    objectives: dict[str, tuple[float, float]]  # path → (GPTQ objective, RTN objective) on the same Hessian
    skipped: list[str]  # paths left float


class RowTable:
    """Integer levels, scales and zero points by the dequantized float32 row they stand for."""

    def __init__(self, weights: dict[str, QuantizedWeight]):
        self.rows: dict[tuple[int, bytes], tuple[str, int]] = {}
        self.weights = weights
        for name, qw in weights.items():
            deq = qw.dequantize(torch.float32).contiguous()
            for i in range(deq.shape[0]):
                self.rows.setdefault((deq.shape[1], deq[i].numpy().tobytes()), (name, i))

    def lookup(self, w: Tensor, what: str = "weight") -> QuantizedWeight:
        """The QuantizedWeight whose rows dequantize to the rows of `w` ([N, K], float32), in `w`'s row order."""
        w = w.detach().to(torch.float32).contiguous()
        found = []
        for i in range(w.shape[0]):
            hit = self.rows.get((w.shape[1], w[i].numpy().tobytes()))
            if hit is None:
                raise IntWeightsError(f"{what}: row {i} of the engine's [{w.shape[0]}, {w.shape[1]}] weight is no "
                                      "GPTQ row of the model (the engine's layout changed the weight values); "
                                      "nothing written")
            found.append(hit)
        first = self.weights[found[0][0]]
        if any(self.weights[n].group_size != first.group_size or self.weights[n].bits != first.bits
               or (self.weights[n].zero is None) != (first.zero is None) for n, _ in found):
            raise IntWeightsError(f"{what}: its rows come from linears quantized with different settings")
        q = torch.stack([self.weights[n].q[i] for n, i in found])
        scale = torch.stack([self.weights[n].scale[i] for n, i in found])
        zero = None if first.zero is None else torch.stack([self.weights[n].zero[i] for n, i in found])
        return QuantizedWeight(q=q, scale=scale, zero=zero, bits=first.bits, group_size=first.group_size)


def calibration_forward(model: nn.Module) -> None:
    """Refuse models GPTQ's text calibration cannot run (token ids in, one stack)."""
    cfg = getattr(model, "config", None)
    if cfg is None or getattr(cfg, "is_encoder_decoder", False) or not getattr(cfg, "vocab_size", None):
        raise IntWeightsError(f"{type(model).__name__}: GPTQ weights are calibrated on token ids through the model's "
                              "forward; encoder-decoder and non-text models are not supported (export them without "
                              "--int-weights gptq)")


def gptq_model(model: nn.Module, batches: list[Tensor], *, bits: int, group_size: int | None = None,
               symmetric: bool = True, clip=None, act_order: bool = True, damp: float = 0.01,
               skip=(), say=None) -> GptqResult:
    """GPTQ of every linear of a copy of `model` (LM head included; a head tied to the embedding is untied,
    the embedding stays float; `skip`: paths left float) on the calibration `batches` of token ids [batch, seq]."""
    import copy

    calibration_forward(model)
    if not batches:
        raise IntWeightsError("GPTQ needs calibration data: no calibration batches")
    vocab = int(model.config.vocab_size)
    top = max(int(b.max()) for b in batches)
    if top >= vocab:
        raise IntWeightsError(f"calibration token id {top} is outside the model's vocabulary ({vocab}): the "
                              "calibration text was tokenized with another tokenizer; give --calibration FILE "
                              "(tokenized with DIR's tokenizer)")
    cfg = model.config
    limit = next((int(v) for v in (getattr(cfg, k, None) for k in ("n_positions", "max_position_embeddings"))
                  if isinstance(v, int) and v > 0), None)
    if limit is not None:  # windows no longer than the model's positions
        batches = [b[:, :limit] for b in batches]
    qmodel = copy.deepcopy(model).float().eval()
    objectives: dict[str, tuple[float, float]] = {}
    weights = quantize_model(qmodel, batches, method="gptq", bits=bits, group_size=group_size,
                             symmetric=symmetric, act_order=act_order, damp=damp, clip=clip, say=say,
                             objectives=objectives, skip=skip)
    return GptqResult(qmodel, RowTable(weights), weights, objectives, [s for s in skip if s])


def tied_head(model: nn.Module) -> str | None:
    """The path of an output projection that shares the input embedding's weight, or None."""
    out, inp = model.get_output_embeddings(), model.get_input_embeddings()
    if out is None or inp is None or out.weight is not inp.weight:
        return None
    return next(n for n, m in model.named_modules() if m is out)


def objective_summary(objectives: dict[str, tuple[float, float]]) -> dict:
    """GPTQ's layer objective over round-to-nearest's: median, max, and how many layers are below."""
    import statistics

    ratios = [g / r for g, r in objectives.values() if r > 0]
    if not ratios:
        return {"layers": 0}
    return {"layers": len(ratios), "ratio_median": statistics.median(ratios), "ratio_max": max(ratios),
            "below_rtn": sum(g <= r for g, r in objectives.values())}


__all__ = ["RowTable", "GptqResult", "IntWeightsError", "gptq_model", "objective_summary", "tied_head"]
