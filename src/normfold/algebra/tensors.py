"""Pure tensor algebra behind every conversion (README.md, "Why it is exact"). No model knowledge.

Every function computes in float64 and casts the result back to the input dtype once, so
repeated edits of one tensor do not accumulate low-precision rounding.
"""

from __future__ import annotations

import contextlib
import threading

import torch
from torch import Tensor

_scratch = threading.local()  # this thread's reused buffers (`reused_buffers`), or none


def _f64(t: Tensor) -> Tensor:
    return t.detach().to(torch.float64)


@contextlib.contextmanager
def reused_buffers(bufs: dict | None = None, results=None):
    """Inside (this thread only): `fold_affine`'s weight-sized float64 copy and its rounded result live in two
    buffers reused from call to call instead of fresh memory (a streamed conversion otherwise page-faults over
    three times each reader weight's size per fold). Same values: copying into float64 is exact, and the
    rounding copy is the cast `.to` does. The weight returned is a view of the buffer: the caller must use it
    before the next `fold_affine` (`convert.swap_norm` copies it into the parameter at once). `bufs`: a dict
    that keeps the buffers from one `with` to the next (a fresh one by default). `results(shape, dtype)`: where
    `result_buffer` takes the memory of results that outlive the call (`compress_reader`'s, compress's dropped
    coordinate): a contiguous tensor nothing else uses (default: `torch.empty`)."""
    old, old_results = getattr(_scratch, "bufs", None), getattr(_scratch, "results", None)
    _scratch.bufs = {} if bufs is None else bufs
    _scratch.results = results
    try:
        yield
    finally:
        _scratch.bufs, _scratch.results = old, old_results


def result_buffer(shape, dtype: torch.dtype) -> Tensor:
    """An uninitialised contiguous tensor for a result the caller fills whole: from the `results` allocator of
    the enclosing `reused_buffers` (a streamed conversion hands out recycled read buffers, so a new d−1 tensor
    does not page-fault over fresh memory), else `torch.empty`."""
    alloc = getattr(_scratch, "results", None)
    return torch.empty(tuple(shape), dtype=dtype) if alloc is None else alloc(tuple(shape), dtype)


def _buffer(slot: str, like: Tensor, dtype: torch.dtype) -> Tensor | None:
    """A reused contiguous buffer of `like`'s shape in `dtype` inside `reused_buffers`, else None."""
    bufs = getattr(_scratch, "bufs", None)
    if bufs is None:
        return None
    n = like.numel()
    buf = bufs.get((slot, dtype))
    if buf is None or buf.numel() < n:
        buf = bufs[(slot, dtype)] = None  # the old one freed before the larger one is taken
        buf = bufs[(slot, dtype)] = torch.empty(n, dtype=dtype)
    return buf[:n].view(like.shape)


def center(t: Tensor, dim: int) -> Tensor:
    """t minus its mean along `dim` (the centering matrix C applied on that axis)."""
    t64 = _f64(t)
    return (t64 - t64.mean(dim=dim, keepdim=True)).to(t.dtype)


def center_writer(weight: Tensor, bias: Tensor | None, out_dim: int) -> tuple[Tensor, Tensor | None]:
    """Make y = f(x; weight, bias) zero-mean over its output features for every x (Lemma 3.1, CCWT).

    `out_dim` is the weight axis that indexes output features: 0 for nn.Linear (out, in) and
    nn.ConvNd (out, in, ...), 1 for HF Conv1D (in, out) and for embedding tables (rows are
    outputs), -1 for a plain parameter added to the stream. W ← W·C over that axis, b ← b − μ(b).
    """
    new_w = center(weight, out_dim)
    new_b = None if bias is None else center(bias, -1)
    return new_w, new_b


def scale_writer(weight: Tensor, bias: Tensor | None, scale: Tensor,
                 out_dim: int) -> tuple[Tensor, Tensor | None]:
    """Fold a per-channel multiplier applied to a writer's output into the writer (scale folding:
    LayerScale y = (xW + b)·λ = x·W diag(λ) + b⊙λ). `scale` has one entry per output feature (any
    shape with that many elements) or is a scalar. Returns (W', b'); no bias is created."""
    lam = _f64(scale).reshape(-1)
    n = weight.shape[out_dim]
    if lam.numel() == 1:
        lam = lam.expand(n)
    if lam.numel() != n:
        raise ValueError(f"scale has {lam.numel()} entries, the writer {n} outputs")
    shape = [1] * weight.dim()
    shape[out_dim] = n
    new_w = (_f64(weight) * lam.reshape(shape)).to(weight.dtype)
    new_b = None if bias is None else (_f64(bias) * lam.reshape(bias.shape)).to(bias.dtype)
    return new_w, new_b


