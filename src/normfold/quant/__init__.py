"""Weight quantization for normfold models.

- `integer`: the integer weights the deployment engines store, `quantize_weight` (a float weight
  [out, in] -> (integer weight, scales), per output row for int8 as CTranslate2 stores it, or per block
  of input columns for int4 as ONNX Runtime's MatMulNBits does); roundings are registered by name
  (`register_method`), round-to-nearest built in.
- `gptq`: GPTQ and round-to-nearest on one layer given its calibration Hessian XᵀX (`QuantizedWeight`,
  symmetric or asymmetric, groups, act-order, clipping); `integer.from_quantized` turns a symmetric
  `QuantizedWeight` into the engines' `IntWeight`.
- `calibrate`: GPTQ block by block over a whole model on calibration data."""

from .calibrate import quantize_model
from .gptq import QuantizationError, QuantizedWeight, gptq_quantize, objective, rtn_quantize
from .integer import METHODS, IntWeight, dequantize, from_quantized, quantize_weight, register_method

__all__ = ["QuantizedWeight", "QuantizationError", "gptq_quantize", "rtn_quantize", "objective", "quantize_model",
           "quantize_weight", "dequantize", "from_quantized", "IntWeight", "METHODS", "register_method"]
