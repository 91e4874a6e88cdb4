"""Where converted models' time goes (docs/performance-breakdown.md): paired whole-model timing
of `normfold bench hf`'s models with one piece swapped at a time.

Candidates (all built as `bench hf` builds them: convert → save → normfold.load, inference_mode):
  original, aa (a copy of it: what this machine invents), no-norm (LayerNorms → Identity: the floor),
  rms (normfold.load default: fused blocks, hand-off links, kernels),
  rms-plain (normfold.load(fast=False): transformers' forwards, unfused norms),
  rms-ln (diagnostic, not exact: every RMSNorm call replaced by aten layer_norm, the fused ones by
          `s = x + r; layer_norm(s)`: what the kernels cost against aten's LayerNorm inside the model),
  rms-1t (diagnostic: the same kernels called with one thread),
  rms-al (rms with every parameter not 64-byte aligned copied to fresh memory: the stock-checkpoint
          reload leaves them at addresses ≡ 8 mod 64; normfold.load now does this itself),
  rms-mis (rms with every tensor moved to an address ≡ 8 mod 64: normfold.load before io.realign),
  crms (Pre-CRMS default load), crms-plain.
Every round runs every candidate once, back to back, rotating the order (bench.timing.measure); the
numbers are medians of per-round ratios to the original, with the quartiles.

    [THREADS=2] [CLOCK=wall|cpu] python benchmarks/scripts/fastpath_swaps.py vit float32 [rounds] [candidates,...]

CLOCK=cpu times each forward with time.process_time (with THREADS=1: the thread's CPU time, which a
loaded machine's other tenants disturb far less than the wall clock).
"""

import os
import sys
import tempfile
import types

import torch

from normfold.bench import hf
from normfold.bench.timing import measure, paired, steady_allocator
from normfold.nn import RMSNorm
from normfold.ops import cpu_calls


def ln_route(model):
    """Every RMSNorm → aten layer_norm (zero-mean input: equal up to rounding; diagnostic only)."""
    for m in model.modules():
        if type(m) is RMSNorm:
            def fwd(self, x, residual=None):
                w, b = self._affine()
                if residual is None:
                    return torch.layer_norm(x, self.normalized_shape, w, b, self.eps)
                s = x + residual
                return s, torch.layer_norm(s, self.normalized_shape, w, b, self.eps)
            m.forward = types.MethodType(fwd, m)
    return model


def one_thread(model):
    """The kernels with nthreads = 1 (diagnostic)."""
    for m in model.modules():
        if type(m) is RMSNorm:
            def fwd(self, x, residual=None):
                w, b = self._affine()
                f = cpu_calls.calls()["forward"]
                n = x.shape[-1]
                y = torch.empty_like(x)
                s = torch.empty_like(x) if residual is not None else None
                f(cpu_calls.DTYPE_CODES[x.dtype], x.data_ptr(), n, None if s is None else residual.data_ptr(), n,
                  None if w is None else w.data_ptr(), 0, None if b is None else b.data_ptr(), 0, y.data_ptr(),
                  None if s is None else s.data_ptr(), None, x.numel() // n, n, self.eps, 0, 1)
                return y if s is None else (s, y)
            m.forward = types.MethodType(fwd, m)
    return model


CPU_TIME = os.environ.get("CLOCK", "wall") == "cpu"


def cpu_measure(cands, rounds):
    """measure()'s rotation with the process's CPU time (time.process_time) instead of the wall clock: on a
    shared machine a descheduled forward costs no CPU time (with one thread this is the thread's own time)."""
    import time
    from normfold.bench.timing import Stats
    names = list(cands)
    for n in names:
        cands[n](); cands[n]()
    samples = {n: [] for n in names}
    for r in range(rounds):
        for n in names[r % len(names):] + names[:r % len(names)]:
            t = time.process_time()
            cands[n]()
            samples[n].append(time.process_time() - t)
    return {n: Stats.of(v) for n, v in samples.items()}


def realign(model):
    """Every parameter / buffer whose data is not 64-byte aligned copied into fresh (aligned) memory."""
    with torch.no_grad():
        for t in list(model.parameters()) + list(model.buffers()):
            if t.data_ptr() % 64:
                t.data = t.data.clone()
    return model


def misalign(model):
    """Every parameter / buffer moved to an address ≡ 8 (mod 64), where transformers' from_pretrained
    left a stock checkpoint's tensors before normfold.load realigned them (the 'before' of io.realign)."""
    with torch.no_grad():
        for t in list(model.parameters()) + list(model.buffers()):
            n, k = t.numel(), 8 // t.element_size()
            buf = torch.empty(n + 64, dtype=t.dtype)
            v = buf[k:k + n].view(t.shape)
            v.copy_(t)
            t.data = v
    return model


def main():
    fam, dname = sys.argv[1], sys.argv[2]
    rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 11
    want = sys.argv[4].split(",") if len(sys.argv) > 4 else ["aa", "no-norm", "rms", "rms-plain", "rms-ln", "rms-1t"]
    case = {"vit": hf.VIT_S16, "gpt2": hf.GPT2_4L}[fam]
    dtype = hf.DTYPES[dname]
    torch.set_num_threads(int(os.environ.get("THREADS", "2")))
    steady_allocator()
    base = {"aa": "aa", "no-norm": "no-norm", "rms": "rmsnorm", "rms-plain": "rmsnorm-plain", "rms-ln": "rmsnorm",
            "rms-1t": "rmsnorm", "rms-al": "rmsnorm", "rms-mis": "rmsnorm", "crms": "crmsnorm", "crms-plain": "crmsnorm-plain"}
    with tempfile.TemporaryDirectory() as w:
        models = {"original": hf.candidates(case, dtype, w, variants=())["original"]}
        for k in want:
            v = base[k]
            m = hf.candidates(case, dtype, w, variants=(v,))[v]
            models[k] = {"rms-ln": ln_route, "rms-1t": one_thread, "rms-al": realign, "rms-mis": misalign}.get(k, lambda m: m)(m)
        x = case.inputs(models["original"], dtype)
        cands = {k: (lambda m=m: m(**x)) for k, m in models.items()}
        with torch.inference_mode():
            ref = models["original"](**x)
            ref = ref.logits.float()
            for k, m in models.items():
                err = (m(**x).logits.float() - ref).abs().max().item()
                print(f"  {k}: max |logits - original| = {err:.3g}")
            st = (cpu_measure(cands, rounds) if CPU_TIME else measure(cands, rounds=rounds, warmup=2, min_time=0.0))
    print(f"{case.name} {dname}, {torch.get_num_threads()} thread(s), {'CPU' if CPU_TIME else 'wall'} time, {rounds} paired rounds; original {st['original'].median * 1e3:.2f} ms")
    for k in want:
        r = paired(st[k], st["original"])
        print(f"  {k:12s} {r.median:.4f}  [q25 {r.q25:.4f}, q75 {r.q75:.4f}]")
    for a, b in (("rms", "rms-mis"), ("rms", "rms-plain"), ("rms", "rms-ln"), ("crms", "rms")):
        if a in st and b in st:
            r = paired(st[a], st[b])
            print(f"  {a} / {b}: {r.median:.4f}  [q25 {r.q25:.4f}, q75 {r.q75:.4f}] (paired directly)")


if __name__ == "__main__":
    main()