def fold_affine(weight: Tensor, bias: Tensor | None, gamma: Tensor | None, beta: Tensor | None,
                in_dim: int) -> tuple[Tensor, Tensor | None]:
    """Fold a norm's output affine γ⊙n + β into a linear reader of that norm.

    Reader y = x·W + b with x = γ⊙n + β gives y = n·diag(γ)W + (βW + b). `in_dim` is the weight
    axis that indexes input features (1 for nn.Linear's (out, in), 0 for HF Conv1D's (in, out)).
    Returns (W', b'); b' is None only if `bias` is None and β is None. A nonzero β with no reader
    bias yields a new bias tensor: the caller decides whether the module may grow one.
    """
    if weight.dim() != 2:
        raise ValueError(f"fold_affine expects a 2-D weight, got shape {tuple(weight.shape)}")
    # γ folded in float32 (below) where that is exact: then the float64 copy only serves βW
    f32_gamma = gamma is not None and weight.dtype == torch.float32 and gamma.dtype == torch.float32
    w64 = None
    if beta is not None or (gamma is not None and not f32_gamma):
        w64 = _buffer("w64", weight, torch.float64) if weight.dtype != torch.float64 else None
        w64 = _f64(weight) if w64 is None else w64.copy_(weight.detach())
    in_dim = in_dim % 2
    new_b = None
    if beta is not None:
        shift = torch.tensordot(w64, _f64(beta), dims=([in_dim], [0]))  # βW, shape (out,)
        new_b = shift if bias is None else _f64(bias) + shift
        new_b = new_b.to(bias.dtype if bias is not None else weight.dtype)
    elif bias is not None:
        new_b = bias.detach().clone()
    if f32_gamma:
        # W·diag(γ) straight in float32: the product of two float32 numbers is exact in float64 (24 + 24 bits of
        # significand), so rounding it once to float32 is IEEE float32 multiplication, correctly rounded: the
        # same bits as the float64 product cast back, in one float32 pass instead of a float64 multiply and cast
        shape = [1, 1]
        shape[in_dim] = -1
        out = _buffer("out", weight, weight.dtype)
        g = gamma.detach().reshape(shape)
        return (weight.detach() * g if out is None else torch.mul(weight.detach(), g, out=out)), new_b
    if gamma is not None:
        shape = [1, 1]
        shape[in_dim] = -1
        g = _f64(gamma).reshape(shape)
        # in place on our own float64 copy (one weight-sized float64 temporary, not two); a float64 weight is
        # its own `w64` and must not change
        w64 = w64.mul_(g) if w64.data_ptr() != weight.data_ptr() else w64 * g
    if w64 is None:  # neither γ nor β: the weight unchanged
        return weight.detach().clone(), new_b
    out = _buffer("out", weight, weight.dtype) if weight.dtype != torch.float64 else None
    return (w64.to(weight.dtype) if out is None else out.copy_(w64)), new_b


def compress_reader(weight: Tensor, in_dim: int) -> Tensor:
    """Reader of a zero-mean input x ∈ ℝ^d fed only x[:d−1] (paper 001 eq. 6): W_i ← W_i − a_d 1ᵀ,
    then drop the now-zero last input column. x_d = −Σ others makes this exact."""
    w = weight.detach().movedim(in_dim, -1)
    w64 = _buffer("w64", w, torch.float64) if weight.dtype != torch.float64 else None
    if w64 is None:  # fresh float64 temporaries
        w64 = w.to(torch.float64)
        return (w64[..., :-1] - w64[..., -1:]).movedim(-1, in_dim).to(weight.dtype)
    w64.copy_(w)  # inside reused_buffers: both float64 temporaries reused, the same values (elementwise ops)
    diff = torch.sub(w64[..., :-1], w64[..., -1:], out=_buffer("d64", w64[..., :-1], torch.float64))
    # rounded once (copy_ casts as `.to` does) into a contiguous result in the weight's own layout (what the
    # writer's `.contiguous()` made of the moved view before), from `result_buffer`
    shape = list(weight.shape)
    shape[in_dim] -= 1
    out = result_buffer(shape, weight.dtype)
    out.movedim(in_dim, -1).copy_(diff)
    return out


def decompress_reader(weight: Tensor, in_dim: int) -> Tensor:
    """Inverse of `compress_reader` (paper 001 App. C step 3 with a_d = 0): append a zero input column."""
    w = weight.detach().movedim(in_dim, -1)
    zero = torch.zeros(*w.shape[:-1], 1, dtype=w.dtype, device=w.device)
    return torch.cat([w, zero], dim=-1).movedim(-1, in_dim)


def compress_writer(weight: Tensor, bias: Tensor | None, out_dim: int) -> tuple[Tensor, Tensor | None]:
    """Writer of a zero-mean output: drop the last (redundant) output coordinate."""
    w = weight.detach().movedim(out_dim, -1)[..., :-1].movedim(-1, out_dim).clone()
    return w, (None if bias is None else bias.detach()[..., :-1].clone())


def decompress_writer(weight: Tensor, bias: Tensor | None, out_dim: int) -> tuple[Tensor, Tensor | None]:
    """Inverse of `compress_writer`: restore the last output coordinate as −Σ of the others."""
    def restore(t: Tensor, dim: int) -> Tensor:
        t64 = _f64(t).movedim(dim, -1)
        return torch.cat([t64, -t64.sum(-1, keepdim=True)], dim=-1).movedim(-1, dim).to(t.dtype)

    return restore(weight, out_dim), (None if bias is None else restore(bias, -1))


def fold_offline_norm(weight: Tensor, bias: Tensor | None, scale: Tensor, shift: Tensor,
                      in_dim: int) -> tuple[Tensor, Tensor]:
    """Fold a fixed per-channel affine z = x·scale + shift (an inference-time offline norm,
    paper 004 Algorithm 1) into the linear that reads z: W' = diag(scale)W, b' = b + shift·W."""
    new_w, new_b = fold_affine(weight, bias, scale, shift, in_dim)
    assert new_b is not None
    return new_w, new_b
