"""One-off measurements behind docs/rotation.md, bundled model, held-out KJV windows:

1. W4A4 / W4-only perplexity gap of `--rotate {hadamard,orthogonal} --rotate-online` for seeds 0-2;
2. where the W4A4 gap comes from: 4-bit per-token activations at one module group at a time (weights
   unquantized), plain conversion vs rotated + online.

    PYTHONPATH=src python benchmarks/scripts/quant_seeds_sites.py [--windows 16]
"""

import argparse
import copy

import normfold
from normfold.bench import quant as Q
from normfold.io import load_source

p = argparse.ArgumentParser()
p.add_argument("--windows", type=int, default=16)
args = p.parse_args()
batches = Q.heldout_batches(args.windows)
m, _ = load_source(None)
m = m.float().eval()
ref = Q.logits_of(m, batches)
rp = Q.perplexity(ref, batches)


def gap(model):
    return round(Q.perplexity(Q.logits_of(model, batches), batches) - rp, 3)


for kind in ("hadamard", "orthogonal"):
    for seed in (0, 1, 2):
        rot, _ = normfold.convert(m, rotate=kind, rotate_seed=seed, rotate_online=True, verify=False)
        print(kind, seed, "W4A4/token gap", gap(Q.quantized(rot, 4, 4, "token")),
              "W4-only gap", gap(Q.quantized(rot, 4, None, None)), flush=True)

plain, _ = normfold.convert(m, verify=False)
rot, _ = normfold.convert(m, rotate="hadamard", rotate_online=True, verify=False)
groups = {"qkv": "attn.c_attn", "attn_out": "attn.c_proj", "fc": "mlp.c_fc", "down": "mlp.c_proj", "head": "lm_head"}


def only(model, suffix, bits=4):
    q = copy.deepcopy(model)
    for n, mod in Q.linear_modules(q):
        if n.endswith(suffix):
            mod.register_forward_pre_hook(lambda mm, a: (Q.fake_quant(a[0], bits, -1), *a[1:]))
    return q


for g, suf in groups.items():
    print("A4 only at", g, "plain", gap(only(plain, suf)), "rotated+online", gap(only(rot, suf)), flush=True)
