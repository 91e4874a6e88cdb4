"""One quantizer, two engines: GPTQ's symmetric QuantizedWeight becomes the engines' IntWeight with the same
levels and scales (integer.from_quantized), so an exporter writes exactly what GPTQ computed."""

import pytest
import torch

from normfold.quant import dequantize, from_quantized, gptq_quantize, quantize_weight, rtn_quantize


@pytest.mark.parametrize("bits,group", [(8, None), (4, None), (4, 16)])
def test_gptq_weights_reach_the_engine_format_unchanged(bits, group):
    torch.manual_seed(0)
    w = torch.randn(24, 64, dtype=torch.float64)
    x = torch.randn(256, 64, dtype=torch.float64) @ torch.randn(64, 64, dtype=torch.float64)
    qw = gptq_quantize(w, x.T @ x, bits=bits, group_size=group, symmetric=True)
    iw = from_quantized(qw)
    assert iw.q.dtype == torch.int8 and iw.bits == bits and iw.group_size == group
    assert torch.equal(dequantize(iw).double(), qw.dequantize(torch.float32).double())


def test_rtn_agrees_between_the_two_entry_points():
    torch.manual_seed(1)
    w = torch.randn(16, 32)
    a, b = quantize_weight(w, bits=8), from_quantized(rtn_quantize(w, bits=8))
    assert torch.allclose(dequantize(a), dequantize(b), rtol=0, atol=1e-6)


def test_asymmetric_weights_are_refused():
    qw = rtn_quantize(torch.randn(4, 8), bits=4, symmetric=False)
    with pytest.raises(ValueError, match="symmetric"):
        from_quantized(qw)
