"""Real int8 on CPU: torch.ao dynamic quantization (int8 weights
per tensor, int8 activations per tensor computed at run time, fbgemm/x86 kernels) of the bundled model's
linears, plain conversion vs rotated vs rotated + online Hadamard, against float32: held-out KJV
perplexity and forward time (batch 1 × 256 tokens and 8 × 256, interleaved rounds, medians).

GPT-2's Conv1D layers are swapped for equivalent nn.Linear first (weight transposed; exact), since
quantize_dynamic only handles nn.Linear; forward pre-hooks (the online Hadamard) survive the swap.

    PYTHONPATH=src python benchmarks/scripts/int8_dynamic.py [--windows 16] [--rounds 15]
"""

import argparse
import copy
import statistics
import warnings

import torch
from torch import nn

import normfold
from normfold.bench import quant as Q
from normfold.bench.timing import machine_info, measure
from normfold.io import load_source

warnings.filterwarnings("ignore")
p = argparse.ArgumentParser()
p.add_argument("--windows", type=int, default=16)
p.add_argument("--rounds", type=int, default=15)
args = p.parse_args()


def conv1d_to_linear(model: nn.Module) -> nn.Module:
    model = copy.deepcopy(model)
    for name, m in list(model.named_modules()):
        if type(m).__name__ == "Conv1D":
            lin = nn.Linear(m.weight.shape[0], m.weight.shape[1], dtype=m.weight.dtype)
            with torch.no_grad():
                lin.weight.copy_(m.weight.T)
                lin.bias.copy_(m.bias)
            for h in m._forward_pre_hooks.values():
                lin.register_forward_pre_hook(h)
            for k, v in m._buffers.items():
                lin.register_buffer(k, v, persistent=False)
            parent = model.get_submodule(name.rpartition(".")[0]) if "." in name else model
            setattr(parent, name.rpartition(".")[2], lin)
    return model


def int8(model: nn.Module) -> nn.Module:
    from torch.ao.quantization import quantize_dynamic

    lin = conv1d_to_linear(model)
    q = quantize_dynamic(lin, {nn.Linear}, dtype=torch.qint8)
    qmods = dict(q.named_modules())
    for name, m in lin.named_modules():  # the swap keeps hooks, not buffers: give back the Hadamard cores
        for k, v in m._buffers.items():
            if k.startswith("_normfold") and k not in qmods[name]._buffers:
                qmods[name].register_buffer(k, v, persistent=False)
    return q


batches = Q.heldout_batches(args.windows)
model, _ = load_source(None)
model = model.float().eval()
ref = Q.logits_of(model, batches)
rp = Q.perplexity(ref, batches)
forms = {"original": model, "plain": normfold.convert(model, verify=False)[0],
         "rotated": normfold.convert(model, rotate="hadamard", verify=False)[0],
         "rotated+online": normfold.convert(model, rotate="hadamard", rotate_online=True, verify=False)[0]}
print(machine_info()["cpu"], torch.__version__, "threads", torch.get_num_threads(), "engine",
      torch.backends.quantized.engine)
print(f"float32 perplexity {rp:.3f} on {sum(b.numel() for b in batches)} held-out tokens")
models = {}
for name, m in forms.items():
    q = int8(m)
    lq = Q.logits_of(q, batches)
    print(f"int8 dynamic {name:15s} perplexity {Q.perplexity(lq, batches):.3f} (gap {Q.perplexity(lq, batches) - rp:+.3f})"
          f"  logit rel err {float((lq - ref).norm() / ref.norm()):.4f}")
    models[f"{name} fp32"] = m
    models[f"{name} int8"] = q
for shape in ((1, 256), (8, 256)):
    ids = torch.randint(0, 2048, shape, generator=torch.Generator().manual_seed(0))
    cands = {}
    for n in ("original fp32", "plain fp32", "rotated fp32", "original int8", "plain int8", "rotated int8",
              "rotated+online int8"):
        m = models[n]
        cands[n] = (lambda m=m: m(input_ids=ids, use_cache=False))
    with torch.no_grad():
        stats = measure(cands, rounds=args.rounds, warmup=2)
    base = stats["original fp32"]
    for n, st in stats.items():
        ratio = statistics.median(t / b for t, b in zip(st.samples, base.samples))
        print(f"{shape}  {n:22s} median {st.median * 1e3:7.2f} ms  (q25 {st.q25 * 1e3:.2f}, q75 {st.q75 * 1e3:.2f})"
              f"  per-round ratio to original fp32 {ratio:.3f}")
