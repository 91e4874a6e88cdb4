"""GPU RMSNorm / CRMSNorm in Triton: forward, backward, and the fused "residual add + norm".

Same interface as `normfold.ops.cpu` (`supports`, `forward`, `backward`), so the dispatcher can use
it as the backend for CUDA tensors; plus `add_forward` (returns the sum and the normalized value)
and autograd wrappers `norm` / `add_norm`. Importing this module never fails: without the
`triton` package `available()` is False and `supports()` says no.

Why Triton: a norm is memory-bound, and one kernel that reads x once and writes y once (the
statistic, the affine and the optional residual add fused) moves the fewest bytes possible.
torch's F.rms_norm is several kernels; `aten._fused_rms_norm` has no bias, no CRMSNorm and no
fused add.

Launch configuration: by default each (kernel, width, dtype, row-count bucket) is autotuned once
per process over a small set of tile shapes (a few hundred ms the first time a shape is seen);
NORMFOLD_TRITON_AUTOTUNE=0 uses the built-in heuristic instead. NORMFOLD_TRITON=0 disables the
backend (the dispatcher then uses the reference ops).

Testing without a GPU: with TRITON_INTERPRET=1 in the environment before triton is first
imported, the same kernels run on CPU tensors in Triton's interpreter (numpy, slow; it rounds
float32 -> bfloat16 by truncation, so results may differ from a GPU's by one bf16 ulp).
`supports()` never selects that path; tests call `forward` / `backward` directly.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import sys

import torch
from torch import Tensor

triton = None  # the module, imported on first launch (see _triton())

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# Rows are held in registers; wider rows fall back to the reference ops.
MAX_WIDTH = 65536


@functools.lru_cache(maxsize=None)
def available() -> bool:
    """Whether the optional `triton` package is installed (CUDA wheels of torch ship it)."""
    try:
        return importlib.util.find_spec("triton") is not None
    except (ImportError, ValueError):  # a broken or half-removed installation
        return False


def interpreting() -> bool:
    """Triton's interpreter mode (TRITON_INTERPRET=1): kernels run on CPU tensors."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def _triton():
    global triton
    if triton is None:
        if not available():
            raise RuntimeError("normfold: the Triton backend needs the `triton` package (pip install triton)")
        import triton as _t

        triton = _t
    return triton


def disabled() -> bool:
    return os.environ.get("NORMFOLD_TRITON", "1").lower() in ("0", "false", "off", "no")


def _autotune_enabled() -> bool:
    return os.environ.get("NORMFOLD_TRITON_AUTOTUNE", "1").lower() not in ("0", "false", "off", "no")


def supports(x: Tensor) -> bool:
    """True for CUDA tensors this backend handles (float32/bfloat16/float16, width ≤ MAX_WIDTH)."""
    return (x.is_cuda and x.dtype in DTYPES and x.dim() >= 1 and 0 < x.shape[-1] <= MAX_WIDTH
            and x.numel() > 0 and not disabled() and available())


def status() -> dict:
    version = None
    if available():
        from importlib.metadata import PackageNotFoundError, version as _version

        try:
            version = _version("triton")
        except PackageNotFoundError:
            pass
    return {"available": available(), "disabled": disabled(), "autotune": _autotune_enabled(), "version": version}


# ---- kernels and launch configuration -------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def _kernels() -> dict:
    _triton()
    from . import _triton_norm

    k = {"fwd": _triton_norm._fwd, "bwd": _triton_norm._bwd}
    if not interpreting():
        k["fwd_tuned"] = _autotune(k["fwd"], _fwd_configs(), ["n", "ROWS_BUCKET", "HAS_RES", "HAS_W"], _prune_fwd)
        k["bwd_tuned"] = _autotune(k["bwd"], _bwd_configs(), ["n", "ROWS_BUCKET", "HAS_W", "NEED_DW"], _prune_bwd)
    return k


def _autotune(kernel, configs, key, prune):
    # Triton's default timing (25 ms warm-up + 100 ms per config) is far more than a norm needs.
    # Older Triton releases take warmup/rep instead of a do_bench callable.
    import triton.testing

    def quick(fn, quantiles=None):
        return triton.testing.do_bench(fn, warmup=5, rep=20, quantiles=quantiles)

    prune_by = {"early_config_prune": prune}
    try:
        return triton.autotune(configs=configs, key=key, prune_configs_by=prune_by, do_bench=quick)(kernel)
    except TypeError:
        return triton.autotune(configs=configs, key=key, prune_configs_by=prune_by, warmup=5, rep=20)(kernel)


def _fwd_configs():
    return [triton.Config({"BLOCK_M": m}, num_warps=w) for m in (1, 2, 4, 8, 16) for w in (1, 2, 4, 8, 16, 32)]


def _bwd_configs():
    return [triton.Config({}, num_warps=w) for w in (1, 2, 4, 8, 16, 32)]


def _per_thread(tile: int, warps: int) -> float:
    return tile / (32 * warps)


