"""Converted models in the engines people deploy with: CTranslate2 (`ct2`) and ONNX Runtime's integer
quantization (`ort_quant`). Optional packages; a missing one is a NormfoldError."""
