"""The pair a cross-block hand-off replaces, through the real code path (normfold.fastpath.handoff): a block's
last add + the next norm's call, one thread, CPU time, interleaved. off: s = delta + residual; norm(s).
on: s = handoff.add(block, delta, residual); norm(s) (the stashed result). mod: norm(delta, residual), the
within-block fused call (the fused op without the hand-off's bookkeeping). Run: PYTHONPATH=src python THIS."""
import statistics, time, torch
from torch import nn
from normfold.nn import RMSNorm, CRMSNorm
from normfold.fastpath import handoff
torch.set_num_threads(1)
for rows, d in ((197, 384), (256, 768), (1024, 768)):
    for dtype in (torch.float32, torch.bfloat16):
        for cls, w in ((RMSNorm, d), (CRMSNorm, d - 1)):
            ln = nn.LayerNorm(w); nn.init.normal_(ln.weight); nn.init.normal_(ln.bias)
            norm = RMSNorm.from_layernorm(ln).to(dtype) if cls is RMSNorm else CRMSNorm(w, bias=True).to(dtype)
            owner = nn.Module(); owner.norm = norm
            block = nn.Module()
            object.__setattr__(block, handoff._LINK, handoff._Link(owner, "norm", ()))
            object.__setattr__(norm, handoff._STASH, handoff._Stash())
            delta, res = torch.randn(1, rows, w, dtype=dtype), torch.randn(1, rows, w, dtype=dtype)
            def off():
                s = delta + res; return norm(s)
            def on():
                s = handoff.add(block, delta, res); return norm(s)
            def mod():
                return norm(delta, res)[1]
            t = {"off": [], "on": [], "mod": []}
            with torch.inference_mode():
                torch.testing.assert_close(on(), off(), rtol=1e-2, atol=1e-2)
                for r in range(41):
                    fs = [("off", off), ("on", on), ("mod", mod)]
                    for k, f in fs[r % 3:] + fs[:r % 3]:
                        t0 = time.thread_time()
                        for _ in range(50): f()
                        t[k].append((time.thread_time() - t0) / 50)
            st = norm.__dict__[handoff._STASH]
            ratio = statistics.median(a / b for a, b in zip(t["on"], t["off"]))
            print(f"{rows}x{w} {str(dtype)[6:]} {cls.__name__}: off {1e6 * statistics.median(t['off']):.1f} us, "
                  f"on {1e6 * statistics.median(t['on']):.1f} us, on/off {ratio:.3f}, fused module call norm(d, r) {1e6 * statistics.median(t['mod']):.1f} us (hits {st.hits}, misses {st.misses})",
                  flush=True)
