"""CCWT beyond linear layers (paper 002 A.3-A.4): each transform against brute force in float64."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from normfold.algebra.ccwt import (
    RECURRENT_GATES,
    center_conv_writer,
    center_grouped,
    center_recurrent,
    fold_affine_conv,
)

G = torch.Generator().manual_seed(0)
D = torch.float64


def rnd(*shape):
    return torch.randn(*shape, generator=G, dtype=D) + 0.3  # a common offset: nothing is centred by chance


def group_mean(y, groups, dim):
    y = y.movedim(dim, -1)
    return y.reshape(*y.shape[:-1], groups, -1).mean(-1)


@pytest.mark.parametrize("groups", [1, 2, 3, 6])
def test_center_grouped_subtracts_each_groups_mean(groups):
    w, b, x = rnd(12, 5), rnd(12), rnd(7, 5)
    w2, b2 = center_grouped(w, b, 0, groups)
    y, y2 = F.linear(x, w, b), F.linear(x, w2, b2)
    assert group_mean(y2, groups, -1).abs().max() <= 1e-14
    expected = (y.reshape(7, groups, -1) - y.reshape(7, groups, -1).mean(-1, keepdim=True)).reshape(7, 12)
    torch.testing.assert_close(y2, expected, rtol=0, atol=1e-13)


def test_groupnorm_after_grouped_centring_is_a_group_rmsnorm():
    """A.4: centring a writer within GroupNorm's groups leaves GN's output unchanged, and GN on the centred
    output equals the same normalisation without its mean (a grouped RMSNorm)."""
    groups, eps = 3, 1e-5
    w, b, x = rnd(12, 5), rnd(12), rnd(9, 5)
    gamma, beta = rnd(12), rnd(12)
    w2, b2 = center_grouped(w, b, 0, groups)
    y, y2 = F.linear(x, w, b), F.linear(x, w2, b2)
    gn = F.group_norm(y, groups, gamma, beta, eps)
    torch.testing.assert_close(F.group_norm(y2, groups, gamma, beta, eps), gn, rtol=0, atol=1e-12)
    z = y2.reshape(9, groups, -1)
    rms = (z / torch.sqrt(z.pow(2).mean(-1, keepdim=True) + eps)).reshape(9, 12) * gamma + beta
    torch.testing.assert_close(rms, gn, rtol=0, atol=1e-12)
    # centring the whole row (plain CCWT) is NOT enough: each group still has its own mean, so GroupNorm
    # could not drop its mean subtraction
    w1, b1 = center_grouped(w, b, 0, 1)
    assert group_mean(F.linear(x, w1, b1), groups, -1).abs().max() > 1e-3


@pytest.mark.parametrize("conv", ["conv1d", "conv2d"])
def test_conv_writer_output_is_zero_mean_over_channels_at_every_position(conv):
    fn, shape = (F.conv1d, (2, 4, 11)) if conv == "conv1d" else (F.conv2d, (2, 4, 7, 6))
    k = (3,) if conv == "conv1d" else (3, 2)
    w, b, x = rnd(8, 4, *k), rnd(8), rnd(*shape)
    w2, b2 = center_conv_writer(w, b)
    y, y2 = fn(x, w, b, padding=1), fn(x, w2, b2, padding=1)  # zero padding does not matter for writers
    assert y2.mean(1).abs().max() <= 1e-14
    torch.testing.assert_close(y2, y - y.mean(1, keepdim=True), rtol=0, atol=1e-13)
    ln = lambda t: F.layer_norm(t.movedim(1, -1), (8,)).movedim(-1, 1)  # noqa: E731
    torch.testing.assert_close(ln(y2), ln(y), rtol=0, atol=1e-12)


def test_grouped_conv_writer_needs_a_norm_with_finer_groups():
    w, b, x = rnd(8, 2, 3), rnd(8), rnd(2, 4, 9)  # 2 groups: 4 inputs, 8 outputs
    w2, b2 = center_conv_writer(w, b, conv_groups=2, norm_groups=4)
    y, y2 = F.conv1d(x, w, b, groups=2), F.conv1d(x, w2, b2, groups=2)

    def per_position_group_norm(t, g):  # each position's channel groups normalised on their own
        z = t.reshape(t.shape[0], g, -1, t.shape[-1])
        return ((z - z.mean(2, keepdim=True)) / torch.sqrt(z.var(2, unbiased=False, keepdim=True) + 1e-5)).flatten(1, 2)

    assert group_mean(y2, 4, 1).abs().max() <= 1e-14
    torch.testing.assert_close(per_position_group_norm(y2, 4), per_position_group_norm(y, 4), rtol=0, atol=1e-12)
    # torch's GroupNorm pools each group over the positions too: a per-position shift is NOT absorbed, so a
    # conv writer before nn.GroupNorm on feature maps cannot be centred exactly (only on (N, C) vectors)
    assert (F.group_norm(y2, 4) - F.group_norm(y, 4)).abs().max() > 1e-3
    with pytest.raises(ValueError, match="cannot be centred"):
        center_conv_writer(w, b, conv_groups=2, norm_groups=1)
    # why: centring within the conv's groups removes per-group means, which a LayerNorm sees
    w3, b3 = center_grouped(w, b, 0, 2)
    y3 = F.conv1d(x, w3, b3, groups=2)
    ln = lambda t: F.layer_norm(t.movedim(1, -1), (8,))  # noqa: E731
    assert (ln(y3) - ln(y)).abs().max() > 1e-3


@pytest.mark.parametrize("groups", [1, 2])
def test_fold_affine_into_a_conv_reader(groups):
    n, gamma, beta = rnd(2, 4, 6, 5), rnd(4), rnd(4)
    w, b = rnd(6, 4 // groups, 3, 2), rnd(6)
    read = lambda t, w_, b_, p=0: F.conv2d(t, w_, b_, padding=p, groups=groups)  # noqa: E731
    affine = n * gamma[:, None, None] + beta[:, None, None]
    w2, b2 = fold_affine_conv(w, b, gamma, beta, groups)
    torch.testing.assert_close(read(n, w2, b2), read(affine, w, b), rtol=0, atol=1e-12)
    w3, b3 = fold_affine_conv(w, None, gamma, beta, groups)  # a bias appears to absorb β
    torch.testing.assert_close(read(n, w3, b3), read(affine, w, None), rtol=0, atol=1e-12)
    # zero padding: the border taps read 0, not β, so only γ folds exactly
    assert (read(n, w2, b2, 1) - read(affine, w, b, 1)).abs().max() > 1e-3
    wg, bg = fold_affine_conv(w, b, gamma, None, groups)
    torch.testing.assert_close(read(n * gamma[:, None, None], w, b, 1), read(n, wg, bg, 1), rtol=0, atol=1e-12)


def _preactivations(mode, layer, x, h):
    """Each gate's pre-activation (what a LayerNorm-on-gates cell would normalise), by brute force."""
    gates = len(RECURRENT_GATES[mode])
    gi = F.linear(x, layer.weight_ih_l0, layer.bias_ih_l0).chunk(gates, -1)
    gh = F.linear(h, layer.weight_hh_l0, layer.bias_hh_l0).chunk(gates, -1)
    if mode == "GRU":
        r = torch.sigmoid(gi[0] + gh[0])
        return [gi[0] + gh[0], gi[1] + gh[1], gi[2] + r * gh[2]]
    return [a + c for a, c in zip(gi, gh)]


