# Triton kernel body of the fast Walsh–Hadamard transform (normfold.ops.triton_hadamard; imported only
# when triton is installed, on the first launch). No `from __future__ import annotations`: Triton reads
# the `tl.constexpr` annotations.
#
# Same arithmetic as normfold.ops.hadamard.fwht, in the same order, so results are bit-identical to it:
# per row and per chunk of P = 2^k values, stages h = 1, 2, ..., P/2 of (a, b) -> (a + b, a - b); then,
# with a core (M x M, ±1), out[j] = 0 + Σ_i core[i, j]·y[i] with i ascending (exact products, so a
# contraction into FMAs rounds the same); then one multiply by the scale.

import triton
import triton.language as tl


@triton.jit
def _fwht(X, Y, C, rows, scale, M: tl.constexpr, M2: tl.constexpr, P: tl.constexpr, LOG_P: tl.constexpr,
          HAS_CORE: tl.constexpr, BLOCK_M: tl.constexpr):
    # One program transforms BLOCK_M rows of n = M·P values held as a (BLOCK_M, M2, P) tile (M2 = the
    # next power of two ≥ M; the padding chunks are masked and stay zero).
    pid = tl.program_id(0)
    r = pid * BLOCK_M + tl.arange(0, BLOCK_M)
    c = tl.arange(0, M2)
    q = tl.arange(0, P)
    mask = (r < rows)[:, None, None] & (c < M)[None, :, None] & (q < P)[None, None, :]
    offs = r.to(tl.int64)[:, None, None] * (M * P) + (c * P)[None, :, None] + q[None, None, :]
    x = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
    y = tl.reshape(x, (BLOCK_M * M2, P))
    for s in tl.static_range(LOG_P):
        h: tl.constexpr = 1 << s
        y = tl.reshape(y, (BLOCK_M * M2 * (P // (2 * h)), 2, h))
        a, b = tl.split(tl.permute(y, (0, 2, 1)))
        y = tl.reshape(tl.permute(tl.join(a + b, a - b), (0, 2, 1)), (BLOCK_M * M2, P))
    y = tl.reshape(y, (BLOCK_M, M2, P))
    if HAS_CORE:
        acc = tl.zeros((BLOCK_M, M2, P), dtype=tl.float32)
        for i in tl.static_range(M):
            yi = tl.sum(tl.where((c == i)[None, :, None], y, 0.0), axis=1)  # chunk i (one nonzero term)
            ci = tl.load(C + i * M + c, mask=c < M, other=0.0)  # row i of the core: core[i, j] for all j
            acc = acc + ci[None, :, None] * yi[:, None, :]
        y = acc
    tl.store(Y + offs, (y * scale).to(Y.dtype.element_ty), mask=mask)
