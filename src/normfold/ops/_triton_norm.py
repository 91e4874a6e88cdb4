# Triton kernel bodies for normfold.ops.triton_kernels (imported only when triton is installed).
#
# Imported lazily (on first kernel launch) so that `import normfold` never pays for importing
# triton, and so TRITON_INTERPRET=1 set by a test session before that point takes effect. No
# `from __future__ import annotations` here: Triton reads the `tl.constexpr` annotations.
#
# Semantics (same as normfold.ops.reference): statistics in float32, the affine applied in
# float32, one rounding to the output dtype. CRMSNorm (paper 001 eq. 5) on x in R^{d-1}:
#   ms = (sum x^2 + (sum x)^2) / d,  y = x * rsqrt(ms + eps) * w + b,  d = n + 1.
# The fused variant first forms s = x + residual, rounds it to the stream dtype (exactly what an
# unfused `x + residual` stores) and normalizes that rounded s.

import triton
import triton.language as tl


@triton.jit
def _fwd(X, R, W, B, Y, S, RSTD, rows, n, eps, inv_d, ROWS_BUCKET,
         HAS_RES: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr, COMPRESSED: tl.constexpr,
         STORE_RSTD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr):
    # One program normalizes BLOCK_M whole rows held in registers (BLOCK_N >= n).
    pid = tl.program_id(0)
    r = pid * BLOCK_M + tl.arange(0, BLOCK_M)
    c = tl.arange(0, BLOCK_N)
    rmask = r < rows
    cmask = c < n
    mask = rmask[:, None] & cmask[None, :]
    offs = r.to(tl.int64)[:, None] * n + c[None, :]
    x = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_RES:
        s = (x + tl.load(R + offs, mask=mask, other=0.0).to(tl.float32)).to(S.dtype.element_ty)
        tl.store(S + offs, s, mask=mask)
        x = s.to(tl.float32)
    ss = tl.sum(x * x, axis=1)
    if COMPRESSED:
        sm = tl.sum(x, axis=1)
        ss = ss + sm * sm
    rstd = tl.rsqrt(ss * inv_d + eps)
    y = x * rstd[:, None]
    if HAS_W:
        y = y * tl.load(W + c, mask=cmask, other=0.0).to(tl.float32)[None, :]
    if HAS_B:
        y = y + tl.load(B + c, mask=cmask, other=0.0).to(tl.float32)[None, :]
    tl.store(Y + offs, y.to(Y.dtype.element_ty), mask=mask)
    if STORE_RSTD:
        tl.store(RSTD + r, rstd, mask=rmask)


@triton.jit
def _bwd(DY, X, W, RSTD, DS, DX, DWP, DBP, rows, n, inv_d, rows_per_prog, ROWS_BUCKET,
         HAS_W: tl.constexpr, HAS_DS: tl.constexpr, COMPRESSED: tl.constexpr, NEED_DW: tl.constexpr,
         NEED_DB: tl.constexpr, BLOCK_N: tl.constexpr):
    # One program walks a contiguous range of rows, keeping its share of dweight/dbias in
    # registers, and writes it once to its own row of the float32 partial buffers (no atomics,
    # so the result is deterministic and the autotuner may rerun the kernel safely).
    #   RMS:  dx = rstd * (g - xhat * sum(g * xhat) / n),                  g = dy * w
    #   CRMS: dx = rstd * (g - (xhat + rstd * sum(x)) * sum(g * xhat) / d)
    pid = tl.program_id(0)
    c = tl.arange(0, BLOCK_N)
    cmask = c < n
    if HAS_W:
        w = tl.load(W + c, mask=cmask, other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK_N], dtype=tl.float32)
    db = tl.zeros([BLOCK_N], dtype=tl.float32)
    start = pid.to(tl.int64) * rows_per_prog  # int64 row index: offsets may exceed 2**31
    end = tl.minimum(start + rows_per_prog, rows)
    for row in range(start, end):
        offs = row * n + c
        x = tl.load(X + offs, mask=cmask, other=0.0).to(tl.float32)
        dy = tl.load(DY + offs, mask=cmask, other=0.0).to(tl.float32)
        rstd = tl.load(RSTD + row)
        xhat = x * rstd
        g = dy
        if HAS_W:
            g = dy * w
        dot = tl.sum(g * xhat, axis=0) * inv_d
        if COMPRESSED:
            dx = rstd * (g - (xhat + rstd * tl.sum(x, axis=0)) * dot)
        else:
            dx = rstd * (g - xhat * dot)
        if HAS_DS:
            dx = dx + tl.load(DS + offs, mask=cmask, other=0.0).to(tl.float32)
        tl.store(DX + offs, dx.to(DX.dtype.element_ty), mask=cmask)
        if NEED_DW:
            dw += dy * xhat
        if NEED_DB:
            db += dy
    if NEED_DW:
        tl.store(DWP + pid.to(tl.int64) * n + c, dw, mask=cmask)
    if NEED_DB:
        tl.store(DBP + pid.to(tl.int64) * n + c, db, mask=cmask)

