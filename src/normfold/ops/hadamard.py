"""Hadamard matrices and a fast Walsh–Hadamard transform in plain aten ops (exports under torch.export).

Orders n = m·2^k with a core of order m ∈ {1, 2} or m = q + 1 (q a prime ≡ 3 mod 4, Paley's construction
I: 4, 8, 12, 20, 24, 44, 48, 60, ...). `fwht(x, core)` computes x·(H_m ⊗ H_{2^k})/√n over the last axis:
k butterfly stages (adds and subtracts, O(n log n)) and one m×m matmul, with `core` = `hadamard_core(m)`
(None when m ≤ 2 is folded into the butterflies). The transform is orthonormal: applying it twice with
the transpose gives x back; for m ≤ 2 (pure Sylvester) the matrix is symmetric, so it is an involution.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor


def _is_prime(n: int) -> bool:
    return n >= 2 and all(n % p for p in range(2, int(math.isqrt(n)) + 1))


def _paley_order(m: int) -> bool:
    return (m - 1) % 4 == 3 and _is_prime(m - 1)


def hadamard_factor(n: int) -> tuple[int, int] | None:
    """(m, k) with n = m·2^k and a core of order m (1, 2 or Paley q+1), largest k first; None if none."""
    k = 0
    while n > 0 and n % (2 ** (k + 1)) == 0:
        k += 1
    for kk in range(k, -1, -1):
        m = n // 2 ** kk
        if m in (1, 2) or _paley_order(m):
            return m, kk
    return None


def _paley(m: int) -> Tensor:
    q = m - 1
    squares = {(i * i) % q for i in range(1, q)}
    chi = torch.tensor([0.0] + [1.0 if i in squares else -1.0 for i in range(1, q)], dtype=torch.float64)
    idx = (torch.arange(q).view(1, -1) - torch.arange(q).view(-1, 1)) % q
    s = torch.zeros(m, m, dtype=torch.float64)
    s[0, 1:] = 1.0
    s[1:, 0] = -1.0
    s[1:, 1:] = chi[idx]  # Jacobsthal matrix χ(j − i): skew-symmetric for q ≡ 3 (mod 4)
    return torch.eye(m, dtype=torch.float64) + s


def hadamard_core(m: int) -> Tensor:
    """The ±1 Hadamard matrix of order m ∈ {1, 2} or a Paley order (float64)."""
    if m == 1:
        return torch.ones(1, 1, dtype=torch.float64)
    if m == 2:
        return torch.tensor([[1.0, 1.0], [1.0, -1.0]], dtype=torch.float64)
    if not _paley_order(m):
        raise ValueError(f"no Hadamard core of order {m}")
    return _paley(m)


def hadamard_matrix(n: int) -> Tensor:
    """H_m ⊗ H_{2^k} (±1, H·Hᵀ = n·I), the matrix `fwht` applies (divided by √n). Raises ValueError when n
    has no construction here."""
    f = hadamard_factor(n)
    if f is None:
        raise ValueError(f"no Hadamard construction implemented for order {n} (need m·2^k, m ∈ {{1, 2}} or "
                         "m − 1 a prime ≡ 3 mod 4)")
    m, k = f
    h2 = torch.ones(1, 1, dtype=torch.float64)
    for _ in range(k):
        h2 = torch.cat([torch.cat([h2, h2], 1), torch.cat([h2, -h2], 1)], 0)
    return torch.kron(hadamard_core(m), h2)


def fwht(x: Tensor, core: Tensor | None = None) -> Tensor:
    """x·(H_m ⊗ H_{2^k})/√n over the last axis (n = x.shape[-1] = m·2^k; `core` = H_m as a tensor of x's
    dtype, None for m = 1). Plain aten (view, slicing, cat, matmul): traceable by torch.export/compile."""
    n = x.shape[-1]
    m = 1 if core is None else core.shape[0]
    p = n // m
    if m * p != n or p & (p - 1):
        raise ValueError(f"fwht: width {n} is not {m}·2^k")
    lead = x.shape[:-1]
    y = x.reshape(-1, m, p)
    h = 1
    while h < p:
        y = y.reshape(-1, m, p // (2 * h), 2, h)
        a, b = y[:, :, :, 0, :], y[:, :, :, 1, :]
        y = torch.stack((a + b, a - b), dim=3)
        h *= 2
    y = y.reshape(-1, m, p)
    if core is not None:
        y = torch.matmul(core.t(), y)  # (m, m) @ (rows, m, p): out[j] = Σ_i H[i, j]·y[i]
    return (y * (1.0 / math.sqrt(n))).reshape(*lead, n)


def _plain(x: Tensor) -> bool:
    """An eager CPU float32 tensor the C kernel may transform (not a fake/functional tensor under
    torch.export / torch.compile, no autograd)."""
    return (type(x) is Tensor and x.device.type == "cpu" and x.dtype == torch.float32 and not x.requires_grad
            and not _compiling())


def _compiling() -> bool:
    try:
        return torch.compiler.is_compiling() or torch.compiler.is_exporting()
    except AttributeError:  # older torch
        return False


def fwht_fast(x: Tensor, core: Tensor | None = None, *, out: Tensor | None = None) -> Tensor:
    """`fwht` with normfold's C kernel (`nf_fwht_f32`) for eager CPU float32 inference, its Triton kernel
    (`normfold.ops.triton_hadamard`) for eager CUDA float32 inference; `fwht` (plain aten) otherwise, or
    when the kernel is unavailable. Same butterflies, core sums and scaling in
    the same order, so the result is bit-identical to `fwht`. The kernel reads `x` and writes a new tensor
    (one pass, no copy first), or `out` when given (a contiguous float32 tensor of x's shape; `out=x`
    transforms x in place); it splits rows over torch.get_num_threads() threads for large inputs."""
    if x.is_cuda and type(x) is Tensor and not _compiling():
        from . import triton_hadamard

        if triton_hadamard.supports(x, 1 if core is None else core.shape[0]):
            return triton_hadamard.fwht(x, core, out=out)
    if not _plain(x):
        return fwht(x, core) if out is None else out.copy_(fwht(x, core))
    from .cpu import library

    lib = library()
    if lib is None or not hasattr(lib, "nf_fwht_f32"):
        return fwht(x, core) if out is None else out.copy_(fwht(x, core))
    n = x.shape[-1]
    m = 1 if core is None else core.shape[0]
    p = n // m
    if m * p != n or p & (p - 1):
        raise ValueError(f"fwht: width {n} is not {m}·2^k")
    src = x.contiguous()
    if out is None:
        y = torch.empty_like(src)
    else:
        if out.shape != x.shape or out.dtype != torch.float32 or not out.is_contiguous() or out.device != x.device:
            raise ValueError("fwht_fast: out must be a contiguous CPU float32 tensor of x's shape")
        y = out
    c = None
    if core is not None:
        c = core if core.dtype == torch.float32 and core.is_contiguous() else core.to(torch.float32).contiguous()
    rc = lib.nf_fwht_f32(src.data_ptr(), y.data_ptr(), src.numel() // n if n else 0, m, p,
                         None if c is None else c.data_ptr(), 1.0 / math.sqrt(n), torch.get_num_threads())
    if rc != 0:
        return fwht(x, core) if out is None else out.copy_(fwht(x, core))
    return y
