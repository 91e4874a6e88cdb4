"""F.linear with a weight (and bias) 64-byte aligned vs 8 bytes off (where transformers' from_pretrained
leaves a safetensors checkpoint's tensors), at ViT-S/16 and GPT-2 small shapes; interleaved rounds, process
CPU time, median of per-round ratios; and whether the outputs are equal bit for bit (io.realign's case,
docs/performance-breakdown.md).

    python benchmarks/scripts/weight_alignment_gemm.py [threads]
"""
import torch, time, sys
import torch.nn.functional as F
torch.set_num_threads(int(sys.argv[1]) if len(sys.argv) > 1 else 1)
from normfold.bench.timing import steady_allocator; steady_allocator()
torch.manual_seed(0)
def misaligned(t, off_bytes=8):
    n = t.numel(); es = t.element_size()
    buf = torch.empty(n + 64 // es, dtype=t.dtype)
    k = off_bytes // es
    v = buf[k:k + n].view(t.shape); v.copy_(t)
    assert v.data_ptr() % 64 == off_bytes
    return v
for dt in (torch.float32, torch.bfloat16):
    for (M, K, N) in ((197, 384, 384), (197, 384, 1536), (197, 1536, 384), (256, 768, 768), (256, 768, 3072), (256, 3072, 768)):
        x = torch.randn(1, M, K, dtype=dt); w = torch.randn(N, K, dtype=dt); b = torch.randn(N, dtype=dt)
        wm, bm = misaligned(w), misaligned(b)
        same = torch.equal(F.linear(x, w, b), F.linear(x, wm, bm))
        res = {"al": [], "mis": []}
        with torch.inference_mode():
            for r in range(15):
                for k, (ww, bb) in (("al", (w, b)), ("mis", (wm, bm)))[::(1 if r % 2 else -1)]:
                    t = time.process_time(); [F.linear(x, ww, bb) for _ in range(20)]; res[k].append((time.process_time() - t) / 20)
        ratio = sorted(m / a for m, a in zip(res["mis"], res["al"]))[7]
        print(f"{str(dt)[6:]:9s} {M}x{K}x{N}: aligned {sorted(res['al'])[7]*1e6:8.1f} µs, misaligned(8B) {sorted(res['mis'])[7]*1e6:8.1f} µs, paired ratio {ratio:.3f}, bitwise equal {same}", flush=True)
