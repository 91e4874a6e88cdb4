"""Where the W4A4 gap of the rotated forms goes, and how low 4-bit per-token activations can go (same held-out and
calibration windows as `normfold bench quant --kv`), on `--rotate hadamard --rotate-online`:

- W16A4 at one group of sites at a time (stream readers incl. the LM head / attention-output inputs / MLP
  down-projection inputs), float weights, absmax;
- W16A4 "Gaussian floor": instead of quantizing, every linear input gets per-token noise of a random direction and
  norm gaussian_rel_err(d)·‖x‖ (what per-token absmax 4-bit does to a Gaussian vector of width d: the best a
  rotation can make a token look like);
- a randomized online Hadamard before the MLP down-projections, x ← x·D·H/√n (D random ±1, the weight rotated to
  match: exact), instead of the unsigned H/√n: the GELU output's mean, which H puts into one coordinate, is
  spread by D; W16A4 absmax / clip and W4A4 GPTQ + clip on it.

    PYTHONPATH=src python benchmarks/scripts/quant_kv_floor.py OUT_DIR
"""

import copy
import sys
import time

import torch

from normfold import algebra
from normfold.bench import quant_kv as K
from normfold.bench.quant import heldout_batches, logits_of, outlier_gpt2, perplexity
from normfold.bench.quant_gptq import calibration_batches, quant_tokens, search_activation_clip, with_activation_quant
from normfold.bench.results import write
from normfold.bench.timing import machine_info
from normfold.conversion import convert
from normfold.io import load_source
from normfold.ops.hadamard import hadamard_matrix
from normfold.quant import quantize_model
from normfold.quant.calibrate import quantizable_linears
from normfold.quant.gptq import DEFAULT_CLIP_GRID

COLUMNS = ["model", "form", "weights", "config", "perplexity", "ppl_gap", "logit_rel_err", "top1_agree"]


def signed_online(model, report, seed=7):
    """The rotated+online form with x ← x·D before each online Hadamard (weights W_orig·D·H/√n, float64)."""
    for i, path in enumerate(report.structure.rotation["online"]):
        mod = model.get_submodule(path)
        lay = algebra.layout_of(mod)
        w = getattr(mod, lay.weight)
        n = int(w.shape[lay.in_dim])
        h = hadamard_matrix(n).to(torch.float64) / n ** 0.5
        d = algebra.rotation.random_signs(n, seed + i)
        orig = algebra.rotate_axis(w.detach().double(), h.T.contiguous(), lay.in_dim)
        shape = [1] * orig.dim()
        shape[lay.in_dim] = n
        new = algebra.rotate_axis(orig * d.view(shape), h, lay.in_dim)
        with torch.no_grad():
            w.copy_(new)
        mod.register_forward_pre_hook(lambda m, a, _d=d: (a[0] * _d.to(a[0].dtype), *a[1:]), prepend=True)
    return model


def site_hooks(model, kinds, fn):
    for name, lin in quantizable_linears(model).items():
        if K.site_kind(name) in kinds:
            lin.register_forward_pre_hook(lambda m, a, _f=fn: (_f(a[0]), *a[1:]))
    return model


def noise(x, seed=[0]):
    d = x.shape[-1]
    seed[0] += 1
    g = torch.Generator().manual_seed(seed[0])
    e = torch.randn(x.shape, generator=g, dtype=torch.float64).to(x.dtype)
    e = e * (x.norm(dim=-1, keepdim=True) / e.norm(dim=-1, keepdim=True)) * FLOOR[d]
    return x + e


FLOOR = {}


