"""Python cost of one fused add + norm call at a size where the kernel's work is negligible (1x4x384 float32, one
thread, process CPU time, min / median of 15 rounds of 5000 calls): the raw kernel call, cpu.fast_add_forward, the
RMSNorm(x, residual) module call, the dispatcher ops.add_rms_norm, and x + r (docs/performance-breakdown.md §3).

    python benchmarks/scripts/fused_call_overhead.py
"""
import torch, time
torch.set_num_threads(1)
from normfold.bench.timing import steady_allocator; steady_allocator()
import normfold.ops as ops
from normfold.ops import cpu
from normfold.nn import RMSNorm
d = 384
x = torch.randn(1, 4, d); r = torch.randn(1, 4, d)
m = RMSNorm(d, weight=False)  # not zero_mean_input: no LayerNorm route, the fused kernel at any size
from normfold.ops import cpu_calls; f = cpu_calls.calls()["forward"]
def raw():
    y = torch.empty_like(x); s = torch.empty_like(x)
    f(0, x.data_ptr(), d, r.data_ptr(), d, None, 0, None, 0, y.data_ptr(), s.data_ptr(), None, 4, d, 1e-5, 0, 1)
stm = {"raw kernel call": raw, "cpu.fast_add_forward": lambda: cpu.fast_add_forward(x, r, None, None, 1e-5, False),
       "RMSNorm(x, r) (new)": lambda: m(x, r), "ops.add_rms_norm (old module path)": lambda: ops.add_rms_norm(x, r, None, None, 1e-5),
       "x + r": lambda: x + r}
with torch.inference_mode():
    res = {k: [] for k in stm}
    for _ in range(15):
        for k, fn in stm.items():
            t = time.process_time(); [fn() for _ in range(5000)]; res[k].append((time.process_time() - t) / 5000 * 1e6)
for k, v in res.items():
    print(f"{k:36s} min {min(v):.2f} µs  median {sorted(v)[7]:.2f}")
