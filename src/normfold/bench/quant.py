"""`normfold bench quant [MODEL]`: what a rotated stream does for fake-quantized inference.

Per model, four forms of the same function: the original (LayerNorm), the plain Pre-RMSNorm conversion,
the rotated one (`rotate="hadamard"`) and the rotated one with an online Hadamard before every MLP
down-projection (`rotate_online=True`). Each is fake-quantized (round-to-nearest, symmetric) at every
nn.Linear and transformers Conv1D, LM head included:

- weights per output channel (scale = max |w| of the channel / (2^(b-1) - 1));
- activations (the module's input) per token or per tensor, same rule;

at W8A8, W4A8, W4A4 (per token and per tensor) and weight-only W8 / W4, and evaluated on held-out text:
perplexity (language models), relative error of the logits against the unquantized original
(‖L_q − L‖_F / ‖L‖_F) and top-1 agreement with it. Activation statistics of the unquantized forms at
the inputs of the linears: per-token crest factor max|x| / rms(x) (mean and max over tokens) and
kurtosis E[x⁴]/E[x²]², for the linears reading the stream (norm readers) and the MLP down-projections.

Models: MODEL (a local HF directory; default the bundled kjv-gpt2) evaluated on held-out KJV chapters
(every 20th chapter, the split the bundled model was trained with; never seen in training), and
"outlier-gpt2": a random GPT-2 (d 192, 4 layers) whose embedding tables and MLP output projections
carry two channels ×30 / ×40, the massive-activation pattern of real LLMs (no trained weights: logit
error and agreement only, its perplexity is meaningless).
"""

from __future__ import annotations

import copy
import math
import time
from pathlib import Path

import torch
from torch import Tensor, nn

from .results import write
from .timing import machine_info

CONFIGS = (  # name, weight bits, activation bits, activation granularity
    ("fp32", None, None, None),
    ("W8A8/token", 8, 8, "token"),
    ("W8A8/tensor", 8, 8, "tensor"),
    ("W4A8/token", 4, 8, "token"),
    ("W4A4/token", 4, 4, "token"),
    ("W4A4/tensor", 4, 4, "tensor"),
    ("W8 only", 8, None, None),
    ("W4 only", 4, None, None),
)
FORMS = ("original", "plain", "rotated", "rotated+online")
COLUMNS = ["model", "form", "config", "perplexity", "ppl_gap", "logit_rel_err", "top1_agree"]
CREST_COLUMNS = ["model", "form", "site", "modules", "crest_mean", "crest_max", "kurtosis"]


# ---- fake quantization --------------------------------------------------------------------------------

def fake_quant(x: Tensor, bits: int, dim: int | None) -> Tensor:
    """Symmetric round-to-nearest: scale = max|x| (over `dim`, keepdim; None = whole tensor) / (2^(b-1)-1)."""
    qmax = 2 ** (bits - 1) - 1
    amax = x.abs().amax() if dim is None else x.abs().amax(dim=dim, keepdim=True)
    scale = (amax / qmax).clamp_min(1e-12)
    return (x / scale).round().clamp(-qmax, qmax) * scale


def _layout(module: nn.Module) -> tuple[int, int] | None:
    """(out axis, in axis) of a Linear / transformers Conv1D weight."""
    if isinstance(module, nn.Linear):
        return 0, 1
    if type(module).__name__ == "Conv1D" and hasattr(module, "nf"):
        return 1, 0
    return None


def linear_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    return [(n, m) for n, m in model.named_modules() if _layout(m) is not None]


def quantized(model: nn.Module, w_bits: int | None, a_bits: int | None, a_mode: str | None) -> nn.Module:
    """A fake-quantized copy: weights per output channel, inputs per token / per tensor. Runs any
    online Hadamard pre-hook first (registered before ours), so the rotated input is what is quantized."""
    q = copy.deepcopy(model)
    for _, m in linear_modules(q):
        out_axis, in_axis = _layout(m)
        if w_bits is not None:
            with torch.no_grad():
                m.weight.copy_(fake_quant(m.weight, w_bits, in_axis))
        if a_bits is not None:
            dim = -1 if a_mode == "token" else None
            m.register_forward_pre_hook(lambda mod, args, _b=a_bits, _d=dim: (fake_quant(args[0], _b, _d), *args[1:]))
    return q


# ---- activation statistics ------------------------------------------------------------------------------

