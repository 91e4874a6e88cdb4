"""Norm call cost against nn.LayerNorm (issue 24: "the per-call cost of the norm modules inside a model").

Two parts:
- isolated: nn.LayerNorm, normfold RMSNorm (from_layernorm: the LayerNorm route at decode sizes) and
  CRMSNorm at GPT-2 small's shapes (1x256x768, 1x1x768), float32 / bfloat16, torch.utils.benchmark,
  5 interleaved rounds, medians; and the residual add + norm pair against the fused call;
- in the model (`inmodel`): `normfold bench hf`'s hook timings (bench.model.norm_times, 15 repeats) for
  GPT-2 4L x 256 as normfold.load gives it (fast=True: fused add + norm, so the hooks around the
  converted norms also time the residual add the LayerNorm model does outside its norms) and with
  fast=False (plain norms).

- decode: the fixed cost per call at one token (1x1x768), timeit over 2000 calls, 11 interleaved
  rounds, min and median (the min is what a shared machine's load disturbs least).

    python benchmarks/scripts/norm_call_cost.py [inmodel | decode]
"""

import sys
import tempfile

import torch
import torch.utils.benchmark as tb
from torch import nn

from normfold.nn import CRMSNorm, RMSNorm


def isolated(rounds: int = 5) -> None:
    torch.manual_seed(0)
    d = 768
    for dt in (torch.float32, torch.bfloat16):
        for shape in ((1, 256, d), (1, 1, d)):
            ln = nn.LayerNorm(d, dtype=dt).eval()
            rms = RMSNorm.from_layernorm(ln).eval()
            crms = CRMSNorm(d - 1, dtype=dt).eval()
            x = torch.randn(shape, dtype=dt)
            x = x - x.mean(-1, keepdim=True)
            r = torch.randn(shape, dtype=dt)
            r = r - r.mean(-1, keepdim=True)
            xc = x[..., :-1].contiguous()
            stmts = {"LN": ("y = ln(x)", x), "RMS": ("y = rms(x)", x), "CRMS": ("y = crms(xc)", x),
                     "add+LN": ("s = x + r; y = ln(s)", x), "RMS(x, residual)": ("s, y = rms(x, r)", x)}
            t = {k: [] for k in stmts}
            with torch.inference_mode():
                for _ in range(rounds):
                    for k, (st, _) in stmts.items():
                        g = dict(x=x, r=r, xc=xc, ln=ln, rms=rms, crms=crms)
                        t[k].append(tb.Timer(st, globals=g).blocked_autorange(min_run_time=0.2).median)
            med = {k: sorted(v)[len(v) // 2] * 1e6 for k, v in t.items()}
            print(f"{str(dt)[6:]:9s} {str(shape):14s} " + "  ".join(f"{k} {v:.2f}us" for k, v in med.items())
                  + f" | RMS/LN {med['RMS'] / med['LN']:.3f} CRMS/LN {med['CRMS'] / med['LN']:.3f}"
                  + f" fused/(add+LN) {med['RMS(x, residual)'] / med['add+LN']:.3f}")


def inmodel(repeats: int = 15) -> None:
    from normfold.bench import hf
    from normfold.bench.model import median_ms, norm_times

    case = hf.GPT2_4L
    for dt in (torch.float32, torch.bfloat16):
        with tempfile.TemporaryDirectory() as work:
            c = hf.candidates(case, dt, work, 0, variants=("rmsnorm", "rmsnorm-plain"))
            x = case.inputs(c["original"], dt, 0)
            runs = {k: (m, (lambda m=m: m(**x))) for k, m in c.items()}
            with torch.inference_mode():
                per = norm_times(runs, repeats=repeats)
            ln = median_ms(per["original"])
            print(str(dt)[6:], "ms per forward:", {k: round(median_ms(v), 3) for k, v in per.items()},
                  "ratio to LN:", {k: round(median_ms(v) / ln, 3) for k, v in per.items()})


def decode(rounds: int = 11, number: int = 2000) -> None:
    import timeit

    d = 768
    for dt in (torch.float32, torch.bfloat16):
        ln = nn.LayerNorm(d, dtype=dt).eval()
        rms = RMSNorm.from_layernorm(ln).eval()
        crms = CRMSNorm(d - 1, dtype=dt).eval()
        x = torch.randn(1, 1, d, dtype=dt)
        x -= x.mean(-1, keepdim=True)
        xc, r = x[..., :-1].contiguous(), x.clone()
        w, b = ln.weight, ln.bias
        c = {"nn.LayerNorm": lambda: ln(x), "RMSNorm": lambda: rms(x), "CRMSNorm": lambda: crms(xc),
             "torch.layer_norm": lambda: torch.layer_norm(x, (d,), w, b, 1e-5), "add+LN": lambda: ln(x + r),
             "RMS(x, residual)": lambda: rms(x, r)}
        res = {k: [] for k in c}
        with torch.inference_mode():
            for _ in range(rounds):
                for k, f in c.items():
                    res[k].append(timeit.timeit(f, number=number) / number * 1e6)
        cells = (f"{k} min {min(v):.2f} med {sorted(v)[rounds // 2]:.2f} us" for k, v in res.items())
        print(str(dt)[6:], "  ".join(cells))


if __name__ == "__main__":
    {"inmodel": inmodel, "decode": decode}.get(sys.argv[1] if sys.argv[1:] else "", isolated)()
