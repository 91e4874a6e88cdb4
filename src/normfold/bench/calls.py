"""`normfold bench calls`: the per-call time of the modules a converted model runs, at decode sizes.

Inside a model a norm is called on one row per step when decoding; there the call path (module →
dispatch → kernel) costs more than the arithmetic. This suite times `normfold.nn.RMSNorm` as a
conversion builds it (from a LayerNorm: zero-mean input, weight kept, bias folded) against the
`nn.LayerNorm` it replaces, and `normfold.nn.CRMSNorm`, per call, under inference mode, interleaved.
Target: RMSNorm ≤ LayerNorm at (1, d) and (16, d), d ∈ {768, 4096}, every dtype.
"""

from __future__ import annotations

import torch

from .results import write
from .timing import Bar, machine_info, measure, steady_allocator

SHAPES = [(1, 768), (16, 768), (1, 4096), (16, 4096), (128, 384)]
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
COLUMNS = ["shape", "dtype", "layernorm_us", "rmsnorm_us", "crmsnorm_us", "rms/ln", "crms/ln", "route", "target"]


def run(out_dir="benchmarks", rounds: int = 30, progress: bool = True, dtypes=None, shapes=None):
    from ..nn import CRMSNorm, RMSNorm, norms
    from ..ops import cpu

    shapes = shapes or SHAPES
    dtypes = dtypes or tuple(DTYPES)
    machine = machine_info()
    machine["allocator"] = steady_allocator()
    rows = []
    bar = Bar(len(shapes) * len(dtypes) * rounds, "bench calls", enabled=progress)
    for dname in dtypes:
        dt = DTYPES[dname]
        for shape in shapes:
            d = shape[-1]
            ln = torch.nn.LayerNorm(d)
            with torch.no_grad():
                ln.weight.normal_()
                ln.bias.normal_()
            ln = ln.to(dt)
            rms = RMSNorm.from_layernorm(ln, keep_bias=False)
            crms = CRMSNorm(d - 1).to(dt)
            x = torch.randn(shape, dtype=torch.float64)
            x = (x - x.mean(-1, keepdim=True)).to(dt)
            xc = x[..., :-1].contiguous()
            cands = {"layernorm": lambda: ln(x), "rmsnorm": lambda: rms(x), "crmsnorm": lambda: crms(xc)}
            with torch.inference_mode():
                s = measure(cands, rounds=rounds, min_time=5e-3, tick=bar.step)
            us = {k: v.median * 1e6 for k, v in s.items()}
            route = ("layer_norm" if x.numel() <= norms.LN_ROUTE_MAX_NUMEL or cpu.library() is None
                     else f"kernel ({cpu.status()['isa']})")
            rows.append({"shape": "x".join(map(str, shape)), "dtype": dname, "layernorm_us": us["layernorm"],
                         "rmsnorm_us": us["rmsnorm"], "crmsnorm_us": us["crmsnorm"],
                         "rms/ln": us["rmsnorm"] / us["layernorm"], "crms/ln": us["crmsnorm"] / us["layernorm"],
                         "route": route, "target": "met" if us["rmsnorm"] <= us["layernorm"] else "miss",
                         "layernorm_q25_us": s["layernorm"].q25 * 1e6, "layernorm_q75_us": s["layernorm"].q75 * 1e6,
                         "rmsnorm_q25_us": s["rmsnorm"].q25 * 1e6, "rmsnorm_q75_us": s["rmsnorm"].q75 * 1e6})
    bar.close()
    paths = write(rows, "calls", out_dir, machine, COLUMNS,
                  "Per-call time of the modules (median µs, inference mode; rms/ln < 1: RMSNorm is cheaper)")
    return rows, paths