def evaluate(name, model, batches, cal, lm):
    torch.set_num_threads(1)
    rows = []
    ref = logits_of(model, batches)
    ref_ppl = perplexity(ref, batches) if lm else None

    def row(form, weights, config, m):
        logits = logits_of(m, batches)
        ppl = perplexity(logits, batches) if lm else None
        r = {"model": name, "form": form, "weights": weights, "config": config,
             "perplexity": "" if ppl is None else round(ppl, 3), "ppl_gap": "" if ppl is None else round(ppl - ref_ppl, 3),
             "logit_rel_err": round(float((logits - ref).norm() / ref.norm()), 5),
             "top1_agree": round(float((logits.argmax(-1) == ref.argmax(-1)).double().mean()), 4)}
        print(r, file=sys.stderr, flush=True)
        rows.append(r)

    base, rep = convert(model, rotate="hadamard", rotate_online=True, verify=False)
    for d in {int(lin.weight.shape[0 if type(lin).__name__ == "Conv1D" else 1]) for lin in quantizable_linears(base).values()}:
        FLOOR[d] = K.gaussian_rel_err(d)
    sites = ("stream-reader inputs", "attention-output inputs", "MLP down-proj inputs")
    for s in sites:
        row("rotated+online", "fp", f"W16A4 at {s} only", site_hooks(copy.deepcopy(base), {s}, lambda x: quant_tokens(x, 4)))
    row("rotated+online", "fp", "W16A4", site_hooks(copy.deepcopy(base), set(sites), lambda x: quant_tokens(x, 4)))
    row("rotated+online", "fp", "W16A4 Gaussian-floor noise", site_hooks(copy.deepcopy(base), set(sites), noise))
    signed = signed_online(copy.deepcopy(base), rep)
    row("rotated+online (signed H)", "fp", "W16A16", signed)
    for e in K.input_errors(signed, batches[:2]):
        if e["site"] == "MLP down-proj inputs":
            print(f"{name}: signed down-proj input error {e['rel_err']} (Gaussian {e['gaussian_rel_err']})", file=sys.stderr)
            rows.append({"model": name, "form": "rotated+online (signed H)", "weights": "fp",
                         "config": f"A4 input error at the MLP down-projections: {e['rel_err']} (Gaussian {e['gaussian_rel_err']})",
                         "perplexity": "", "ppl_gap": "", "logit_rel_err": "", "top1_agree": ""})
    row("rotated+online (signed H)", "fp", "W16A4 at MLP down-proj inputs only",
        site_hooks(copy.deepcopy(signed), {"MLP down-proj inputs"}, lambda x: quant_tokens(x, 4)))
    row("rotated+online (signed H)", "fp", "W16A4", with_activation_quant(signed, 4))
    row("rotated+online (signed H)", "fp", "W16A4 clip", with_activation_quant(signed, 4, search_activation_clip(signed, cal, 4)))
    wq = copy.deepcopy(signed)
    quantize_model(wq, cal, method="gptq", bits=4, act_order=True, clip=DEFAULT_CLIP_GRID)
    row("rotated+online (signed H)", "gptq+clip", "W4A4 clip", with_activation_quant(wq, 4, search_activation_clip(wq, cal, 4)))
    return rows


t0 = time.perf_counter()
cal = calibration_batches("bundled", None, windows=16)
batches = heldout_batches(16)
model = load_source(None)[0].float().eval()
vocab = int(model.config.vocab_size)
rows = evaluate("kjv-gpt2", model, batches, cal, True)
rows += evaluate("outlier-gpt2", outlier_gpt2(vocab=max(vocab, 2048)), [b.clamp_max(vocab - 1) for b in batches],
                 [b.clamp_max(vocab - 1) for b in cal], False)
machine = machine_info()
machine["seconds"] = round(time.perf_counter() - t0, 1)
machine["heldout_tokens"] = int(sum(b.numel() for b in batches))
machine["calibration"] = "bundled"
write(rows, "quant_kv_floor", sys.argv[1], machine, COLUMNS,
      f"Where the rotated W4A4 gap goes: 4-bit activations per site, the Gaussian floor, a signed online Hadamard "
      f"({machine['heldout_tokens']} held-out KJV tokens)")
