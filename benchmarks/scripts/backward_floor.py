"""The float32 backward against its memory floor: RMSNorm's and LayerNorm's autograd backward vs
`torch.add(dy, x, alpha=0.5)` (the same two reads and one write) and `x.clone()`.

    OMP_NUM_THREADS=1 python benchmarks/scripts/backward_floor.py [--rounds 40]
    NORMFOLD_CPU_ISA=avx2 OMP_NUM_THREADS=2 python benchmarks/scripts/backward_floor.py

Interleaved rounds, medians in µs (docs/kernels-cpu.md, "Issue 12 targets on the Zen 5 EPYC").
"""

import argparse

import torch
import torch.nn.functional as F

from normfold import ops
from normfold.bench.timing import measure, steady_allocator

SHAPES = [(512, 768), (4096, 768), (8192, 1024), (4096, 1023)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=40)
    args = ap.parse_args()
    steady_allocator()
    print(f"threads {torch.get_num_threads()}, backend {ops.info()['cpu'].get('isa')}")
    print("| shape | layer_norm | rms_norm | add (2 reads, 1 write) | copy | rms/ln | rms/add | ln/add |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for rows, d in SHAPES:
        x = torch.randn(rows, d, requires_grad=True)
        w, b = torch.randn(d, requires_grad=True), torch.randn(d, requires_grad=True)
        dy, xd = torch.randn(rows, d), x.detach()
        y, yl = ops.rms_norm(x, w, None, 1e-5), F.layer_norm(x, (d,), w, b, 1e-5)
        s = measure({"ln": lambda: torch.autograd.grad(yl, (x, w, b), dy, retain_graph=True),
                     "rms": lambda: torch.autograd.grad(y, (x, w), dy, retain_graph=True),
                     "add": lambda: torch.add(dy, xd, alpha=0.5), "copy": lambda: xd.clone()},
                    rounds=args.rounds)
        m = {k: v.median * 1e6 for k, v in s.items()}
        print(f"| {rows}x{d} | {m['ln']:.0f} | {m['rms']:.0f} | {m['add']:.0f} | {m['copy']:.0f} | "
              f"{m['rms'] / m['ln']:.2f} | {m['rms'] / m['add']:.2f} | {m['ln'] / m['add']:.2f} |")


if __name__ == "__main__":
    main()