@pytest.mark.parametrize("mode,cls", [("RNN_TANH", nn.RNN), ("LSTM", nn.LSTM), ("GRU", nn.GRU)])
def test_recurrent_gate_preactivations(mode, cls):
    torch.manual_seed(0)
    layer = cls(5, 6).double()
    with torch.no_grad():
        for p in layer.parameters():
            p.add_(0.3)
        new = center_recurrent(layer.weight_ih_l0, layer.weight_hh_l0, layer.bias_ih_l0, layer.bias_hh_l0, mode)
        for p, v in zip((layer.weight_ih_l0, layer.weight_hh_l0, layer.bias_ih_l0, layer.bias_hh_l0), new):
            p.copy_(v)
    x, h = rnd(7, 5), rnd(7, 6)
    for (gate, kept), pre in zip(RECURRENT_GATES[mode], _preactivations(mode, layer, x, h)):
        mean = pre.mean(-1).abs().max().item()
        if kept:
            assert mean <= 1e-14, gate
        else:
            assert mean > 1e-3, gate  # GRU's candidate: r ⊙ (W_hn h + b_hn) is not zero-mean
    # no output of the layer is zero-mean (σ, tanh, ⊙): a recurrent layer never writes the stream
    out, _ = layer(x[None])
    assert out.mean(-1).abs().max() > 1e-3