def _prune_fwd(configs, named_args, **kwargs):
    block_n = _pow2(named_args["n"])
    rows = named_args["rows"]
    keep = [c for c in configs
            if c.kwargs["BLOCK_M"] * block_n <= 32768
            and 4 <= _per_thread(c.kwargs["BLOCK_M"] * block_n, c.num_warps) <= 64
            and (c.kwargs["BLOCK_M"] == 1 or rows >= 8 * c.kwargs["BLOCK_M"])]
    block_m, warps = _fwd_heuristic(rows, block_n, torch.float32, 132)
    return keep or [triton.Config({"BLOCK_M": block_m}, num_warps=warps)]


def _prune_bwd(configs, named_args, **kwargs):
    block_n = _pow2(named_args["n"])
    keep = [c for c in configs if 2 <= _per_thread(block_n, c.num_warps) <= 64]
    return keep or [triton.Config({}, num_warps=_bwd_warps(block_n))]


@functools.lru_cache(maxsize=4096)
def _fwd_heuristic(rows: int, block_n: int, dtype: torch.dtype, sms: int) -> tuple[int, int]:
    """(BLOCK_M, num_warps): BLOCK_M rows per program so a tile is ~16 KB of input (fewer when that
    would leave SMs idle), and ~16 elements per thread."""
    target = (16384 // (4 if dtype == torch.float32 else 2))
    block_m = max(1, min(16, target // block_n))
    while block_m > 1 and _cdiv(rows, block_m) < 2 * sms:
        block_m //= 2
    warps = max(1, min(32, _pow2(block_m * block_n) // 512))
    return block_m, warps


# Plain-int helpers: triton.cdiv / next_power_of_2 are constexpr functions whose host-side calls
# cost microseconds each, which adds up on a per-launch path.
def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def _bwd_warps(block_n: int) -> int:
    return max(1, min(16, block_n // 256))


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _sms(x: Tensor) -> int:
    # The interpreter runs programs one after another on CPU: a few programs keep it fast.
    return _sm_count(x.device.index or 0) if x.is_cuda else 4


def _bucket(rows: int) -> int:
    return _pow2(rows)


def _rows2d(t: Tensor, n: int) -> Tensor:
    return t.reshape(-1, n).contiguous()


def _param(p: Tensor | None, n: int, x: Tensor, name: str) -> Tensor | None:
    if p is None:
        return None
    if p.numel() != n:
        raise ValueError(f"{name} has {p.numel()} elements, expected the normalized width {n}")
    if p.dim() == 1 and p.is_contiguous() and p.device == x.device:
        return p  # the common case, without per-call copies or views
    return p.detach().reshape(n).to(device=x.device).contiguous()


# ---- raw kernel calls (no autograd) -----------------------------------------------------------------

def _check_device(x: Tensor) -> None:
    _triton()
    if not x.is_cuda and not interpreting():
        raise ValueError("normfold's Triton kernels take CUDA tensors (CPU tensors only with TRITON_INTERPRET=1)")


def _tuned() -> bool:
    return _autotune_enabled() and not interpreting()


# (kernel, width, row bucket, flags, dtypes, device) -> launch kwargs the autotuner chose.
_CHOSEN: dict[tuple, dict] = {}


def _run_tuned(kind: str, grid, args: tuple, flags: dict, key: tuple) -> None:
    """Autotune once per key, then launch the plain kernel with the chosen config: the autotuner's
    per-call bookkeeping costs microseconds that a small memory-bound kernel cannot hide."""
    kern = _kernels()
    key = (kind, *key, *flags.values())
    chosen = _CHOSEN.get(key)
    if chosen is not None:
        kern[kind][grid](*args, **flags, **chosen)
        return
    tuner = kern[f"{kind}_tuned"]
    tuner[grid](*args, **flags)
    best = getattr(tuner, "best_config", None)
    if best is not None and hasattr(best, "all_kwargs"):
        _CHOSEN[key] = best.all_kwargs()


def _dtype(t: Tensor | None):
    return None if t is None else t.dtype


def _launch_fwd(x: Tensor, residual: Tensor | None, weight, bias, eps: float, compressed: bool, want_rstd: bool):
    _check_device(x)
    n = x.shape[-1]
    x2 = _rows2d(x, n)
    rows = x2.shape[0]
    r2 = None if residual is None else _rows2d(residual, n)
    w, b = _param(weight, n, x, "weight"), _param(bias, n, x, "bias")
    y = torch.empty_like(x2)
    s = torch.empty_like(x2) if r2 is not None else None
    rstd = torch.empty(rows, dtype=torch.float32, device=x.device) if want_rstd else None
    dummy = y
    block_n = _pow2(n)
    kern = _kernels()
    args = (x2, r2 if r2 is not None else dummy, w if w is not None else dummy, b if b is not None else dummy,
            y, s if s is not None else dummy, rstd if rstd is not None else dummy, rows, n, float(eps),
            1.0 / (n + 1 if compressed else n), _bucket(rows))
    flags = dict(HAS_RES=r2 is not None, HAS_W=w is not None, HAS_B=b is not None, COMPRESSED=bool(compressed),
                 STORE_RSTD=want_rstd, BLOCK_N=block_n)
    if _tuned():
        _run_tuned("fwd", lambda meta: (_cdiv(rows, meta["BLOCK_M"]),), args, flags,
                   (n, _bucket(rows), x.dtype, _dtype(w), _dtype(b), x.device.index))
    else:
        bm, warps = _fwd_heuristic(rows, block_n, x.dtype, _sms(x))
        kern["fwd"][(_cdiv(rows, bm),)](*args, **flags, BLOCK_M=bm, num_warps=warps)
    out_shape = x.shape
    return (None if s is None else s.view(out_shape)), y.view(out_shape), rstd


def forward(x: Tensor, weight: Tensor | None, bias: Tensor | None, eps: float, compressed: bool,
            want_rstd: bool) -> tuple[Tensor, Tensor | None]:
    """Raw kernel call (no autograd). Returns (y, rstd or None); rstd is float32 with x.shape[:-1]."""
    _, y, rstd = _launch_fwd(x, None, weight, bias, eps, compressed, want_rstd)
    return y, (None if rstd is None else rstd.view(x.shape[:-1]))


def add_forward(x: Tensor, residual: Tensor, weight: Tensor | None, bias: Tensor | None, eps: float,
                compressed: bool, want_rstd: bool) -> tuple[Tensor, Tensor, Tensor | None]:
    """Fused s = x + residual, y = norm(s) in one pass. Returns (s, y, rstd or None); s is rounded to
    x's dtype before it is normalized, exactly as the unfused `x + residual` would be."""
    if residual.shape != x.shape or residual.dtype != x.dtype:
        raise ValueError(f"residual {tuple(residual.shape)} {residual.dtype} must match x "
                         f"{tuple(x.shape)} {x.dtype}")
    s, y, rstd = _launch_fwd(x, residual, weight, bias, eps, compressed, want_rstd)
    return s, y, (None if rstd is None else rstd.view(x.shape[:-1]))


def backward(dy: Tensor, x: Tensor, weight: Tensor | None, rstd: Tensor, compressed: bool, need_dw: bool,
             need_db: bool, ds: Tensor | None = None) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """Gradients of y = norm(x) given dy; `x` is the normalized input (the sum s for the fused
    variant, whose own gradient `ds` is then added to dx in the same pass). Returns
    (dx, dweight or None, dbias or None); dweight/dbias in float32."""
    _check_device(x)
    n = x.shape[-1]
    x2 = _rows2d(x, n)
    rows = x2.shape[0]
    dy2 = _rows2d(dy.to(x.dtype), n)
    ds2 = None if ds is None else _rows2d(ds.to(x.dtype), n)
    w = _param(weight, n, x, "weight")
    need_dw = need_dw and w is not None
    dx = torch.empty_like(x2)
    block_n = _pow2(n)
    # Enough programs to fill the GPU; each keeps one float32 row of dw/db partials.
    programs = max(1, min(rows, _sms(x) * max(1, min(8, 8192 // block_n))))
    rows_per_prog = _cdiv(rows, programs)
    programs = _cdiv(rows, rows_per_prog)
    dwp = torch.empty(programs, n, dtype=torch.float32, device=x.device) if need_dw else None
    dbp = torch.empty(programs, n, dtype=torch.float32, device=x.device) if need_db else None
    dummy = dx
    kern = _kernels()
    args = (dy2, x2, w if w is not None else dummy, rstd.reshape(rows).contiguous(),
            ds2 if ds2 is not None else dummy, dx, dwp if dwp is not None else dummy,
            dbp if dbp is not None else dummy, rows, n, 1.0 / (n + 1 if compressed else n), rows_per_prog,
            _bucket(rows))
    flags = dict(HAS_W=w is not None, HAS_DS=ds2 is not None, COMPRESSED=bool(compressed), NEED_DW=need_dw,
                 NEED_DB=need_db, BLOCK_N=block_n)
    if _tuned():
        _run_tuned("bwd", (programs,), args, flags, (n, _bucket(rows), x.dtype, _dtype(w), x.device.index))
    else:
        kern["bwd"][(programs,)](*args, **flags, num_warps=_bwd_warps(block_n))
    dw = dwp.sum(0) if need_dw else None
    db = dbp.sum(0) if need_db else None
    return dx.view(x.shape), dw, db


# ---- differentiable entry points (the dispatcher's generic autograd Functions) ----------------------------

def norm(x: Tensor, weight: Tensor | None = None, bias: Tensor | None = None, eps: float = 1e-5,
         compressed: bool = False) -> Tensor:
    """RMSNorm (compressed=False) or CRMSNorm of x over its last dimension with these kernels,
    differentiable (used by the interpreter-mode tests, which run on CPU tensors)."""
    from .autograd import norm_with

    return norm_with(sys.modules[__name__], x, weight, bias, eps, compressed)


def add_norm(x: Tensor, residual: Tensor, weight: Tensor | None = None, bias: Tensor | None = None,
             eps: float = 1e-5, compressed: bool = False) -> tuple[Tensor, Tensor]:
    """(s, norm(s)) with s = x + residual, in one pass; differentiable."""
    from .autograd import add_norm_with

    return add_norm_with(sys.modules[__name__], x, residual, weight, bias, eps, compressed)