def _stats(x: Tensor) -> tuple[Tensor, Tensor]:
    x = x.detach().double().reshape(-1, x.shape[-1])
    ms = x.pow(2).mean(-1)
    crest = x.abs().amax(-1) / ms.sqrt().clamp_min(1e-30)
    kurt = x.pow(4).mean(-1) / ms.pow(2).clamp_min(1e-60)
    return crest, kurt


def activation_stats(model: nn.Module, batches: list[Tensor], sites: dict[str, list[str]]) -> dict[str, dict]:
    """Per site kind: crest factor (mean, max over tokens) and kurtosis (mean) at the modules' inputs, as
    the module sees them (after any online Hadamard pre-hook)."""
    modules = dict(model.named_modules())
    acc: dict[str, list] = {k: [[], []] for k in sites}
    handles = []
    for kind, names in sites.items():
        for name in names:
            def hook(mod, args, _k=kind):
                c, k = _stats(args[0])
                acc[_k][0].append(c)
                acc[_k][1].append(k)
            # after the online Hadamard pre-hook: prepend=False keeps registration order
            handles.append(modules[name].register_forward_pre_hook(hook))
    with torch.no_grad():
        for ids in batches:
            model(input_ids=ids, use_cache=False)
    for h in handles:
        h.remove()
    out = {}
    for kind, (cs, ks) in acc.items():
        if cs:
            c, k = torch.cat(cs), torch.cat(ks)
            out[kind] = {"modules": len(sites[kind]), "crest_mean": float(c.mean()), "crest_max": float(c.max()),
                         "kurtosis": float(k.mean())}
    return out


# ---- evaluation -------------------------------------------------------------------------------------------

def logits_of(model: nn.Module, batches: list[Tensor]) -> Tensor:
    with torch.no_grad():
        return torch.cat([model(input_ids=ids, use_cache=False).logits.float() for ids in batches])


def perplexity(logits: Tensor, batches: list[Tensor]) -> float:
    ids = torch.cat(batches)
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).double(),
                                             ids[:, 1:].reshape(-1))
    return float(math.exp(loss))


