"""`normfold bench epilogue`: the norm folded into the next matrix multiply.

A converted model's stream norm is read only by linear layers, so Linear(RMSNorm(x)) can be
computed as (x·Wᵀ)·s(x) + b (`normfold.nn.NormLinear`): the row scale s comes from one read of x
and the normalized tensor is never written. This suite times, per shape and dtype:

- `linear`: F.linear(x, W, b) alone, the no-norm floor;
- `norm+linear`: normfold's RMSNorm kernel, then F.linear (what a converted model runs);
- `epilogue`: NormLinear: row scale, F.linear(x, W), then addcmul(b, out, s);
- with --compile, both forms under torch.compile (inductor fuses the scale with what it can).

`gap captured` = (norm+linear − epilogue) / (norm+linear − linear): 1 means the norm became free,
negative means the epilogue form is slower. Shapes: GPT-2 small's stream (768) into its QKV (2304)
and MLP (3072) projections, at 1 row (decode), 128 and 2048 rows.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .results import write
from .timing import Bar, machine_info, measure, steady_allocator

SHAPES = [(1, 768, 2304), (128, 768, 2304), (128, 768, 3072), (2048, 768, 2304), (2048, 768, 3072)]
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
COLUMNS = ["rows", "d", "out", "dtype", "mode", "linear_us", "norm+linear_us", "epilogue_us", "epilogue/separate",
           "gap captured"]


def _candidates(x, linear, norm, fold, compile_: bool):
    def separate():
        return F.linear(norm(x), linear.weight, linear.bias)

    def epilogue():
        return fold(x)

    def floor():
        return F.linear(x, linear.weight, linear.bias)

    if compile_:
        separate, epilogue = torch.compile(separate, dynamic=False), torch.compile(epilogue, dynamic=False)
    return {"linear": floor, "norm+linear": separate, "epilogue": epilogue}


def run(out_dir="benchmarks", rounds: int = 30, progress: bool = True, dtypes=None, compile_: bool = False,
        shapes=None):
    from ..nn import NormLinear, RMSNorm

    shapes = shapes or SHAPES
    dtypes = dtypes or tuple(DTYPES)
    modes = ["eager", "compiled"] if compile_ else ["eager"]
    machine = machine_info()
    machine["allocator"] = steady_allocator()
    rows = []
    bar = Bar(len(shapes) * len(dtypes) * len(modes) * rounds, "bench epilogue", enabled=progress)
    for dname in dtypes:
        dt = DTYPES[dname]
        for n_rows, d, n_out in shapes:
            torch.manual_seed(0)
            linear = torch.nn.Linear(d, n_out).to(dt)
            norm = RMSNorm(d, weight=False).to(dt)  # a converted model's norm: affine folded away
            fold = NormLinear.fold(norm, linear)
            x = torch.randn(n_rows, d, dtype=torch.float64)
            x = (x - x.mean(-1, keepdim=True)).to(dt)
            for mode in modes:
                cands = _candidates(x, linear, norm, fold, mode == "compiled")
                with torch.inference_mode():
                    s = measure(cands, rounds=rounds, min_time=5e-3, tick=bar.step)
                us = {k: v.median * 1e6 for k, v in s.items()}
                gap = us["norm+linear"] - us["linear"]
                rows.append({
                    "rows": n_rows, "d": d, "out": n_out, "dtype": dname, "mode": mode,
                    "linear_us": us["linear"], "norm+linear_us": us["norm+linear"], "epilogue_us": us["epilogue"],
                    "epilogue/separate": us["epilogue"] / us["norm+linear"],
                    "gap captured": (us["norm+linear"] - us["epilogue"]) / gap if gap > 0 else float("nan"),
                    **{f"{k}_q25_us": v.q25 * 1e6 for k, v in s.items()},
                    **{f"{k}_q75_us": v.q75 * 1e6 for k, v in s.items()}})
    bar.close()
    paths = write(rows, "epilogue", out_dir, machine, COLUMNS,
                  "Norm folded into the next GEMM: (x·Wᵀ)·s + b vs Linear(RMSNorm(x)) (median µs; "
                  "epilogue/separate < 1: the fold is faster)")
    return rows, paths
