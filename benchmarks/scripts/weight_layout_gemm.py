"""F.linear with the weight stored K-major (a transposed view of a contiguous (K, N) tensor: only strides
change, outputs bit-identical) against the usual (N, K) layout, for the Pre-RMS (K = d) and Pre-CRMS (K = d−1)
readers and the writers of ViT-S/16 and GPT-2 small; time / the usual K = d layout, process CPU time, 21 rounds
(docs/performance-breakdown.md).

    python benchmarks/scripts/weight_layout_gemm.py [threads]
"""
import torch, time, sys
import torch.nn.functional as F
torch.set_num_threads(int(sys.argv[1]))
from normfold.bench.timing import steady_allocator; steady_allocator()
for dt in (torch.float32, torch.bfloat16):
  for (M, K, N) in ((197, 384, 384), (197, 384, 1536), (197, 1536, 384), (256, 768, 2304), (256, 768, 3072), (256, 768, 768), (256, 3072, 768)):
    g = torch.Generator().manual_seed(0)
    x4 = torch.randn(1, M, K, generator=g).to(dt); w4 = torch.randn(N, K, generator=g).to(dt); b = torch.randn(N, generator=g).to(dt)
    x, w = x4[..., :-1].contiguous(), w4[:, :-1].contiguous()
    c = {"full": (x4, w4), "full K-major": (x4, w4.t().contiguous().t()), "odd": (x, w), "odd K-major": (x, w.t().contiguous().t())}
    same = torch.equal(F.linear(x, w, b), F.linear(*c["odd K-major"], b)) and torch.equal(F.linear(x4, w4, b), F.linear(*c["full K-major"], b))
    t = {k: [] for k in c}
    with torch.inference_mode():
        for r in range(21):
            names = list(c)
            for k in names[r % 4:] + names[:r % 4]:
                t0 = time.process_time(); [F.linear(*c[k], b) for _ in range(5)]; t[k].append(time.process_time() - t0)
    med = lambda v: sorted(v)[len(v) // 2]
    print(f"{str(dt)[6:]:9s} {M}x{K}->{N}: full {med(t['full'])/5*1e6:7.0f} µs; " + "  ".join(f"{k} {med([a / f for a, f in zip(t[k], t['full'])]):.3f}" for k in ("full K-major", "odd", "odd K-major")), "bitwise", same, flush=True)
