"""`normfold bench ops --device cuda`: normfold's Triton norms against torch's on a GPU.

Forward: F.layer_norm (weight and bias), F.rms_norm, torch.ops.aten._fused_rms_norm, normfold's
RMSNorm and CRMSNorm (d−1 wide), the fused residual add + RMSNorm against `x + r` then LayerNorm,
and x.clone(), the device-to-device copy that reads and writes the same bytes (the bandwidth a
norm can at best reach). Backward: aten's LayerNorm and fused-RMSNorm backward against normfold's.

By default each candidate is captured `calls` times in one CUDA graph and the graph is replayed:
that times the kernels, not Python's launch overhead (which dominates at small shapes and is
what `eager=True` measures). Targets: forward ≥ 85 % of copy bandwidth at large
shapes, and faster than all three torch norms at every shape.
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from .. import ops
from ..errors import NormfoldError
from ..ops import triton_kernels as tk
from .results import write
from .timing import Bar, Stats, cuda_graphed, machine_info, measure

SHAPES = [(512, 768), (4096, 768), (1024, 4096), (8192, 1024), (4096, 1023)]
# Large enough (≥ 256 MiB per tensor in float32) that L2 (50 MB on an H100) does not hold them.
LARGE_SHAPES = [(32768, 2048), (16384, 4096), (8192, 8192)]
QUICK_SHAPES = [(4096, 768), (4096, 1023), (16384, 4096)]
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
EPS = 1e-5
BANDWIDTH_TARGET = 0.85

COLUMNS = ["shape", "dtype", "rms_us", "copy_us", "rms_GBps", "rms/copy_bw", "rms/ln", "rms/torch_rms",
           "rms/aten_rms", "crms/ln", "add_rms/add_ln", "bwd_rms/ln", "bwd_rms/aten_rms", "meets_target"]


def _aten(name: str):
    return getattr(torch.ops.aten, name, None)


def _works(fn) -> bool:
    """Whether this torch build implements the op for this device (aten's fused RMSNorm backward has
    no CPU kernel; older torch has no fused RMSNorm at all)."""
    try:
        fn()
        return True
    except (NotImplementedError, RuntimeError):
        return False


def forward_candidates(shape, dtype, device) -> dict:
    d = shape[-1]
    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(shape, dtype=dtype, device=device, generator=g)
    r = torch.randn(shape, dtype=dtype, device=device, generator=g)
    xc = torch.randn(*shape[:-1], d - 1, dtype=dtype, device=device, generator=g)
    w, b = (torch.randn(d, dtype=dtype, device=device, generator=g) for _ in range(2))
    wc = w[: d - 1].contiguous()
    cands = {
        "layer_norm": lambda: F.layer_norm(x, (d,), w, b, EPS),
        "torch_rms": lambda: F.rms_norm(x, (d,), w, EPS),
        "rms": lambda: tk.forward(x, w, None, EPS, False, want_rstd=False),
        "crms": lambda: tk.forward(xc, wc, None, EPS, True, want_rstd=False),
        "add_rms": lambda: tk.add_forward(x, r, w, None, EPS, False, want_rstd=False),
        "add_ln": lambda: F.layer_norm(x + r, (d,), w, b, EPS),
        "copy": lambda: x.clone(),
    }
    fused = _aten("_fused_rms_norm")
    if fused is not None and _works(lambda: fused(x, [d], w, EPS)):
        cands["aten_rms"] = lambda: fused(x, [d], w, EPS)
    return cands


def backward_candidates(shape, dtype, device) -> dict:
    d = shape[-1]
    g = torch.Generator(device=device).manual_seed(1)
    x = torch.randn(shape, dtype=dtype, device=device, generator=g)
    dy = torch.randn(shape, dtype=dtype, device=device, generator=g)
    w, b = (torch.randn(d, dtype=dtype, device=device, generator=g) for _ in range(2))
    _, mean, rstd_ln = torch.ops.aten.native_layer_norm(x, [d], w, b, EPS)
    _, rstd = tk.forward(x, w, None, EPS, False, want_rstd=True)
    cands = {
        "bwd_ln": lambda: torch.ops.aten.native_layer_norm_backward(dy, x, [d], mean, rstd_ln, w, b,
                                                                    [True, True, True]),
        "bwd_rms": lambda: tk.backward(dy, x, w, rstd, False, need_dw=True, need_db=False),
    }
    fused, fused_bwd = _aten("_fused_rms_norm"), _aten("_fused_rms_norm_backward")
    if fused is not None and fused_bwd is not None and _works(lambda: fused(x, [d], w, EPS)):
        _, rstd_a = fused(x, [d], w, EPS)
        if _works(lambda: fused_bwd(dy, x, [d], rstd_a, w, [True, True])):
            cands["bwd_aten_rms"] = lambda: fused_bwd(dy, x, [d], rstd_a, w, [True, True])
    return cands


def _calls_per_graph(fn, device) -> int:
    for _ in range(3):
        fn()
    torch.cuda.synchronize(device)
    t = time.perf_counter()
    fn()
    torch.cuda.synchronize(device)
    once = time.perf_counter() - t
    return max(5, min(200, int(2e-3 / max(once, 1e-6))))


def _time(cands: dict, device: str, graphs: bool, rounds: int, tick) -> dict[str, Stats]:
    on_cuda = device.startswith("cuda")
    calls = {}
    if on_cuda and graphs:
        for name, fn in list(cands.items()):
            calls[name] = _calls_per_graph(fn, device)
            cands[name] = cuda_graphed(fn, calls[name])
    stats = measure(cands, rounds=rounds, warmup=3, device="cuda" if on_cuda else "cpu", tick=tick)
    return {k: Stats(s.median / calls.get(k, 1), s.q25 / calls.get(k, 1), s.q75 / calls.get(k, 1), s.n)
            for k, s in stats.items()}


def _ratio(us: dict, a: str, b: str) -> float:
    return us[a] / us[b] if a in us and b in us else float("nan")


def run(out_dir="benchmarks", quick: bool = False, rounds: int | None = None, progress: bool = True,
        device: str = "cuda", graphs: bool = True, shapes=None, dtypes=None, backward: bool = True):
    """Measure and write ops_cuda.{csv,md,png}. Returns (rows, paths)."""
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise NormfoldError("--device cuda: no CUDA device is visible to torch")
    if not tk.available():
        raise NormfoldError("the GPU kernels need the triton package: pip install triton "
                            "(CUDA builds of torch ship it)")
    if not device.startswith("cuda") and not tk.interpreting():
        raise NormfoldError("this suite times the Triton kernels on a GPU (--device cuda); on CPU they run only "
                            "in Triton's interpreter (TRITON_INTERPRET=1), for a functional smoke run")
    shapes = shapes or (QUICK_SHAPES if quick else SHAPES + LARGE_SHAPES)
    dtypes = dtypes or list(DTYPES)
    rounds = rounds or (10 if quick else 30)
    machine = machine_info()
    rows = []
    bar = Bar(len(shapes) * len(dtypes) * rounds * (2 if backward else 1), "bench ops (cuda)", enabled=progress)
    large = {tuple(s) for s in LARGE_SHAPES}
    for dname in dtypes:
        dtype = DTYPES[dname]
        for shape in shapes:
            with torch.inference_mode():
                fwd = _time(forward_candidates(shape, dtype, device), device, graphs, rounds, bar.step)
            bwd = _time(backward_candidates(shape, dtype, device), device, graphs, rounds, bar.step) if backward else {}
            us = {k: s.median * 1e6 for k, s in {**fwd, **bwd}.items()}
            nbytes = 2 * torch.Size(shape).numel() * torch.finfo(dtype).bits // 8
            row = {"shape": "x".join(map(str, shape)), "dtype": dname, "rms_us": us["rms"], "copy_us": us["copy"],
                   "rms_GBps": nbytes / (us["rms"] * 1e-6) / 1e9, "copy_GBps": nbytes / (us["copy"] * 1e-6) / 1e9,
                   "rms/copy_bw": us["copy"] / us["rms"], "rms/ln": _ratio(us, "rms", "layer_norm"),
                   "rms/torch_rms": _ratio(us, "rms", "torch_rms"), "rms/aten_rms": _ratio(us, "rms", "aten_rms"),
                   "crms/ln": _ratio(us, "crms", "layer_norm"), "add_rms/add_ln": _ratio(us, "add_rms", "add_ln"),
                   "bwd_rms/ln": _ratio(us, "bwd_rms", "bwd_ln"),
                   "bwd_rms/aten_rms": _ratio(us, "bwd_rms", "bwd_aten_rms"),
                   "timing": "cuda-graph" if graphs and device.startswith("cuda") else "eager",
                   "backend": ops.backend_for(torch.empty(1, shape[-1], dtype=dtype, device=device))}
            faster = all(not (row[k] >= 1.0) for k in ("rms/ln", "rms/torch_rms", "rms/aten_rms"))
            row["meets_target"] = faster and (tuple(shape) not in large or row["rms/copy_bw"] >= BANDWIDTH_TARGET)
            for k, s in {**fwd, **bwd}.items():
                row[f"{k}_us"], row[f"{k}_q25_us"], row[f"{k}_q75_us"] = s.median * 1e6, s.q25 * 1e6, s.q75 * 1e6
            rows.append(row)
    bar.close()
    notes = (f"rms/copy_bw: share of x.clone()'s bandwidth reached by the RMSNorm forward (target ≥ "
             f"{BANDWIDTH_TARGET:.0%} at the large shapes {', '.join('x'.join(map(str, s)) for s in LARGE_SHAPES)}); "
             "ratios < 1 mean normfold is faster. meets_target: faster than F.layer_norm, F.rms_norm and "
             "aten._fused_rms_norm, and (large shapes) the bandwidth target. Timing: "
             + ("CUDA-graph replays (kernel time)." if graphs and device.startswith("cuda")
               else "eager launches (includes Python overhead)."))
    paths = write(rows, "ops_cuda", out_dir, machine, COLUMNS,
                  "Norm kernels on GPU: median time and ratios (lower is better)", plot=_plot, extra=notes + "\n")
    return rows, paths


def _plot(rows, path, machine):
    import matplotlib.pyplot as plt

    labels = [f"{r['shape']}\n{r['dtype']}" for r in rows]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(max(8, len(rows) * 1.4), 4))
    xs = list(range(len(rows)))
    width = 0.2
    for i, (key, name) in enumerate([("rms/ln", "vs F.layer_norm"), ("rms/torch_rms", "vs F.rms_norm"),
                                     ("rms/aten_rms", "vs aten._fused_rms_norm"), ("bwd_rms/ln", "backward vs LN")]):
        ax1.bar([x + (i - 1.5) * width for x in xs], [r[key] for r in rows], width, label=name)
    ax1.axhline(1.0, color="grey", lw=0.8)
    ax1.set_ylabel("normfold time / torch time")
    ax1.set_xticks(xs, labels, fontsize=6)
    ax1.legend(fontsize=7)
    ax2.bar([x - 0.2 for x in xs], [r["rms_GBps"] for r in rows], 0.4, label="normfold RMSNorm")
    ax2.bar([x + 0.2 for x in xs], [r["copy_GBps"] for r in rows], 0.4, label="x.clone()")
    ax2.set_ylabel("GB/s (read + write)")
    ax2.set_xticks(xs, labels, fontsize=6)
    ax2.legend(fontsize=7)
    fig.suptitle(f"normfold Triton kernels ({machine.get('gpu', machine.get('cpu', ''))[:40]})", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
