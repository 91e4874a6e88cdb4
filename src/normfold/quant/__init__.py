"""Weight quantization (GPTQ and round-to-nearest) for normfold models: `gptq` works on one layer, `calibrate`
runs it block by block over a whole model on calibration data."""

from .calibrate import quantize_model
from .gptq import QuantizationError, QuantizedWeight, gptq_quantize, objective, rtn_quantize

__all__ = ["QuantizedWeight", "QuantizationError", "gptq_quantize", "rtn_quantize", "objective", "quantize_model"]
