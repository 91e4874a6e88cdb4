"""Calling the CPU kernels (no autograd): the table of bound entry points (the pycall extension's, else
ctypes'), the fast inference path, and the general forward / fused add / backward calls. cpu.py loads the
library, fills the table (`bind`) and registers how to load it on first use (`set_loader`)."""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
_PARAM_FAST = frozenset(DTYPE_CODES)

_fast: list = [None, {}]  # [nf_forward_simple, {dtype: code}] of the loaded library (see fast_forward)
# How the kernels are called: the pycall extension's functions when it loads, else ctypes' (pycall.py).
_calls: dict = {"forward": None, "backward": None, "via": None, "note": None}
# cpu.py's loader: `first_use()` loads the library unless that was already tried (True when it did),
# `require()` loads it if needed and raises RuntimeError when it is unavailable
_loader: dict[str, Callable | None] = {"first_use": None, "require": None}


def set_loader(first_use: Callable[[], bool], require: Callable[[], object]) -> None:
    _loader.update(first_use=first_use, require=require)


def bind(forward, simple, backward, via: str | None, note: str | None, dtypes: frozenset) -> None:
    """Use these entry points (all None: unbind)."""
    _calls.update(forward=forward, backward=backward, via=via, note=note)
    _fast[:] = [simple, {dt: DTYPE_CODES[dt] for dt in dtypes}]


def calls() -> dict:
    """The bound entry points and how they are called (`via`: "pycall" or "ctypes", with `note` why not pycall)."""
    return _calls


def fast_table() -> list:
    """[nf_forward_simple or None, {dtype: code}] of the loaded library."""
    return _fast


def tracing() -> bool:
    try:
        return torch.compiler.is_compiling()
    except AttributeError:  # torch < 2.3
        return False


def _first_use() -> bool:
    f = _loader["first_use"]
    return f is not None and f()


def _ensure_bound() -> None:
    if _calls["forward"] is None:
        req = _loader["require"]
        if req is None:
            raise RuntimeError("normfold CPU kernel unavailable (not loaded)")
        req()


# ---- raw kernel calls (no autograd) -----------------------------------------------------------------

def _fast_params(weight: Tensor | None, bias: Tensor | None, x: Tensor, n: int, codes: dict):
    """(weight pointer, dtype code, bias pointer, dtype code) as the fast calls pass them (None, 0 for an
    absent one), or None when one is not contiguous on the CPU in float32 or x's dtype with n entries."""
    out = []
    for p in (weight, bias):
        if p is None:
            out += (None, 0)
            continue
        code = codes.get(p.dtype)
        if (p.dtype is not x.dtype and code != 0) or code is None or p.shape != (n,) or \
                not p.is_contiguous() or not p.is_cpu:
            return None
        out += (p.data_ptr(), code)
    return out


def fast_forward(x: Tensor, weight: Tensor | None, bias: Tensor | None, eps: float, compressed: bool):
    """y = norm(x) for the common inference case (contiguous x with rows, parameters contiguous in
    float32 or x's dtype), with as little Python as possible: the modules call this first on every
    call, so at decode sizes (one row) it is most of the time a norm takes. Returns None when the
    case is not that one (the caller then takes the general path, which also raises user errors)."""
    f, codes = _fast
    if f is None:
        if tracing() or not _first_use():
            return None
        f, codes = _fast
        if f is None:
            return None
    code = codes.get(x.dtype)
    if code is None or not x.is_cpu or x.dim() == 0:
        return None
    n = x.shape[-1]
    numel = x.numel()
    if numel == 0:
        return None
    params = _fast_params(weight, bias, x, n, codes)
    if params is None:
        return None
    wp, wdt, bp, bdt = params
    if not x.is_contiguous():
        return _fast_strided(code, x, n, params, eps, compressed)
    y = torch.empty_like(x)
    if f(code, x.data_ptr(), wp, wdt, bp, bdt, y.data_ptr(), numel // n, n, eps, compressed,
         torch.get_num_threads()) != 0:
        return None
    return y


def _row_view(t: Tensor, n: int) -> tuple[Tensor, int] | None:
    """(t as (rows, n), elements between rows) when that is a view of t's memory with a unit last stride
    (a slice t[..., :k] of a contiguous tensor, what Pre-CRMS's padded writers and the stream's entry
    return), else None. No copy: the kernels read rows `ld` elements apart."""
    if t.stride(-1) != 1:
        return None
    try:
        t2 = t.view(-1, n)
    except RuntimeError:
        return None
    ld = t2.stride(0) if t2.shape[0] > 1 else n
    return (t2, ld) if ld >= n else None


