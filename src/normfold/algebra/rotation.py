"""Orthogonal rotations of a zero-mean residual stream (SliceGPT's computational invariance, QuaRot).

Row convention (a token is a row x ∈ ℝ^d, the stream is x·Q after rotation). Q is orthogonal and fixes
the all-ones direction, 1·Q = 1. Then also Q·1ᵀ = 1ᵀ (transpose 1·Q = 1 to Qᵀ1ᵀ = 1ᵀ and multiply by
Q), so a zero-mean stream stays zero-mean (xQ·1ᵀ = x·1ᵀ = 0), and RMSNorm without γ commutes with Q:
RMSNorm(xQ) = RMSNorm(x)·Q since ‖xQ‖ = ‖x‖.

Construction. Any orthogonal M (a randomized Hadamard H·D/√d, or a seeded random orthogonal matrix)
maps u = 1/√d to the unit row v = u·M. The Householder reflection R = I − 2wwᵀ/(wᵀw), w = v − u, maps
v to u (‖v‖ = ‖u‖), so Q = M·R is orthogonal and u·Q = v·R = u. R only changes x along w, a direction
with entries of size ~1/√d: M's spreading of outlier channels is kept.

Every stream tensor is rotated the same way, along its stream axis: t ← t·Q there. For a writer
y = x·B (B: in × out, out = stream) that is B·Q; for a reader y = x·A (A: in × out, in = stream) on
the rotated input xQ, Qᵀ·A; torch's Linear stores Aᵀ (out × in), whose stream axis is the last, so
Aᵀ ← Aᵀ·Q — again t·Q along the stream axis. Float64 inside, one rounding at the end.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ..ops.hadamard import hadamard_factor, hadamard_matrix  # noqa: F401  (re-exported)

KINDS = ("hadamard", "orthogonal")


def has_hadamard(d: int) -> bool:
    return hadamard_factor(d) is not None


def random_signs(d: int, seed: int) -> Tensor:
    g = torch.Generator().manual_seed(int(seed))
    return torch.randint(0, 2, (d,), generator=g).to(torch.float64) * 2 - 1


def random_orthogonal(d: int, seed: int) -> Tensor:
    """A Haar-random orthogonal d×d matrix (QR of a Gaussian with R's diagonal made positive), seeded."""
    g = torch.Generator().manual_seed(int(seed))
    a = torch.randn(d, d, generator=g, dtype=torch.float64)
    q, r = torch.linalg.qr(a)
    return q * torch.sign(torch.diagonal(r)).where(torch.diagonal(r) != 0, torch.ones(d, dtype=torch.float64))


def fix_ones(m: Tensor) -> Tensor:
    """Q = M·R with R the Householder reflection taking u·M to u (u = 1/√d): orthogonal, 1·Q = 1."""
    m = m.to(torch.float64)
    d = m.shape[0]
    u = torch.full((d,), 1.0 / math.sqrt(d), dtype=torch.float64)
    w = u @ m - u
    nw = float(w @ w)
    if nw < 1e-30:
        return m.clone()
    return m - (2.0 / nw) * torch.outer(m @ w, w)  # M(I − 2wwᵀ/‖w‖²)


def rotation_matrix(kind: str, d: int, seed: int = 0) -> tuple[Tensor, str]:
    """(Q, construction) for a stream of width d: float64, orthogonal, 1·Q = 1.

    kind 'hadamard': the randomized Hadamard H·diag(s)/√d (s seeded ±1) where d has a construction
    (`hadamard_matrix`), else the seeded random orthogonal matrix (construction says which was used).
    kind 'orthogonal': the seeded random orthogonal matrix."""
    if kind not in KINDS:
        raise ValueError(f"unknown rotation {kind!r}; choose one of {', '.join(KINDS)}")
    if kind == "hadamard" and has_hadamard(d):
        m = hadamard_matrix(d) * random_signs(d, seed) / math.sqrt(d)
        used = "hadamard"
    else:
        m = random_orthogonal(d, seed)
        used = "orthogonal"
    return fix_ones(m), used


# t·Q runs over row blocks of this many float64 bytes, each copied into a fresh contiguous buffer: MKL's GEMM
# gives a row different bits depending on how many rows it is multiplied with (and where they sit), so a
# fixed, shape-only blocking is what lets the streamed conversion (which holds one block of a large table at a
# time) write the in-memory rotation's bytes. The same rule as the writers' row-chunked centring
# (convert.CENTER_CHUNK_BYTES), so one streamed block is one chunk of both.
ROW_BLOCK_BYTES = 4 * 1024 * 1024


def head_rotation(hd: int, seed: int = 0) -> tuple[Tensor, str]:
    """An orthogonal hd × hd matrix for one attention head (no all-ones constraint): a Hadamard with random
    signs, D·H/√hd, where hd has a construction, else a seeded random orthogonal matrix. Float64."""
    if has_hadamard(hd):
        return random_signs(hd, seed)[:, None] * hadamard_matrix(hd).to(torch.float64) / hd ** 0.5, \
            "randomized Hadamard"
    return random_orthogonal(hd, seed), "random orthogonal"


def row_blocks(n: int, d: int) -> list[tuple[int, int]]:
    """[a, b) row ranges of the blocking above for n rows of width d (none of one row unless n == 1)."""
    rows = max(2, ROW_BLOCK_BYTES // 8 // max(1, d))
    bounds = [(a, min(a + rows, n)) for a in range(0, n, rows)]
    if len(bounds) > 1 and bounds[-1][1] - bounds[-1][0] == 1:
        bounds[-2:] = [(bounds[-2][0], n)]
    return bounds


def rotate_rows(rows: Tensor, q: Tensor, center: bool = False) -> Tensor:
    """One block (float64, m × d): a fresh contiguous copy times Q, centred along d when `center`."""
    blk = torch.empty(rows.shape, dtype=torch.float64).copy_(rows)
    out = blk @ q
    return out - out.mean(dim=-1, keepdim=True) if center else out


def rotate_axis(t: Tensor, q: Tensor, dim: int, center: bool = False) -> Tensor:
    """t with its axis `dim` (the stream axis, length d) multiplied by Q: t ← t·Q along that axis, and
    re-centred along it when `center` (writers: Q fixes 1 exactly in real arithmetic only). Float64
    inside, over the fixed row blocks of `row_blocks`, cast back to t's dtype once. Serves writers
    (output axis), tables, stream parameters, readers (input axis) and a norm's bias alike (see the
    module docstring)."""
    if t.is_meta:
        return torch.empty_like(t)
    t64 = t.detach().to(torch.float64).movedim(dim, -1)
    d = t64.shape[-1]
    if d != q.shape[0]:
        raise ValueError(f"axis {dim} of a {tuple(t.shape)} tensor has length {d}, the rotation {q.shape[0]}")
    q = q.to(torch.float64)
    flat = t64.reshape(-1, d)
    if t.dim() == 2:  # blocks written straight into t's own layout: no second float64 copy to make it contiguous
        res = torch.empty(t.shape, dtype=torch.float64)
        out = res.movedim(dim, -1)
    else:
        res = out = torch.empty(flat.shape, dtype=torch.float64)
    for a, b in row_blocks(flat.shape[0], d):
        out[a:b] = rotate_rows(flat[a:b], q, center)
    if t.dim() == 2:
        return res if t.dtype == torch.float64 else res.to(t.dtype)
    return out.reshape(t64.shape).movedim(-1, dim).to(t.dtype).contiguous()


def unfold_gamma_bias(beta: Tensor | None, gamma: Tensor) -> Tensor | None:
    """The bias a γ-free norm keeps when γ moves into its readers but β cannot (no reader bias):
    γ⊙n + β = (n + β/γ)⊙γ, and ⊙γ folds into the readers. Requires every γ_i ≠ 0."""
    if beta is None:
        return None
    g = gamma.detach().to(torch.float64)
    if bool((g == 0).any()):
        raise ValueError("γ has zero entries; β/γ is undefined")
    return (beta.detach().to(torch.float64) / g).to(beta.dtype)
