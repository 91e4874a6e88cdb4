"""Forward and forward+backward of one norm call at the training benchmark's shape (8 × 256 × 192, float32,
γ and β trainable): LayerNorm vs normfold's RMSNorm, and LayerNorm(x + r) vs the fused add + RMSNorm.
Thread CPU, median of N calls (default 300), interleaved; the saving a Pre-RMS training step gets from
its 13 norms (docs/performance-breakdown.md, "Training step").

    OMP_NUM_THREADS=1 python benchmarks/scripts/train_norm_calls.py [N]
"""

from __future__ import annotations

import os
import statistics
import sys
import time

import torch

from normfold import ops

torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
g = torch.Generator().manual_seed(0)
x = torch.randn(8, 256, 192, generator=g).requires_grad_()
r = torch.randn(8, 256, 192, generator=g).requires_grad_()
w = torch.randn(192, generator=g).requires_grad_()
b = torch.randn(192, generator=g).requires_grad_()
dy = torch.randn(8, 256, 192, generator=g)
calls = {
    "LayerNorm": lambda: torch.nn.functional.layer_norm(x, (192,), w, b, 1e-5),
    "RMSNorm": lambda: ops.rms_norm(x, w, b, 1e-5),
    "LayerNorm(x + r)": lambda: torch.nn.functional.layer_norm(x + r, (192,), w, b, 1e-5),
    "add + RMSNorm (fused)": lambda: ops.add_rms_norm(x, r, w, b, 1e-5)[1],
}
n = int(sys.argv[1]) if len(sys.argv) > 1 else 300
res = {k: ([], []) for k in calls}
for k, f in calls.items():
    for _ in range(10):
        f().backward(dy)
for _ in range(n):
    for k, f in calls.items():
        c = time.thread_time()
        f()
        t1 = time.thread_time()
        f().backward(dy)
        res[k][0].append(t1 - c)
        res[k][1].append(time.thread_time() - t1)
print(f"{torch.get_num_threads()} thread(s), load average {os.getloadavg()}")
print("| call | forward µs | forward + backward µs |")
print("| --- | --- | --- |")
for k, (f, fb) in res.items():
    print(f"| {k} | {statistics.median(f) * 1e6:.0f} | {statistics.median(fb) * 1e6:.0f} |")
