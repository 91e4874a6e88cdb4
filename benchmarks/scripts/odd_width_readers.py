"""Pre-CRMS readers on the d−1 stream (issue 24 item 4): does an aligned leading dimension help the GEMM?

For each reader shape (rows × (d−1) → out) it times F.linear with
  odd:     x (rows, d−1) contiguous, W (out, d−1) contiguous (what a loaded Pre-CRMS model runs),
  strided: x and W as (d−1)-wide views into d-wide buffers (lda = ldb = d; only strides change),
  padded:  x (rows, d) with a zero last column, W (out, d) with a zero last column (a K = d GEMM),
  pad+padded: `padded` with x padded on each call (F.pad of the contiguous (rows, d−1) x: what a reader
           that owns a padded weight but gets the norm's d−1 output would run),
  full:    the Pre-RMS reader, K = d (the reference the others are divided by),
in interleaved rounds (process CPU time, one thread unless THREADS is set), medians of per-round ratios,
and says whether `strided` / `padded` outputs equal `odd` bit for bit.

    [THREADS=1] python benchmarks/scripts/odd_width_readers.py [rounds]
"""
import os
import sys
import time

import torch
import torch.nn.functional as F

torch.set_num_threads(int(os.environ.get("THREADS", "1")))
from normfold.bench.timing import steady_allocator  # noqa: E402

steady_allocator()
rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 15
SHAPES = [("ViT-S q/k/v", 197, 384, 384), ("ViT-S fc1", 197, 384, 1536),
          ("GPT-2 c_attn", 256, 768, 2304), ("GPT-2 c_fc", 256, 768, 3072)]
print(f"{torch.get_num_threads()} thread(s), process CPU time, {rounds} rounds; time / full (K = d)")
for dt in (torch.float32, torch.bfloat16):
    for name, rows, d, out in SHAPES:
        g = torch.Generator().manual_seed(0)
        xb = torch.zeros(1, rows, d, dtype=dt); xb[..., :-1] = torch.randn(1, rows, d - 1, generator=g).to(dt)
        wb = torch.zeros(out, d, dtype=dt); wb[:, :-1] = torch.randn(out, d - 1, generator=g).to(dt)
        b = torch.randn(out, generator=g).to(dt)
        x_odd, w_odd = xb[..., :-1].contiguous(), wb[:, :-1].contiguous()
        x_str, w_str = xb[..., :-1], wb[:, :-1]
        cands = {"full": (xb, wb), "odd": (x_odd, w_odd), "strided": (x_str, w_str), "padded": (xb, wb),
                 "pad+padded": (x_odd, wb)}
        ref = F.linear(x_odd, w_odd, b)
        same = {k: torch.equal(F.linear(*cands[k], b), ref) for k in ("strided", "padded")}
        t = {k: [] for k in cands}
        inner = 10 if dt is torch.float32 else 20
        with torch.inference_mode():
            for r in range(rounds):
                names = list(cands)
                for k in names[r % len(names):] + names[:r % len(names)]:
                    x, w = cands[k]
                    t0 = time.process_time()
                    if k == "pad+padded":
                        for _ in range(inner):
                            F.linear(F.pad(x, (0, 1)), w, b)
                    else:
                        for _ in range(inner):
                            F.linear(x, w, b)
                    t[k].append(time.process_time() - t0)
        med = lambda v: sorted(v)[len(v) // 2]  # noqa: E731
        ratio = {k: med([a / f for a, f in zip(t[k], t["full"])]) for k in ("odd", "strided", "padded", "pad+padded")}
        print(f"{str(dt)[6:]:9s} {name:13s} {rows}x{d - 1}->{out}: full {med(t['full']) / inner * 1e6:8.1f} µs; "
              + "  ".join(f"{k} {v:.3f}" for k, v in ratio.items())
              + f"  | bitwise = odd: strided {same['strided']}, padded {same['padded']}", flush=True)
