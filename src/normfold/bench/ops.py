"""`normfold bench ops`: normfold's norms against torch's LayerNorm, RMSNorm and a plain copy.

Ratios < 1 mean normfold is faster. `copy` (x.clone()) reads and writes the same bytes as a norm
and is the memory-bandwidth floor a norm kernel can approach.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .. import ops
from .results import write
from .timing import Bar, machine_info, measure

SHAPES = [(512, 768), (4096, 768), (1024, 4096), (8192, 1024), (4096, 1023)]
QUICK_SHAPES = [(512, 768), (4096, 768), (1024, 4096)]
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
COLUMNS = ["shape", "dtype", "layer_norm_us", "rms_norm_us", "crms_norm_us", "torch_rms_norm_us", "copy_us",
           "rms/ln", "crms/ln", "torch_rms/ln", "rms/copy", "backend"]


def candidates(shape, dtype):
    d = shape[-1]
    x = torch.randn(shape, dtype=dtype)
    xc = torch.randn(*shape[:-1], d - 1, dtype=dtype)
    w, b = torch.randn(d, dtype=dtype), torch.randn(d, dtype=dtype)
    wc = torch.randn(d - 1, dtype=dtype)
    return x, {
        "layer_norm": lambda: F.layer_norm(x, (d,), w, b, 1e-5),
        "rms_norm": lambda: ops.rms_norm(x, w, None, 1e-5),
        "crms_norm": lambda: ops.crms_norm(xc, wc, None, 1e-5),
        "torch_rms_norm": lambda: F.rms_norm(x, (d,), w, 1e-5),
        "copy": lambda: x.clone(),
    }


def run(out_dir="benchmarks", quick: bool = False, rounds: int = 30, progress: bool = True) -> tuple[list[dict], dict]:
    shapes = QUICK_SHAPES if quick else SHAPES
    machine = machine_info()
    rows = []
    bar = Bar(len(shapes) * len(DTYPES) * rounds, "bench ops", enabled=progress)
    with torch.inference_mode():
        for dname, dtype in DTYPES.items():
            for shape in shapes:
                x, cands = candidates(shape, dtype)
                s = measure(cands, rounds=rounds, tick=bar.step)
                us = {k: v.median * 1e6 for k, v in s.items()}
                rows.append({
                    "shape": "x".join(map(str, shape)), "dtype": dname,
                    "layer_norm_us": us["layer_norm"], "rms_norm_us": us["rms_norm"], "crms_norm_us": us["crms_norm"],
                    "torch_rms_norm_us": us["torch_rms_norm"], "copy_us": us["copy"],
                    "rms/ln": us["rms_norm"] / us["layer_norm"], "crms/ln": us["crms_norm"] / us["layer_norm"],
                    "torch_rms/ln": us["torch_rms_norm"] / us["layer_norm"], "rms/copy": us["rms_norm"] / us["copy"],
                    "rms_q25_us": s["rms_norm"].q25 * 1e6, "rms_q75_us": s["rms_norm"].q75 * 1e6,
                    "ln_q25_us": s["layer_norm"].q25 * 1e6, "ln_q75_us": s["layer_norm"].q75 * 1e6,
                    "backend": ops.backend_for(x),
                })
    bar.close()
    paths = write(rows, "ops", out_dir, machine, COLUMNS,
                  "Norm forward, median time (µs) and ratios (lower is better)", plot=_plot)
    return rows, paths


def _plot(rows, path, machine):
    import matplotlib.pyplot as plt

    labels = [f"{r['shape']}\n{r['dtype']}" for r in rows]
    fig, ax = plt.subplots(figsize=(max(6, len(rows) * 0.9), 4))
    xs = range(len(rows))
    width = 0.27
    for i, (key, name) in enumerate([("rms/ln", "normfold RMSNorm"), ("torch_rms/ln", "F.rms_norm"),
                                     ("crms/ln", "normfold CRMSNorm")]):
        ax.bar([x + (i - 1) * width for x in xs], [r[key] for r in rows], width, label=name)
    ax.plot([x for x in xs], [r["copy_us"] / r["layer_norm_us"] for r in rows], "k_", markersize=18,
            label="copy (bandwidth floor)")
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xticks(list(xs), labels, fontsize=7)
    ax.set_ylabel("time / F.layer_norm")
    ax.set_yscale("log")
    ax.set_title(f"norm forward vs LayerNorm ({machine.get('cpu', '')[:40]})", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
