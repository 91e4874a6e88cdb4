"""The ceiling of the "gap captured" measure at the op level: how much of the LayerNorm → no-norm gap a norm
could capture at `bench hf`'s call sites if it ran at copy speed (read its input, write its output, nothing
else), beside what normfold's RMSNorm calls capture and what the LayerNorms cost.

Per call at the models' shapes (ViT-S/16 1×197×384, GPT-2 1×256×768; float32 / bfloat16; normfold.bench.timing:
every round times each candidate once in rotating order, medians, µs): nn.LayerNorm, the residual add, add + LayerNorm, normfold's RMSNorm module
(unfused) and RMSNorm(x, residual) (fused add + norm), x.clone() (a norm at copy speed) and x + r then .clone()
(a fused add + norm at copy speed: the sum and one more written tensor). Per forward, with the call counts
of docs/performance-breakdown.md (ViT-S: 25 LayerNorms + 12 adds absorbed → 13 unfused + 12 fused calls;
GPT-2 4L: 9 + 4 → 5 + 4):

    original = nLN·LN + nfused·add      floor (no norm) = nfused·add
    normfold = nunfused·RMS + nfused·RMS(x, r)      copy speed = nunfused·clone + nfused·(add, clone)
    captured = (original − X) / (original − floor)

    python benchmarks/scripts/norm_ceiling.py [threads] [rounds]
"""
import sys

import torch
from torch import nn

from normfold.bench import timing
from normfold.nn import RMSNorm

torch.set_num_threads(int(sys.argv[1]) if len(sys.argv) > 1 else 2)
ROUNDS = int(sys.argv[2]) if len(sys.argv) > 2 else 31
torch.manual_seed(0)
# (name, shape, LayerNorm calls, unfused norm calls, fused add+norm calls) of the converted model
SITES = (("ViT-S/16", (1, 197, 384), 25, 13, 12), ("GPT-2 4L", (1, 256, 768), 9, 5, 4))
STMTS = {"LN": lambda g: g["ln"](g["x"]), "add": lambda g: g["x"] + g["r"], "add+LN": lambda g: g["ln"](g["x"] + g["r"]),
         "RMS": lambda g: g["rms"](g["x"]), "RMS(x,r)": lambda g: g["rms"](g["x"], g["r"]),
         "clone": lambda g: g["x"].clone(), "add,clone": lambda g: (g["x"] + g["r"]).clone()}

print(f"threads {torch.get_num_threads()}, {ROUNDS} rounds, µs per call (medians)")
rows = []
for dt in (torch.float32, torch.bfloat16):
    for name, shape, n_ln, n_unf, n_fused in SITES:
        d = shape[-1]
        ln = nn.LayerNorm(d, dtype=dt).eval()
        rms = RMSNorm.from_layernorm(ln).eval()
        x = torch.randn(shape, dtype=dt)
        x = x - x.mean(-1, keepdim=True)
        r = torch.randn(shape, dtype=dt)
        r = r - r.mean(-1, keepdim=True)
        g = dict(x=x, r=r, ln=ln, rms=rms)
        with torch.inference_mode():
            stats = timing.measure({k: (lambda f=f: f(g)) for k, f in STMTS.items()}, rounds=ROUNDS)
        m = {k: st.median * 1e6 for k, st in stats.items()}
        orig = n_ln * m["LN"] + n_fused * m["add"]
        floor = n_fused * m["add"]
        conv = n_unf * m["RMS"] + n_fused * m["RMS(x,r)"]
        copy = n_unf * m["clone"] + n_fused * m["add,clone"]
        cap = lambda v: (orig - v) / (orig - floor)
        rows.append((name, str(dt)[6:], m, orig, floor, conv, copy, cap(conv), cap(copy)))
        print(f"{name:9s} {str(dt)[6:]:9s} " + " ".join(f"{k}={v:.1f}" for k, v in m.items()), flush=True)

print("\n| setting | dtype | original µs/forward | floor | normfold | copy speed | captured: normfold | captured: copy speed |")
print("| --- | --- | --- | --- | --- | --- | --- | --- |")
for name, dt, m, orig, floor, conv, copy, c1, c2 in rows:
    print(f"| {name} | {dt} | {orig:.0f} | {floor:.0f} | {conv:.0f} | {copy:.0f} | {c1:.2f} | {c2:.2f} |")
for dt in ("float32", "bfloat16"):
    sel = [r for r in rows if r[1] == dt]
    print(f"mean {dt}: captured normfold {sum(r[7] for r in sel) / len(sel):.2f}, "
          f"copy speed {sum(r[8] for r in sel) / len(sel):.2f}")
