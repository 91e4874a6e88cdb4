"""Per-call time of normfold.nn.RMSNorm (as a conversion builds it) vs nn.LayerNorm at mid-sized
inputs (16-64 K elements: one prompt of a small model), every dtype; the sizes where the kernel's
thread count changes with NF_GRAIN (docs/kernels-cpu.md, "Threads for mid-sized inputs").

    python benchmarks/scripts/midsize_norm_calls.py            # all threads torch uses
    OMP_NUM_THREADS=1 python benchmarks/scripts/midsize_norm_calls.py
"""

import torch

from normfold.bench.timing import measure, steady_allocator
from normfold.nn import RMSNorm

SHAPES = ((1, 128, 192), (1, 64, 768), (1, 16, 2048))


def main() -> None:
    steady_allocator()
    print(f"threads {torch.get_num_threads()}")
    print("| dtype | shape | LayerNorm µs | RMSNorm µs | ratio |")
    print("| --- | --- | --- | --- | --- |")
    for dt in (torch.float32, torch.bfloat16, torch.float16):
        for shape in SHAPES:
            ln = torch.nn.LayerNorm(shape[-1]).to(dt)
            rms = RMSNorm.from_layernorm(ln)
            x = torch.randn(*shape).to(dt)
            x = x - x.mean(-1, keepdim=True)  # the zero-mean stream a converted norm reads
            with torch.inference_mode():
                s = measure({"ln": lambda: ln(x), "rms": lambda: rms(x)}, rounds=30, min_time=5e-3)
            ln_us, rms_us = s["ln"].median * 1e6, s["rms"].median * 1e6
            print(f"| {str(dt)[6:]} | {tuple(shape)} | {ln_us:.2f} | {rms_us:.2f} | {rms_us / ln_us:.2f} |")


if __name__ == "__main__":
    main()
