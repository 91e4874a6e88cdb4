"""Column-centred weight transforms beyond linear layers (paper 002 App. A.3-A.4), float64 inside.

- convolution writers: a ConvNd (weight (out, in/groups, *k)) writes zero-mean over its output channels at
  every position iff, for every input channel and kernel tap, its weights over the output channels that
  read that channel sum to zero. Ungrouped: centre over dim 0 (`center_conv_writer`). Grouped: each output
  channel reads its group's inputs only, so the weights must be centred within each group's outputs; that
  subtracts a per-*group* mean, which a LayerNorm does not absorb: a grouped conv writer is centrable only
  before a norm whose groups lie inside the conv's groups (`grouped_writer_exact`).
- convolution readers: a norm's affine γ⊙n + β read by a conv over channels folds like a linear one:
  W[:, i] ← γ_i·W[:, i], b ← b + Σ_{i,k} β_i·W[:, i, k] — the β part exactly only if every output position
  sees the whole kernel on the constant β (no zero padding: padding 0 or a non-zero padding mode).
- GroupNorm (A.4): a writer into a GroupNorm with G groups needs each group's rows zero-mean, not the whole
  row: centre within each of the G contiguous channel blocks (`center_grouped`, Φ_GN = (I − A)W). Exact
  for GroupNorm on (N, C) vectors (the paper's MLP case) or a per-position grouped norm; NOT for
  nn.GroupNorm on feature maps, whose statistics pool each group over the positions too: the per-position
  group means the centring removes are then seen.
- recurrent layers (A.3.1): the pre-activation c_t = W_ih x_t + b_ih + W_hh h_{t−1} + b_hh of each gate is
  zero-mean over that gate's units for every x and h iff both matrices (and biases) are centred within the
  gate's block of rows (`center_recurrent`). What the recurrence then keeps is in `RECURRENT_GATES`: the
  gate pre-activations of RNN and LSTM (all four), GRU's r and z; GRU's candidate n is NOT zero-mean
  (its recurrent term is multiplied elementwise by r: r ⊙ (W_hn h + b_hn)), and no output h_t is (σ, tanh
  and ⊙ break it), so a recurrent layer is never a stream writer; the transform serves a LayerNorm that
  normalizes the gate pre-activations (LN-LSTM style), which then becomes an RMSNorm.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn


def _f64(t: Tensor) -> Tensor:
    return t.detach().to(torch.float64)


def center_grouped(weight: Tensor, bias: Tensor | None, out_dim: int,
                   groups: int) -> tuple[Tensor, Tensor | None]:
    """Centre the output axis within each of `groups` contiguous blocks (paper 002 eq. 35-36): every block
    of the output is zero-mean for every input. groups=1 is the ordinary CCWT."""
    n = weight.shape[out_dim]
    if groups < 1 or n % groups:
        raise ValueError(f"{n} outputs cannot be split into {groups} equal groups")

    def centre(t: Tensor, dim: int) -> Tensor:
        t64 = _f64(t).movedim(dim, 0)
        blocks = t64.reshape(groups, n // groups, *t64.shape[1:])
        blocks = blocks - blocks.mean(1, keepdim=True)
        return blocks.reshape(t64.shape).movedim(0, dim).to(t.dtype)

    return centre(weight, out_dim), (None if bias is None else centre(bias, -1))


def grouped_writer_exact(conv_groups: int, norm_groups: int) -> bool:
    """Whether a conv with `conv_groups` groups can be centred for a norm with `norm_groups` groups over
    the same channels: each norm group must read a single conv group (norm groups refine conv groups)."""
    return norm_groups % conv_groups == 0


def center_conv_writer(weight: Tensor, bias: Tensor | None, conv_groups: int = 1,
                       norm_groups: int = 1) -> tuple[Tensor, Tensor | None]:
    """CCWT of a convolution writing into a norm over its output channels (LayerNorm: norm_groups=1;
    GroupNorm: its group count). Raises ValueError when no weight edit is exact (see module doc)."""
    if not grouped_writer_exact(conv_groups, norm_groups):
        raise ValueError(f"a conv with {conv_groups} groups cannot be centred for a norm with {norm_groups} "
                         "group(s): centring within the conv's groups removes per-group means the norm sees")
    return center_grouped(weight, bias, 0, norm_groups)


def fold_affine_conv(weight: Tensor, bias: Tensor | None, gamma: Tensor | None, beta: Tensor | None,
                     groups: int = 1) -> tuple[Tensor, Tensor | None]:
    """Fold γ⊙n + β (per input channel) into a ConvNd reading it: W[o, j] ← γ_c·W[o, j] with c the input
    channel tap j of output o reads; b[o] ← b[o] + Σ_{j,k} β_c·W[o, j, k]. The β part is exact only when
    the conv sees no zero padding (the caller checks). Returns (W', b'), b' None only if both are None."""
    w64 = _f64(weight)
    out, per_group = w64.shape[:2]
    if out % groups:
        raise ValueError(f"{out} output channels do not split into {groups} groups")
    # index of the input channel each (o, j) reads
    chan = (torch.arange(out)[:, None] // (out // groups)) * per_group + torch.arange(per_group)[None, :]
    view = (out, per_group) + (1,) * (w64.dim() - 2)
    new_b = None
    if beta is not None:
        shift = (w64 * _f64(beta)[chan].reshape(view)).flatten(1).sum(1)
        new_b = (shift if bias is None else _f64(bias) + shift).to(bias.dtype if bias is not None else weight.dtype)
    elif bias is not None:
        new_b = bias.detach().clone()
    if gamma is not None:
        w64 = w64 * _f64(gamma)[chan].reshape(view)
    return w64.to(weight.dtype), new_b


# Gate blocks of torch's recurrent layers, in their row order, and whether each gate's pre-activation is
# zero-mean over its units once `center_recurrent` is applied (the recurrence keeps it).
RECURRENT_GATES: dict[str, tuple[tuple[str, bool], ...]] = {
    "RNN_TANH": (("h", True),),
    "RNN_RELU": (("h", True),),
    "LSTM": (("i", True), ("f", True), ("g", True), ("o", True)),
    "GRU": (("r", True), ("z", True), ("n", False)),  # n: W_in x + b_in + r ⊙ (W_hn h + b_hn)
}


def center_recurrent(weight_ih: Tensor, weight_hh: Tensor, bias_ih: Tensor | None, bias_hh: Tensor | None,
                     mode: str) -> tuple[Tensor, Tensor, Tensor | None, Tensor | None]:
    """CCWT of a recurrent layer (paper 002 A.3.1, Φ_rnn,v and Φ_rnn,h), per gate block of rows (torch
    layout: weight_ih (gates·H, in), weight_hh (gates·H, H)). Afterwards each gate's pre-activation is
    zero-mean over its units for every input and state, except the gates `RECURRENT_GATES` marks False."""
    if mode not in RECURRENT_GATES:
        raise ValueError(f"unknown recurrent mode {mode!r}; one of {', '.join(RECURRENT_GATES)}")
    g = len(RECURRENT_GATES[mode])
    w_ih, b_ih = center_grouped(weight_ih, bias_ih, 0, g)
    w_hh, b_hh = center_grouped(weight_hh, bias_hh, 0, g)
    return w_ih, w_hh, b_ih, b_hh


def is_conv_reader(module: nn.Module) -> bool:
    """A ConvNd (not transposed) whose input a norm's affine can fold into exactly: no zero padding (padding
    0 / "valid", or a replicate/reflect/circular padding mode, which keeps a constant input constant)."""
    if not isinstance(module, (nn.Conv1d, nn.Conv2d, nn.Conv3d)):
        return False
    pad = module.padding
    no_pad = pad == "valid" or (not isinstance(pad, str) and all(p == 0 for p in pad))
    return no_pad or module.padding_mode != "zeros"