def heldout_batches(windows: int, ctx: int = 256, batch: int = 8, text=None) -> list[Tensor]:
    """`windows` non-overlapping ctx-token windows from the start of the held-out KJV chapters."""
    from .train import token_streams

    _, val = token_streams(text)
    n = min(windows, val.numel() // ctx)
    ids = val[: n * ctx].view(n, ctx)
    return list(ids.split(batch))


def outlier_gpt2(vocab: int = 2048, seed: int = 0) -> nn.Module:
    """A random GPT-2 (d 192, 4 layers, 6 heads) whose wte/wpe carry channels 17 and 101 ×30 and whose MLP
    output projections carry them ×40; LayerNorm γ = 1 + 0.2·N(0,1), β = 0.05·N(0,1)."""
    import transformers

    torch.manual_seed(seed)
    cfg = transformers.GPT2Config(n_embd=192, n_layer=4, n_head=6, vocab_size=vocab, n_positions=256,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = transformers.GPT2LMHeadModel(cfg).eval()
    g = torch.Generator().manual_seed(seed)
    chans = [17, 101]
    with torch.no_grad():
        for t in (model.transformer.wte.weight, model.transformer.wpe.weight):
            t[:, chans] *= 30.0
        for blk in model.transformer.h:
            blk.mlp.c_proj.weight[:, chans] *= 40.0  # Conv1D (in, out): output channels are columns
            blk.mlp.c_proj.bias[chans] *= 40.0
        for m in model.modules():
            if isinstance(m, nn.LayerNorm):
                m.weight.copy_(1 + 0.2 * torch.randn(m.weight.shape, generator=g))
                m.bias.copy_(0.05 * torch.randn(m.bias.shape, generator=g))
    return model


def forms(model: nn.Module, say) -> tuple[dict[str, nn.Module], dict[str, list[str]]]:
    from ..conversion import convert
    from ..rotate import mlp_down_projections  # importing normfold.rotate registers convert(rotate=...)

    out = {"original": model}
    say("converting (plain)")
    out["plain"], _ = convert(model, verify=False)
    say("converting (rotated)")
    out["rotated"], rep = convert(model, rotate="hadamard", verify=False)
    say("converting (rotated + online Hadamard)")
    out["rotated+online"], _ = convert(model, rotate="hadamard", rotate_online=True, verify=False)
    readers = sorted({r for n in rep.structure.norms for r in n.folded_into})
    sites = {"stream readers": readers, "MLP down-proj": mlp_down_projections(out["rotated"], rep)}
    return out, sites


def evaluate(name: str, model: nn.Module, batches: list[Tensor], lm: bool, say, configs=CONFIGS):
    rows, crest_rows = [], []
    variants, sites = forms(model, say)
    ref = logits_of(model, batches)
    ref_ppl = perplexity(ref, batches) if lm else None
    for form in FORMS:
        m = variants[form]
        for kind, st in activation_stats(m, batches[:2], sites).items():
            crest_rows.append({"model": name, "form": form, "site": kind, **st})
        for cname, wb, ab, mode in configs:
            say(f"{name}: {form} {cname}")
            q = m if wb is None and ab is None else quantized(m, wb, ab, mode)
            logits = logits_of(q, batches)
            ppl = perplexity(logits, batches) if lm else None
            rows.append({"model": name, "form": form, "config": cname,
                         "perplexity": "" if ppl is None else round(ppl, 3),
                         "ppl_gap": "" if ppl is None else round(ppl - ref_ppl, 3),
                         "logit_rel_err": float((logits - ref).norm() / ref.norm()),
                         "top1_agree": float((logits.argmax(-1) == ref.argmax(-1)).double().mean())})
    return rows, crest_rows


def _summary(rows: list[dict], crest_rows: list[dict]) -> str:
    lines = ["#### Rotated vs plain\n", "| model | config | plain | rotated | rotated+online | metric |",
             "| --- | --- | --- | --- | --- | --- |"]
    by = {(r["model"], r["form"], r["config"]): r for r in rows}
    for model in dict.fromkeys(r["model"] for r in rows):
        lm = by[(model, "plain", "fp32")]["perplexity"] != ""
        metric = "ppl_gap" if lm else "logit_rel_err"
        for cname, *_ in CONFIGS[1:]:
            vals = [by.get((model, f, cname), {}).get(metric, "") for f in ("plain", "rotated", "rotated+online")]
            lines.append(f"| {model} | {cname} | " + " | ".join(
                f"{v:.4g}" if isinstance(v, float) else str(v) for v in vals) + f" | {metric} |")
    lines += ["", "#### Crest factor (max/rms per token, mean over tokens) at the linears' inputs\n",
              "| model | site | original | plain | rotated | rotated+online |", "| --- | --- | --- | --- | --- | --- |"]
    cb = {(r["model"], r["form"], r["site"]): r for r in crest_rows}
    for model in dict.fromkeys(r["model"] for r in crest_rows):
        for site in dict.fromkeys(r["site"] for r in crest_rows):
            vals = [cb.get((model, f, site), {}).get("crest_mean") for f in FORMS]
            lines.append(f"| {model} | {site} | " + " | ".join("" if v is None else f"{v:.2f}" for v in vals) + " |")
    return "\n".join(lines) + "\n"


def run(model_dir, out_dir, *, quick: bool = False, progress: bool = True, windows: int | None = None,
        text=None):
    import sys

    from ..io import load_source

    say = (lambda msg: print(f"[bench quant] {msg}", file=sys.stderr)) if progress else (lambda msg: None)
    t0 = time.perf_counter()
    windows = windows or (4 if quick else 16)
    batches = heldout_batches(windows, text=text)
    model, source = load_source(model_dir)
    model = model.float().eval()
    name = "kjv-gpt2" if model_dir is None else Path(str(model_dir)).name
    configs = CONFIGS if not quick else CONFIGS[:2] + CONFIGS[4:5] + CONFIGS[7:]
    rows, crest = evaluate(name, model, batches, lm=True, say=say, configs=configs)
    vocab = int(model.config.vocab_size)
    out_batches = [b.clamp_max(vocab - 1) for b in batches]
    r2, c2 = evaluate("outlier-gpt2", outlier_gpt2(vocab=max(vocab, 2048)), out_batches, lm=False, say=say,
                      configs=configs)
    rows += r2
    crest += c2
    machine = machine_info()
    machine["seconds"] = round(time.perf_counter() - t0, 1)
    machine["heldout_tokens"] = int(sum(b.numel() for b in batches))
    extra = _summary(rows, crest)
    paths = write(crest, "quant_crest", out_dir, machine, CREST_COLUMNS,
                  "Activation crest factor and kurtosis at the linears' inputs (unquantized)")
    paths_main = write(rows, "quant", out_dir, machine, COLUMNS,
                       f"Fake quantization (RTN; weights per output channel) on {machine['heldout_tokens']} held-out "
                       "KJV tokens: original / plain / rotated / rotated + online Hadamard", extra=extra)
    paths_main["crest_csv"] = paths["csv"]
    paths_main["crest_md"] = paths["md"]
    return rows, paths_main
