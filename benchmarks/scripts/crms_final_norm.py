"""The decompressed final norm of a Pre-CRMS model (StreamCRMSNorm(decompress=True) with γ, β: GPT-2's ln_f,
ViT's final layernorm), per call, three forms (issue 24 item 4):

  general  the module's general path: kernel n, widened, −Σn, cat, ·γ, +β, narrowed (seven passes)
  buffer   one d-wide buffer receiving n, −Σn, γ and β in place (bit-identical to general; what
           StreamCRMSNorm runs now: the module's own call)
  kernel   tried, not kept: γ, β of the kept coordinates applied inside the kernel call (cpu.forward with the
           rows' 1/rms), the last coordinate −(Σx)·(1/rms)·γ_d + β_d with Σx summed in float64

1 thread, thread CPU time, interleaved rounds, medians [q25, q75] in µs; loaded machine.

    OMP_NUM_THREADS=1 python benchmarks/scripts/crms_final_norm.py [rounds]
"""

import statistics as st
import sys
import time

import torch

from normfold import ops
from normfold.compress import StreamCRMSNorm


def general(norm, x):
    n = ops.crms_norm(x, None, None, norm.eps)
    xf = n.to(torch.float32)
    n = torch.cat([xf, -xf.sum(dim=-1, keepdim=True)], dim=-1)
    return (n * norm.weight.to(n.dtype) + norm.bias.to(n.dtype)).to(x.dtype)


def buffer(norm, x):
    n = ops.cpu.fast_forward(x, None, None, norm.eps, True)
    out = torch.empty(x.shape[:-1] + (norm.width,), dtype=torch.float32)
    head = out[..., :-1]
    head.copy_(n)
    torch.sum(head, dim=-1, keepdim=True, out=out[..., -1:]).neg_()
    out.mul_(norm.weight.float())
    out.add_(norm.bias.float())
    return out.to(x.dtype)


def kernel(norm, x):
    w, b = norm.weight, norm.bias
    y, rstd = ops.cpu.forward(x, w[:-1], b[:-1], norm.eps, True, True)
    last = x.sum(dim=-1, keepdim=True, dtype=torch.float64).neg_().mul_(rstd.unsqueeze(-1))
    last.mul_(w[-1].double()).add_(b[-1].double())
    return torch.cat([y, last.to(x.dtype)], dim=-1)


def main():
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 15
    torch.set_num_threads(1)
    for dtype in (torch.float32, torch.bfloat16):
        for rows, d in ((197, 384), (256, 768)):
            norm = StreamCRMSNorm(d, weight=True, bias=True, decompress=True, dtype=dtype)
            with torch.no_grad():
                norm.weight.normal_()
                norm.bias.normal_()
            x = torch.randn(1, rows, d - 1).to(dtype)
            cands = {"general": lambda: general(norm, x), "buffer": lambda: norm(x), "kernel": lambda: kernel(norm, x)}
            res = {k: [] for k in cands}
            with torch.inference_mode():
                names = list(cands)
                for r in range(rounds):
                    for k in names[r % 3:] + names[:r % 3]:
                        f = cands[k]
                        f()
                        t = time.thread_time()
                        for _ in range(50):
                            f()
                        res[k].append((time.thread_time() - t) / 50 * 1e6)
            line = ", ".join(f"{k} {st.median(v):.1f} [{st.quantiles(v, n=4)[0]:.1f}, {st.quantiles(v, n=4)[2]:.1f}]"
                             for k, v in res.items())
            print(f"{str(dtype)[6:]} {rows}x{d - 1}: {line}")


if __name__ == "__main__":
    main()
