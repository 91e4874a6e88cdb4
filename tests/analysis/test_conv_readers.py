"""Convolutions in the stream (paper 002 A.3.2): a conv stem writes the channel-first stream (centred over
its output channels), channel LayerNorms (permute → LayerNorm → permute back) are read by convs, whose
input the norm's affine folds into when they see no zero padding."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import normfold
from helpers import rel_err
from normfold.analysis import analyze

C = 8


class ChannelLN(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln = nn.LayerNorm(C)
        with torch.no_grad():
            self.ln.weight.uniform_(0.5, 1.5)
            self.ln.bias.normal_(0, 0.5)

    def forward(self, x):
        return self.ln(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)


class ConvStream(nn.Module):
    def __init__(self, pad: int = 0):
        super().__init__()
        self.stem = nn.Conv2d(3, C, 2, stride=2)
        self.norm1, self.norm2 = ChannelLN(), ChannelLN()
        self.pw1 = nn.Conv2d(C, 2 * C, 1)
        self.pw2 = nn.Conv2d(2 * C, C, 1)
        self.down = nn.Conv2d(C, 2 * C, 3 if pad else 2, stride=2, padding=pad)

    def forward(self, pixels):
        x = self.stem(pixels)
        x = x + self.pw2(F.gelu(self.pw1(self.norm1(x))))
        return self.down(self.norm2(x))


def _pixels():
    return {"pixels": torch.randn(2, 3, 12, 12, generator=torch.Generator().manual_seed(0), dtype=torch.float64)}


@pytest.mark.parametrize("pad", [0, 1])
def test_conv_stream_converts_and_conv_readers_take_the_affine(pad):
    torch.manual_seed(0)
    model = ConvStream(pad).double().eval()
    report = analyze(model, _pixels())
    n1, n2 = report.norm("norm1.ln"), report.norm("norm2.ln")
    assert n1.foldable and n2.foldable
    assert n1.readers == ["pw1"] and n1.affine_foldable
    assert set(report.to_plan().streams[0].writers) == {"stem", "pw2"}
    # the downsampling conv: foldable reader without padding; with zero padding β cannot fold
    assert (n2.readers == ["down"]) == (pad == 0)
    conv, rep = normfold.convert(model, adapter=report.to_adapter(), inputs=_pixels())
    assert rep.verification["passed"] and rep.verification["fp64"]["max_rel_error"] <= 1e-9
    assert conv.norm1.ln.weight is None and conv.norm1.ln.bias is None
    assert (conv.norm2.ln.weight is None) == (pad == 0)
    with torch.no_grad():
        assert rel_err(conv(**_pixels()), model(**_pixels())) <= 1e-12
