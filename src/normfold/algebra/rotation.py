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

KINDS = ("hadamard", "orthogonal")


def _is_prime(n: int) -> bool:
    if n < 2:
        return False
    return all(n % p for p in range(2, int(math.isqrt(n)) + 1))


def _paley_order(m: int) -> bool:
    """m = q + 1 with q a prime ≡ 3 (mod 4): Paley's construction I gives a Hadamard matrix of order m."""
    q = m - 1
    return q % 4 == 3 and _is_prime(q)


def hadamard_factor(d: int) -> tuple[int, int] | None:
    """(m, k) with d = m·2^k and a Hadamard matrix of order m (m = 1, 2 or Paley q+1), or None."""
    k = 0
    while d % (2 ** (k + 1)) == 0:
        k += 1
    for kk in range(k, -1, -1):  # largest power of two first: the Paley core as small as possible
        m = d // 2 ** kk
        if m in (1, 2) or _paley_order(m):
            return m, kk
    return None


def has_hadamard(d: int) -> bool:
    return hadamard_factor(d) is not None


def _paley(m: int) -> Tensor:
    q = m - 1
    squares = {(i * i) % q for i in range(1, q)}
    chi = torch.tensor([0.0] + [1.0 if i in squares else -1.0 for i in range(1, q)], dtype=torch.float64)
    idx = (torch.arange(q).view(1, -1) - torch.arange(q).view(-1, 1)) % q
    jac = chi[idx]  # Jacobsthal matrix Q[i, j] = χ(j − i), skew-symmetric for q ≡ 3 mod 4
    s = torch.zeros(m, m, dtype=torch.float64)
    s[0, 1:] = 1.0
    s[1:, 0] = -1.0
    s[1:, 1:] = jac
    return torch.eye(m, dtype=torch.float64) + s


def hadamard_matrix(d: int) -> Tensor:
    """A ±1 Hadamard matrix H (H·Hᵀ = d·I) of order d, float64: Sylvester doubling of 1, 2 or a Paley
    core of order q+1 (q prime ≡ 3 mod 4: 4, 8, 12, 20, 24, 32, 44, 48, 60, 68, 72, 80, 84, ...).
    Raises ValueError when d has no such construction."""
    f = hadamard_factor(d)
    if f is None:
        raise ValueError(f"no Hadamard construction implemented for order {d} (need m·2^k, m ∈ {{1, 2}} or "
                         "m − 1 a prime ≡ 3 mod 4)")
    m, k = f
    h = torch.ones(1, 1, dtype=torch.float64) if m == 1 else (
        torch.tensor([[1.0, 1.0], [1.0, -1.0]], dtype=torch.float64) if m == 2 else _paley(m))
    for _ in range(k):
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


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


def rotate_axis(t: Tensor, q: Tensor, dim: int) -> Tensor:
    """t with its axis `dim` (the stream axis, length d) multiplied by Q: t ← t·Q along that axis.
    Float64 inside, cast back to t's dtype once. Serves writers (output axis), tables, stream
    parameters, readers (input axis) and a norm's bias alike (see the module docstring)."""
    t64 = t.detach().to(torch.float64).movedim(dim, -1)
    if t64.shape[-1] != q.shape[0]:
        raise ValueError(f"axis {dim} of a {tuple(t.shape)} tensor has length {t64.shape[-1]}, the rotation "
                         f"{q.shape[0]}")
    return (t64 @ q.to(torch.float64)).movedim(-1, dim).to(t.dtype).contiguous()


def unfold_gamma_bias(beta: Tensor | None, gamma: Tensor) -> Tensor | None:
    """The bias a γ-free norm keeps when γ moves into its readers but β cannot (no reader bias):
    γ⊙n + β = (n + β/γ)⊙γ, and ⊙γ folds into the readers. Requires every γ_i ≠ 0."""
    if beta is None:
        return None
    g = gamma.detach().to(torch.float64)
    if bool((g == 0).any()):
        raise ValueError("γ has zero entries; β/γ is undefined")
    return (beta.detach().to(torch.float64) / g).to(beta.dtype)
