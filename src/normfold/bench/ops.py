"""`normfold bench ops`: normfold's norms against torch's LayerNorm, RMSNorm and a plain copy.

Three passes, each a section of the table (ratios < 1 mean normfold is faster):

- forward: normfold RMSNorm (with weight) / CRMSNorm (width d−1) vs F.layer_norm with weight and
  bias, F.rms_norm, and x.clone() — a copy reads and writes the same bytes as a norm and is the
  memory-bandwidth floor a norm kernel can approach;
- backward: the gradient w.r.t. input and parameters (autograd on a kept graph) of the same ops,
  and `torch.add(dy, x, alpha=0.5)` as the floor: a backward reads dy and x and writes dx, the same
  two reads and one write (a copy moves a third less);
- add: the fused residual add + norm (`ops.add_rms_norm`, returning the sum and the normalized
  value) vs `x + r` followed by F.layer_norm, by F.rms_norm and by normfold's unfused RMSNorm.

Targets (docs/kernels-cpu-measurements.md): forward ≤ 0.6 × LayerNorm — or, where LayerNorm is
itself within 1/0.6 of a copy, ≤ 1.15 × copy (nothing beats the bandwidth floor) — and ≤ 1.5 × copy;
backward ≤ 0.8 × LayerNorm's backward; fused add + norm ≤ 0.6 × add + LayerNorm. The `target`
column says which are met for normfold's RMSNorm (`rms/…`); docs/kernels-cpu.md explains the misses.

Allocator: every candidate allocates its outputs. With glibc's default (dynamic mmap threshold,
heap trimming) some calls get freshly mapped pages and pay a page fault per 4 KiB (≈2 µs each in
the VM this was developed on, i.e. more than the kernel for MiB-sized outputs), and which candidate
pays depends on allocation order, not on its code. The suite therefore keeps freed memory mapped
(mallopt: no trimming, no mmap), the steady state of a long-running process, and records it in
the machine info; NORMFOLD_BENCH_ALLOCATOR=default leaves glibc as it is.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .. import ops
from ..ops import cpu
from .results import markdown, write
from .timing import Bar, machine_info, measure, steady_allocator

SHAPES = [(512, 768), (4096, 768), (1024, 4096), (8192, 1024), (4096, 1023)]
QUICK_SHAPES = [(512, 768), (4096, 768), (1024, 4096)]
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
QUICK_DTYPES = ("float32", "bfloat16")
PASSES = ("forward", "backward", "add")
FWD_TARGET_LN, FWD_TARGET_COPY, FWD_FLOOR_COPY = 0.6, 1.5, 1.15
BWD_TARGET_LN, ADD_TARGET_LN = 0.8, 0.6

COLUMNS = {
    "forward": ["shape", "dtype", "layer_norm_us", "rms_norm_us", "crms_norm_us", "torch_rms_norm_us", "copy_us",
                "rms/ln", "crms/ln", "torch_rms/ln", "rms/copy", "crms/copy", "target", "backend"],
    "backward": ["shape", "dtype", "layer_norm_us", "rms_norm_us", "crms_norm_us", "torch_rms_norm_us", "copy_us",
                 "floor_us", "rms/ln", "crms/ln", "torch_rms/ln", "rms/copy", "rms/floor", "ln/floor", "target",
                 "backend"],
    "add": ["shape", "dtype", "layer_norm_us", "unfused_rms_norm_us", "rms_norm_us", "crms_norm_us",
            "torch_rms_norm_us", "copy_us", "rms/ln", "rms/unfused", "crms/ln", "torch_rms/ln", "rms/copy",
            "target", "backend"],
}
TITLES = {
    "forward": "Forward: median µs and ratios (lower is better). ln = F.layer_norm with weight and bias; "
               "rms/crms = normfold with weight; copy = x.clone()",
    "backward": "Backward (grad of input and parameters): median µs and ratios. floor = torch.add(dy, x, "
                "alpha=0.5), the two reads and one write every backward makes",
    "add": "Fused residual add + norm, (x + r, norm(x + r)): median µs and ratios. ln = x + r then "
           "F.layer_norm; unfused = x + r then normfold RMSNorm; rms/crms = ops.add_rms_norm / add_crms_norm",
}


def _tensors(shape, dtype, grad=False):
    g = torch.Generator().manual_seed(0)
    d = shape[-1]

    def rnd(*s):
        return torch.randn(*s, generator=g).to(dtype).requires_grad_(grad)

    return {"x": rnd(*shape), "xc": rnd(*shape[:-1], d - 1), "r": rnd(*shape), "rc": rnd(*shape[:-1], d - 1),
            "w": rnd(d), "b": rnd(d), "wc": rnd(d - 1)}


def forward_candidates(shape, dtype):
    t, d = _tensors(shape, dtype), shape[-1]
    x, xc, w, b, wc = t["x"], t["xc"], t["w"], t["b"], t["wc"]
    return x, {
        "layer_norm": lambda: F.layer_norm(x, (d,), w, b, 1e-5),
        "rms_norm": lambda: ops.rms_norm(x, w, None, 1e-5),
        "crms_norm": lambda: ops.crms_norm(xc, wc, None, 1e-5),
        "torch_rms_norm": lambda: F.rms_norm(x, (d,), w, 1e-5),
        "copy": lambda: x.clone(),
    }


def backward_candidates(shape, dtype):
    """Each candidate runs autograd backward through a graph built once (retain_graph=True)."""
    t, d = _tensors(shape, dtype, grad=True), shape[-1]
    x, xc, w, b, wc = t["x"], t["xc"], t["w"], t["b"], t["wc"]
    dy, dyc = torch.randn_like(x), torch.randn_like(xc)
    graphs = {
        "layer_norm": (F.layer_norm(x, (d,), w, b, 1e-5), (x, w, b), dy),
        "rms_norm": (ops.rms_norm(x, w, None, 1e-5), (x, w), dy),
        "crms_norm": (ops.crms_norm(xc, wc, None, 1e-5), (xc, wc), dyc),
        "torch_rms_norm": (F.rms_norm(x, (d,), w, 1e-5), (x, w), dy),
    }
    cands = {k: (lambda y=y, i=i, g=g: torch.autograd.grad(y, i, g, retain_graph=True))
             for k, (y, i, g) in graphs.items()}
    xd = x.detach()
    cands["copy"] = lambda: xd.clone()
    cands["floor"] = lambda: torch.add(dy, xd, alpha=0.5)
    return xd, cands


def add_candidates(shape, dtype):
    t, d = _tensors(shape, dtype), shape[-1]
    x, r, xc, rc, w, b, wc = t["x"], t["r"], t["xc"], t["rc"], t["w"], t["b"], t["wc"]

    def unfused(norm):
        s = x + r
        return s, norm(s)

    return x, {
        "layer_norm": lambda: unfused(lambda s: F.layer_norm(s, (d,), w, b, 1e-5)),
        "unfused_rms_norm": lambda: unfused(lambda s: ops.rms_norm(s, w, None, 1e-5)),
        "rms_norm": lambda: ops.add_rms_norm(x, r, w, None, 1e-5),
        "crms_norm": lambda: ops.add_crms_norm(xc, rc, wc, None, 1e-5),
        "torch_rms_norm": lambda: unfused(lambda s: F.rms_norm(s, (d,), w, 1e-5)),
        "copy": lambda: x.clone(),
    }


CANDIDATES = {"forward": forward_candidates, "backward": backward_candidates, "add": add_candidates}


def _backend(x) -> str:
    name = ops.backend_for(x)
    if name == "cpu-kernel":
        name += f" ({cpu.status()['isa']})"
    return name


def _row(pas, shape, dname, x, s) -> dict:
    us = {k: v.median * 1e6 for k, v in s.items()}
    ln, rms = us["layer_norm"], us["rms_norm"]
    row = {"pass": pas, "shape": "x".join(map(str, shape)), "dtype": dname}
    row.update({f"{k}_us": v for k, v in us.items()})
    row.update({"rms/ln": rms / ln, "crms/ln": us["crms_norm"] / ln, "torch_rms/ln": us["torch_rms_norm"] / ln,
                "rms/copy": rms / us["copy"], "crms/copy": us["crms_norm"] / us["copy"]})
    if pas == "add":
        row["rms/unfused"] = rms / us["unfused_rms_norm"]
    if "floor" in us:
        row["rms/floor"], row["ln/floor"] = rms / us["floor"], ln / us["floor"]
    for k in ("layer_norm", "rms_norm", "copy"):
        row[f"{k}_q25_us"], row[f"{k}_q75_us"] = s[k].q25 * 1e6, s[k].q75 * 1e6
    row["target"] = _target(pas, row)
    row["backend"] = _backend(x)
    return row


def _target(pas: str, row: dict) -> str:
    """'met', or 'miss: ' and each target missed (module docstring)."""
    misses = []
    if pas == "forward":
        ln_near_floor = row["layer_norm_us"] <= row["copy_us"] / FWD_TARGET_LN
        if row["rms/ln"] > FWD_TARGET_LN and not (ln_near_floor and row["rms/copy"] <= FWD_FLOOR_COPY):
            misses.append(f"ln>{FWD_TARGET_LN}" + (f" and copy>{FWD_FLOOR_COPY}" if ln_near_floor else ""))
        if row["rms/copy"] > FWD_TARGET_COPY:
            misses.append(f"copy>{FWD_TARGET_COPY}")
    elif pas == "backward" and row["rms/ln"] > BWD_TARGET_LN:
        misses.append(f"ln>{BWD_TARGET_LN}")
    elif pas == "add" and row["rms/ln"] > ADD_TARGET_LN:
        misses.append(f"ln>{ADD_TARGET_LN}")
    return "miss: " + ", ".join(misses) if misses else "met"


def run(out_dir="benchmarks", quick: bool = False, rounds: int = 30, progress: bool = True,
        dtypes=None, shapes=None, passes=PASSES) -> tuple[list[dict], dict]:
    shapes = shapes or (QUICK_SHAPES if quick else SHAPES)
    dtypes = dtypes or (QUICK_DTYPES if quick else tuple(DTYPES))
    machine = machine_info()
    machine["normfold_cpu_isa"] = cpu.status()["isa"]
    machine["allocator"] = steady_allocator()
    rows = []
    bar = Bar(len(passes) * len(shapes) * len(dtypes) * rounds, "bench ops", enabled=progress)
    for pas in passes:
        for dname in dtypes:
            for shape in shapes:
                # backward needs autograd; forward and add are timed like inference
                ctx = torch.enable_grad() if pas == "backward" else torch.inference_mode()
                with ctx:
                    x, cands = CANDIDATES[pas](shape, DTYPES[dname])
                    s = measure(cands, rounds=rounds, tick=bar.step)
                rows.append(_row(pas, shape, dname, x, s))
                del cands
    bar.close()
    keys = list(dict.fromkeys(k for r in rows for k in r))  # one CSV header for all passes
    rows = [{k: r.get(k, "") for k in keys} for r in rows]
    paths = write(rows, "ops", out_dir, machine, COLUMNS["forward"], TITLES["forward"], plot=_plot)
    # One markdown section per pass (the CSV holds every row, with a `pass` column).
    paths["md"].write_text("\n".join(markdown([r for r in rows if r["pass"] == p], COLUMNS[p], TITLES[p], machine)
                                     for p in passes if any(r["pass"] == p for r in rows)))
    return rows, paths


def _plot(rows, path, machine):
    import matplotlib.pyplot as plt

    passes = [p for p in PASSES if any(r["pass"] == p for r in rows)]
    fig, axes = plt.subplots(len(passes), 1, figsize=(max(7, len(rows) / len(passes) * 0.9), 3.2 * len(passes)),
                             squeeze=False)
    for ax, pas in zip(axes[:, 0], passes):
        sub = [r for r in rows if r["pass"] == pas]
        xs = list(range(len(sub)))
        width = 0.27
        for i, (key, name) in enumerate([("rms/ln", "normfold RMSNorm"), ("torch_rms/ln", "F.rms_norm"),
                                         ("crms/ln", "normfold CRMSNorm")]):
            ax.bar([x + (i - 1) * width for x in xs], [r[key] for r in sub], width, label=name)
        ax.plot(xs, [r["copy_us"] / r["layer_norm_us"] for r in sub], "k_", markersize=18,
                label="copy (bandwidth floor)")
        ax.axhline(1.0, color="grey", lw=0.8)
        target = {"forward": FWD_TARGET_LN, "backward": BWD_TARGET_LN, "add": ADD_TARGET_LN}[pas]
        ax.axhline(target, color="red", lw=0.8, ls="--", label=f"target {target}")
        ax.set_xticks(xs, [f"{r['shape']}\n{r['dtype']}" for r in sub], fontsize=6)
        ax.set_ylabel("time / LayerNorm")
        ax.set_yscale("log")
        ax.set_title(f"{pas} ({machine.get('cpu', '')[:40]}, {machine.get('torch_threads')} threads)", fontsize=9)
        ax.legend(fontsize=6, ncol=5)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
