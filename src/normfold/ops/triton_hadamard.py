"""The fast Walsh–Hadamard transform in Triton, for CUDA float32 tensors (`normfold.ops.hadamard.fwht_fast`
sends them here).

`fwht(x, core)` computes x·(H_m ⊗ H_p)/√n over the last axis like `normfold.ops.hadamard.fwht`, with the
same adds in the same order (bit-identical to it on the same arithmetic): one program holds BLOCK_M whole
rows as a (BLOCK_M, m', p) tile (m' = next power of two ≥ m), runs the log2(p) butterfly stages as
reshape / split / join of the tile, the m×m core as m outer-product accumulations, and scales once.
Widths up to MAX_WIDTH (m'·p elements per row); wider rows, other dtypes, autograd and torch.compile /
export use the aten op. Importing this module never imports triton (that happens on the first launch).

Testing without a GPU: with TRITON_INTERPRET=1 set before triton is first imported, the kernel runs on
CPU tensors in Triton's interpreter; `supports()` never selects that path, tests call `fwht` directly.
NORMFOLD_TRITON=0 disables it like the norm kernels.
"""

from __future__ import annotations

import functools
import math

import torch
from torch import Tensor

from .triton_kernels import available, disabled, interpreting

MAX_WIDTH = 16384  # padded elements per row held in registers


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def _padded(n: int, m: int) -> int:
    return _pow2(m) * (n // m)


def supports(x: Tensor, m: int = 1) -> bool:
    """True for CUDA float32 tensors without autograd this kernel handles (padded width ≤ MAX_WIDTH)."""
    n = x.shape[-1] if x.dim() else 0
    return (x.is_cuda and x.dtype == torch.float32 and not x.requires_grad and n > 0 and x.numel() > 0
            and _padded(n, m) <= MAX_WIDTH and not disabled() and available())


@functools.lru_cache(maxsize=None)
def _kernel():
    if not available():
        raise RuntimeError("normfold: the Triton kernels need the `triton` package (pip install triton)")
    from . import _triton_hadamard

    return _triton_hadamard._fwht


def _block_m(rows: int, width: int, on_gpu: bool) -> int:
    # ~4096 elements per program, fewer rows when that would leave programs for less than 2 waves of SMs
    bm = _pow2(max(1, min(16, 4096 // width)) + 1) // 2  # a power of two
    while bm > 1 and (_cdiv(rows, bm) < 256 if on_gpu else bm > rows):  # the interpreter: few programs
        bm //= 2
    return bm


def fwht(x: Tensor, core: Tensor | None = None, out: Tensor | None = None) -> Tensor:
    """x·(H_m ⊗ H_p)/√n over the last axis with the Triton kernel (no autograd). `core` is H_m (None for
    m = 1); `out` a contiguous float32 tensor of x's shape to write into (may be x itself). CUDA
    tensors, or CPU tensors under TRITON_INTERPRET=1."""
    kernel = _kernel()
    if not x.is_cuda and not interpreting():
        raise ValueError("normfold's Triton kernels take CUDA tensors (CPU tensors only with TRITON_INTERPRET=1)")
    if x.dtype != torch.float32:
        raise ValueError(f"the Triton Walsh–Hadamard kernel takes float32, not {x.dtype}")
    n = x.shape[-1]
    m = 1 if core is None else core.shape[0]
    p = n // m
    if m * p != n or p & (p - 1):
        raise ValueError(f"fwht: width {n} is not {m}·2^k")
    src = x.contiguous()
    y = torch.empty_like(src) if out is None else out
    if out is not None and (out.shape != x.shape or out.dtype != x.dtype or not out.is_contiguous()):
        raise ValueError("fwht: out must be a contiguous float32 tensor of x's shape")
    rows = src.numel() // n if n else 0
    if rows == 0:
        return y
    c = (core.to(device=x.device, dtype=torch.float32).contiguous() if core is not None
         else torch.zeros(1, dtype=torch.float32, device=x.device))
    m2 = _pow2(m)
    bm = _block_m(rows, m2 * p, x.is_cuda)
    warps = max(1, min(8, (bm * m2 * p) // 512))
    kernel[(_cdiv(rows, bm),)](src, y, c, rows, 1.0 / math.sqrt(n), M=m, M2=m2, P=p,
                                   LOG_P=p.bit_length() - 1, HAS_CORE=core is not None and m > 1,
                                   BLOCK_M=bm, num_warps=warps)
    return y
