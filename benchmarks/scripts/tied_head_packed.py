"""nn.TiedHead's packed form (one GEMM over [E' | μ | μ | 0…]) against the formula and the stock tied matmul.

    python benchmarks/scripts/tied_head_packed.py TOKENS ROUNDS DTYPE PADS     # e.g. 256 31 bfloat16 2,8,32

GPT-2 small's head (vocab 50,257, d 768), batch 1, inference mode, interleaved rounds in rotating order;
medians and quartiles as ratios to the stock tied nn.Linear. Results: docs/verification.md#tied-embeddings-stay-tied.
"""
import sys, time, torch
import torch.nn.functional as F
from torch import nn
from normfold.nn import TiedHead
torch.manual_seed(0)
V, d = 50257, 768
M, rounds = int(sys.argv[1]), int(sys.argv[2]); dt = getattr(torch, sys.argv[3])
pads = [int(p) for p in sys.argv[4].split(",")]
E = (torch.randn(V, d) * 0.02).to(dt); mu = (torch.randn(V) * 0.01).to(dt)
fs = {}
plain_w = E.clone()
fs["stock tied Linear"] = lambda y: F.linear(y, plain_w)
t0 = nn.Embedding(V, d, dtype=dt); t0.weight.data.copy_(E); h0 = TiedHead(t0, mu)
fs["TiedHead formula"] = h0
for p in pads:
    t = nn.Embedding(V, d, dtype=dt); t.weight.data.copy_(E); h = TiedHead(t, mu); assert h.pack(p)
    fs[f"TiedHead packed p={p}"] = h
y = torch.randn(1, M, d).to(dt)
times = {k: [] for k in fs}
with torch.inference_mode():
    for f in fs.values(): f(y); f(y)
    for r in range(rounds):
        ks = list(fs); ks = ks[r % len(ks):] + ks[:r % len(ks)]
        for k in ks:
            t1 = time.perf_counter(); fs[k](y); times[k].append(time.perf_counter() - t1)
base = sorted(times["stock tied Linear"])[rounds // 2]
print(f"{dt} M={M} rounds={rounds}")
for k, v in times.items():
    v = sorted(v); med = v[rounds // 2]
    print(f"  {k:24s} {med*1e3:8.2f} ms  x{med/base:.3f}  [q25 {v[rounds//4]/base:.3f}, q75 {v[3*rounds//4]/base:.3f}]")
