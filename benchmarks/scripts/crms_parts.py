"""Where Pre-CRMS still costs more than Pre-RMS (issue 24 item 4), per part, on `normfold bench hf`'s models
as the user gets them (normfold.convert -> normfold.save -> normfold.load).

Every leaf module's forward and every forward (pre-)hook normfold registered is wrapped with a timer
(time.thread_time: with one thread, the CPU time of the forward's own thread, which the other tenants of a
shared machine disturb far less than the wall clock). Parts:

  readers  linear layers reading the stream (input width d, or d−1 on the compressed stream)
  writers  linear layers writing the stream (output width d, or d−1; padded or not)
  norm     norm module calls with one input;  norm+add  the fused add + norm calls (input, residual)
  embed    embeddings and the patch convolution;  head  lm_head / classifier
  hook:NAME  normfold's hooks (the Recenter after the embedding, the re-centre + compress at the entry)
  rest     the forward's time outside all of these (attention's matmuls and softmax, GELU, the adds, ...)

Candidates: rms (Pre-RMS), rms2 (a second normfold.load of the same checkpoint: the A/A control), crms
(Pre-CRMS) and crms0 (a second load of the Pre-CRMS checkpoint run with the issue-24-item-4 paths turned
off: the norm kernels' fast calls refusing row-strided streams, the final norm's general decompression,
the entry's former sliced two-pass form; i.e. the runtime before them). Each round runs every candidate once,
rotating the order; per part the table gives the median ms per forward and the median [q25, q75] of the
per-round differences against rms.

    OMP_NUM_THREADS=1 [NORMS_BY_NAME=1] python benchmarks/scripts/crms_parts.py vit|gpt2 float32|bfloat16 [rounds]

NORMS_BY_NAME=1 times every norm module on its own row (norm:NAME) instead of the two norm rows.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from collections import defaultdict

import torch
from torch import nn

from normfold.bench import hf
from normfold.bench.timing import steady_allocator
from normfold.compress import StreamCRMSNorm, runtime
from normfold.io import load
from normfold.ops import cpu_calls

OLD = [False]  # set while crms0 runs


def _install_before_switch():
    rv, dec, rc = cpu_calls._row_view, StreamCRMSNorm._decompressed, runtime._recenter_compress

    def row_view(t, n):
        return None if OLD[0] else rv(t, n)

    def decompressed(self, x):
        return None if OLD[0] else dec(self, x)

    def recenter_compress(x, pad):
        if not OLD[0] or pad:
            return rc(x, pad)
        x = x - x.mean(dim=-1, keepdim=True)
        x = x - x.mean(dim=-1, keepdim=True)
        return x[..., :-1]

    cpu_calls._row_view, StreamCRMSNorm._decompressed, runtime._recenter_compress = row_view, decompressed, \
        recenter_compress


def _is_norm(m: nn.Module) -> bool:
    return isinstance(m, nn.LayerNorm) or "Norm" in type(m).__name__


def _linear_dims(m: nn.Module):
    w = getattr(m, "weight", None)
    if not isinstance(w, torch.Tensor) or w.dim() != 2:
        return None
    if isinstance(m, nn.Linear):
        return m.in_features, m.out_features
    if type(m).__name__ == "Conv1D":
        return w.shape[0], w.shape[1]
    return None


def categories(model: nn.Module, d: int, head_names=("lm_head", "classifier")) -> dict[str, str]:
    out = {}
    for name, m in model.named_modules():
        if any(name.endswith(h) for h in head_names):
            out[name] = "head"
        elif _is_norm(m):
            out[name] = "norm"
        elif isinstance(m, (nn.Embedding, nn.Conv2d)):
            out[name] = "embed"
        elif (dims := _linear_dims(m)) is not None:
            i, o = dims
            # named on the compressed model, whose stream is d−1 wide everywhere
            out[name] = "writers" if o == d - 1 else "readers" if i == d - 1 else "other-linear"
    return out


class Timer:
    def __init__(self):
        self.acc = defaultdict(float)

    def wrap_forward(self, m: nn.Module, cat: str):
        fwd = m.forward

        def timed(*args, **kwargs):
            key = cat + ("+add" if cat.startswith("norm") and (len(args) > 1 and args[1] is not None
                                                     or kwargs.get("residual") is not None) else "")
            t = time.thread_time()
            try:
                return fwd(*args, **kwargs)
            finally:
                self.acc[key] += time.thread_time() - t
        m.forward = timed

    def wrap_hooks(self, m: nn.Module):
        for d in (m._forward_hooks, m._forward_pre_hooks):
            for k, f in list(d.items()):
                key = "hook:" + getattr(f, "__name__", "?")

                def timed(*a, f=f, key=key, **kw):
                    t = time.thread_time()
                    try:
                        return f(*a, **kw)
                    finally:
                        self.acc[key] += time.thread_time() - t
                d[k] = timed


def instrument(model: nn.Module, cats: dict[str, str]) -> Timer:
    timer = Timer()
    for name, m in model.named_modules():
        if m._forward_hooks or m._forward_pre_hooks:
            timer.wrap_hooks(m)
        if name in cats and (cats[name] != "norm" or not any(True for _ in m.children())):
            by_name = cats[name] == "norm" and os.environ.get("NORMS_BY_NAME") == "1"
            timer.wrap_forward(m, f"norm:{name}" if by_name else cats[name])
    return timer


def main():
    fam, dname = sys.argv[1], sys.argv[2]
    rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 15
    torch.set_num_threads(1)
    steady_allocator()
    case = {"vit": hf.VIT_S16, "gpt2": hf.GPT2_4L}[fam]
    dtype = hf.DTYPES[dname]
    d = case.config.get("hidden_size", case.config.get("n_embd"))
    with tempfile.TemporaryDirectory() as w:
        orig = case.build(0).to(dtype)
        models = {"rms": hf.converted(orig, "rmsnorm", w)}
        models["rms2"] = load(f"{w}/rmsnorm-0")
        models["crms"] = hf.converted(orig, "crmsnorm", w)
        models["crms0"] = load(f"{w}/crmsnorm-0")
        _install_before_switch()
        x = case.inputs(orig, dtype)
        with torch.inference_mode():
            ref = orig(**x).logits.double()
            for k, m in models.items():
                OLD[0] = k == "crms0"
                err = (m(**x).logits.double() - ref).abs().max().item()
                OLD[0] = False
                print(f"  {k}: max |logits − original| = {err:.3g}")
        cats = categories(models["crms"], d)
        timers = {k: instrument(m, cats) for k, m in models.items()}
        names = list(models)
        samples = {k: defaultdict(list) for k in names}
        with torch.inference_mode():
            for k in names:
                OLD[0] = k == "crms0"
                models[k](**x)
            for r in range(rounds):
                for k in names[r % len(names):] + names[:r % len(names)]:
                    timers[k].acc.clear()
                    OLD[0] = k == "crms0"
                    t = time.thread_time()
                    models[k](**x)
                    total = time.thread_time() - t
                    OLD[0] = False
                    parts = dict(timers[k].acc)
                    parts["rest"] = total - sum(parts.values())
                    parts["TOTAL"] = total
                    for p in set(parts) | set(samples[k]):
                        samples[k][p].append(parts.get(p, 0.0))
    import statistics as st

    def q(v):
        return st.quantiles(v, n=4, method="inclusive") if len(v) > 1 else [v[0]] * 3

    keys = sorted(set().union(*(samples[k].keys() for k in names)), key=lambda p: (p == "TOTAL", p))
    print(f"{case.name} {dname}, 1 thread, thread CPU time, {rounds} rounds (loaded machine)")
    def col(k, p):
        return samples[k].get(p, [0.0] * rounds)

    def dq(k, p):
        v = q([(a - b) * 1e3 for a, b in zip(col(k, p), col("rms", p))])
        return f"{v[1]:+7.3f} [{v[0]:+.3f}, {v[2]:+.3f}]"

    print(f"{'part':24s} {'rms':>8s} {'crms':>8s} {'crms0':>8s}   {'crms − rms':26s} {'crms0 − rms':26s} A/A rms2 − rms (ms)")
    for p in keys:
        ms = [st.median(col(k, p)) * 1e3 for k in ("rms", "crms", "crms0")]
        print(f"{p:24s} {ms[0]:8.3f} {ms[1]:8.3f} {ms[2]:8.3f}   {dq('crms', p):26s} {dq('crms0', p):26s} {dq('rms2', p)}")
    for a, b in (("crms", "rms"), ("crms0", "rms"), ("crms", "crms0"), ("rms2", "rms")):
        v = q([x / y for x, y in zip(samples[a]["TOTAL"], samples[b]["TOTAL"])])
        print(f"whole forward {a}/{b}: {v[1]:.4f} [{v[0]:.4f}, {v[2]:.4f}]")

if __name__ == "__main__":
    main()