def _fast_strided(code: int, x: Tensor, n: int, params, eps: float, compressed: bool):
    """fast_forward for a row-strided x (`_row_view`): the general kernel entry with the row distance,
    the same kernel and arithmetic per row as the dispatcher's path (`_launch_fwd`) takes for it."""
    f = _calls["forward"]
    rv = _row_view(x, n)
    if f is None or rv is None:
        return None
    x2, xs = rv
    wp, wdt, bp, bdt = params
    y = torch.empty(x.shape, dtype=x.dtype)
    if f(code, x2.data_ptr(), xs, None, 0, wp, wdt, bp, bdt, y.data_ptr(), None, None, x2.shape[0], n,
         float(eps), int(compressed), torch.get_num_threads()) != 0:
        return None
    return y


def fast_add_forward(x: Tensor, residual: Tensor, weight: Tensor | None, bias: Tensor | None, eps: float,
                     compressed: bool):
    """(s, y) = (x + residual, norm(x + residual)) for the common inference case (x and residual contiguous,
    of one shape and dtype, parameters as fast_forward takes them): the same kernel call as `add_forward`
    without its general set-up (the fused blocks call this on every block). Returns None when the case is
    not that one or the kernel is not loaded yet (the caller then takes the general path)."""
    f = _calls["forward"]
    code = _fast[1].get(x.dtype)
    if f is None or code is None or residual.dtype is not x.dtype or not x.is_cpu or not residual.is_cpu \
            or x.dim() == 0 or residual.shape != x.shape:
        return None
    n = x.shape[-1]
    numel = x.numel()
    if numel == 0:
        return None
    codes = _fast[1]
    params = _fast_params(weight, bias, x, n, codes)
    if params is None:
        return None
    wp, wdt, bp, bdt = params
    # row-strided operands (`_row_view`: Pre-CRMS's padded writers return x[..., :d−1] of a d-wide
    # product) are read in place, as the dispatcher's path reads them
    xv = (x, n) if x.is_contiguous() else _row_view(x, n)
    rv = (residual, n) if residual.is_contiguous() else _row_view(residual, n)
    if xv is None or rv is None:
        return None
    contiguous = xv[0] is x and rv[0] is residual
    y = torch.empty_like(x) if contiguous else torch.empty(x.shape, dtype=x.dtype)
    s = torch.empty_like(x) if contiguous else torch.empty(x.shape, dtype=x.dtype)
    if f(code, xv[0].data_ptr(), xv[1], rv[0].data_ptr(), rv[1], wp, wdt, bp, bdt, y.data_ptr(), s.data_ptr(),
         None, numel // n, n, float(eps), int(compressed), torch.get_num_threads()) != 0:
        return None
    return s, y


def _rows(t: Tensor, n: int) -> tuple[Tensor, int]:
    """t as (rows, n) with a unit last stride, and the distance between its rows (a view when
    possible: a slice x[..., :k] of a contiguous tensor is read in place)."""
    if t.is_contiguous():
        return t, n
    t2 = t.reshape(-1, n)
    if t2.stride(1) != 1 or (t2.shape[0] > 1 and t2.stride(0) < n):
        t2 = t2.contiguous()
    return t2, (t2.stride(0) if t2.shape[0] > 1 else n)


def _param(p: Tensor | None, n: int, x: Tensor, name: str) -> tuple[Tensor | None, int]:
    """A weight/bias the kernel can read (contiguous, float32 or x's dtype) and its dtype code."""
    if p is None:
        return None, 0
    if p.dtype in _PARAM_FAST and p.is_contiguous() and p.is_cpu and p.numel() == n and (
            p.dtype == torch.float32 or p.dtype == x.dtype):
        return p, DTYPE_CODES[p.dtype]  # the common case, without extra tensor ops
    if p.numel() != n:
        raise ValueError(f"{name} has {p.numel()} elements, expected the normalized width {n}")
    p = p.detach()
    if p.dtype not in (torch.float32, x.dtype):
        p = p.float()
    if p.device.type != "cpu":
        raise ValueError(f"{name} is on {p.device}, the input on cpu")
    return p.contiguous(), DTYPE_CODES[p.dtype]


def _empty(x: Tensor) -> Tensor:
    # empty_like is the cheaper call, and contiguous for a contiguous x
    return torch.empty_like(x) if x.is_contiguous() else torch.empty(x.shape, dtype=x.dtype)


def _launch_fwd(x: Tensor, residual: Tensor | None, weight, bias, eps: float, compressed: bool, want_rstd: bool,
                want_y: bool = True):
    _ensure_bound()
    n = x.shape[-1]
    x2, xs = _rows(x, n)
    rows = x.numel() // n
    r2, rst = _rows(residual, n) if residual is not None else (None, 0)
    (w, wdt), (b, bdt) = _param(weight, n, x, "weight"), _param(bias, n, x, "bias")
    y = _empty(x) if want_y else None
    s = _empty(x) if residual is not None else None
    rstd = torch.empty(x.shape[:-1], dtype=torch.float32) if want_rstd else None
    rc = _calls["forward"](DTYPE_CODES[x.dtype], x2.data_ptr(), xs, None if r2 is None else r2.data_ptr(), rst,
                            None if w is None else w.data_ptr(), wdt, None if b is None else b.data_ptr(), bdt,
                            None if y is None else y.data_ptr(), None if s is None else s.data_ptr(),
                            None if rstd is None else rstd.data_ptr(), rows, n, float(eps), int(compressed),
                            torch.get_num_threads())
    if rc != 0:
        raise RuntimeError(f"normfold CPU kernel failed (code {rc}) for dtype {x.dtype}")
    return s, y, rstd


def forward(x: Tensor, weight: Tensor | None, bias: Tensor | None, eps: float, compressed: bool,
            want_rstd: bool) -> tuple[Tensor, Tensor | None]:
    """Raw kernel call (no autograd). Returns (y, rstd or None); rstd is float32 with x.shape[:-1]."""
    _, y, rstd = _launch_fwd(x, None, weight, bias, eps, compressed, want_rstd)
    return y, rstd


def _check_residual(x: Tensor, residual: Tensor) -> None:
    if residual.shape != x.shape or residual.dtype != x.dtype:
        raise ValueError(f"residual {tuple(residual.shape)} {residual.dtype} must match x "
                         f"{tuple(x.shape)} {x.dtype}")


def row_scale(x: Tensor, residual: Tensor | None, eps: float, compressed: bool) -> tuple[Tensor | None, Tensor]:
    """The per-row 1/rms of x (or of s = x + residual, also returned) without writing the normalized
    tensor: one read of x (and residual, and one write of s). Returns (s or None, rstd float32)."""
    if residual is not None:
        _check_residual(x, residual)
    s, _, rstd = _launch_fwd(x, residual, None, None, eps, compressed, True, want_y=False)
    return s, rstd


def add_forward(x: Tensor, residual: Tensor, weight: Tensor | None, bias: Tensor | None, eps: float,
                compressed: bool, want_rstd: bool) -> tuple[Tensor, Tensor, Tensor | None]:
    """Fused s = x + residual, y = norm(s) in one pass. Returns (s, y, rstd or None); s is rounded to
    x's dtype before it is normalized, exactly as the unfused `x + residual` would be."""
    _check_residual(x, residual)
    return _launch_fwd(x, residual, weight, bias, eps, compressed, want_rstd)


def backward(dy: Tensor, x: Tensor, weight: Tensor | None, rstd: Tensor, compressed: bool, need_dw: bool,
             need_db: bool, ds: Tensor | None = None) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """Gradients of y = norm(x) given dy; `x` is the normalized input (the sum s for the fused
    variant, whose own gradient `ds` is then added to dx in the same pass). Returns
    (dx, dweight or None, dbias or None); dweight/dbias in float32."""
    _ensure_bound()
    n = x.shape[-1]
    x2, xs = _rows(x, n)
    rows = x.numel() // n
    dy2 = dy.to(x.dtype).reshape(rows, n).contiguous()
    ds2 = None if ds is None else ds.to(x.dtype).reshape(rows, n).contiguous()
    w, wdt = _param(weight, n, x, "weight")
    rstd = rstd.reshape(rows).contiguous()
    dx = _empty(x)
    threads = max(1, torch.get_num_threads())
    # Per-thread float32 partial rows; the kernel sums them into row 0.
    dw_part = torch.empty(threads, n, dtype=torch.float32) if need_dw else None
    db_part = torch.empty(threads, n, dtype=torch.float32) if need_db else None
    rc = _calls["backward"](DTYPE_CODES[x.dtype], dy2.data_ptr(), None if ds2 is None else ds2.data_ptr(),
                            x2.data_ptr(), xs, None if w is None else w.data_ptr(), wdt, rstd.data_ptr(),
                            dx.data_ptr(), None if dw_part is None else dw_part.data_ptr(),
                            None if db_part is None else db_part.data_ptr(), rows, n, int(compressed), threads)
    if rc != 0:
        raise RuntimeError(f"normfold CPU kernel failed (code {rc}) for dtype {x.dtype}")
    return dx, (dw_part[0] if need_dw else None), (db_part[0] if need_db else None)
