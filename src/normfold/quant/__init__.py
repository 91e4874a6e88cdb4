"""Integer weights for the deployment engines: one entry point, `quantize_weight`, that turns a float
weight [out, in] into (integer weight, scales), per output row (int8, CTranslate2's layout) or per
block of input columns (int4, ONNX Runtime's MatMulNBits). Round-to-nearest today; another rounding
(GPTQ) registers itself in `METHODS` and is picked by name."""

from __future__ import annotations

from .integer import METHODS, IntWeight, dequantize, quantize_weight, register_method

__all__ = ["quantize_weight", "dequantize", "IntWeight", "METHODS", "register_method"]
