"""`normfold bench quant --kv [MODEL] [--calibration FILE|bundled]`: a 4-bit KV cache, and what 4-bit activations
alone leave (W16A4), on the plain and rotated streams.

Same models, evaluation and calibration as `bench quant --gptq` (MODEL, default the bundled kjv-gpt2:
perplexity on held-out KJV chapters; "outlier-gpt2": relative logit error against its fp32 self). Forms: the
original (LayerNorm), the plain Pre-RMSNorm conversion, `--rotate hadamard`, + the online Hadamard before the
MLP down-projections (`--rotate-online`), and on top of that the per-head value/output rotation ("+vo"), the
per-head query/key rotation ("+qk", `--rotate-attention qk`) or both ("+vo+qk").

- KV4: keys and values, as the attention function receives them (after the positions and any query/key
  rotation, so what a KV cache stores), fake-quantized symmetric round-to-nearest to 4 bits per token and per
  head (scale = max |x| over the head's head_dim entries / 7); "absmax", or "clip": a range ratio per layer for
  K and one for V from 1.0 … 0.6, searched on the calibration set (K: minimising ‖q·(Q_r(K) − K)ᵀ‖², the
  error of the attention scores; V: ‖Q_r(V) − V‖²).
- A4: every linear's input (after any online Hadamard) per token, absmax or with the per-linear clip ratio of
  `bench quant --gptq` ("clip"). W16 = float weights; W4 = per-channel 4-bit weights, "gptq+clip" as in
  `bench quant --gptq` (the best W4A4 recipe there), "rtn" for the original's reference row.
- Input error: ‖Q(x) − x‖/‖x‖ per token (root of the mean of the squared ratio) at each kind of site of the
  unquantized forms (linear inputs, keys, values), next to the same number for a Gaussian vector of that width:
  per-token absmax 4-bit on i.i.d. Gaussian entries is the best a rotation can make a token look like.
"""

from __future__ import annotations

import copy
import math
import re
import time
from pathlib import Path

import torch
from torch import Tensor, nn

from ..quant import quantize_model
from ..quant.calibrate import quantizable_linears
from ..quant.gptq import DEFAULT_CLIP_GRID
from .quant import heldout_batches, logits_of, outlier_gpt2, perplexity
from .quant_gptq import (ACT_CLIP_GRID, calibration_batches, quant_tokens, search_activation_clip,
                         with_activation_quant)
from .results import write
from .timing import machine_info

FORMS = ("original", "plain", "rotated", "rotated+online", "rotated+online+vo", "rotated+online+qk",
         "rotated+online+vo+qk")
KV_FORMS = ("original", "rotated+online", "rotated+online+vo", "rotated+online+qk", "rotated+online+vo+qk")
COLUMNS = ["model", "form", "weights", "config", "kv", "perplexity", "ppl_gap", "logit_rel_err", "top1_agree",
           "seconds"]
ERR_COLUMNS = ["model", "form", "site", "width", "sites", "rel_err", "gaussian_rel_err"]


# ---- forms -------------------------------------------------------------------------------------------------

def forms(model: nn.Module, say) -> dict[str, nn.Module]:
    from ..conversion import convert
    from ..rotate import rotate_query_key, rotate_value_output

    out = {"original": model}
    say("converting (plain, rotated, rotated + online, + vo / qk)")
    out["plain"], _ = convert(model, verify=False)
    out["rotated"], _ = convert(model, rotate="hadamard", verify=False)
    out["rotated+online"], _ = convert(model, rotate="hadamard", rotate_online=True, verify=False)
    for suffix, fns in (("+vo", (rotate_value_output,)), ("+qk", (rotate_query_key,)),
                        ("+vo+qk", (rotate_value_output, rotate_query_key))):
        m, rep = convert(model, rotate="hadamard", rotate_online=True, verify=False)
        for fn in fns:  # each computes in float64 and rounds once
            fn(m, rep, 0)
        out["rotated+online" + suffix] = m
    return out


def attention_modules(model: nn.Module) -> dict[str, nn.Module]:
    from ..rotate import HEAD_LAYOUTS

    layout = HEAD_LAYOUTS.get(getattr(model.config, "model_type", None))
    if layout is None:
        return {}
    pattern = re.compile(layout.attention)
    return {n: m for n, m in model.named_modules() if pattern.search(n)}


# ---- the 4-bit KV cache ---------------------------------------------------------------------------------------

def search_kv_clip(model: nn.Module, batches: list[Tensor], bits: int, grid=ACT_CLIP_GRID) -> dict[str, tuple]:
    """Per attention module, (K ratio, V ratio) minimising ‖q·(Q_r(K) − K)ᵀ‖² and ‖Q_r(V) − V‖² on `batches`."""
    from ..nn.attention import add_attention_hook

    m = copy.deepcopy(model)
    errs = {}
    for name, attn in attention_modules(m).items():
        errs[name] = torch.zeros(2, len(grid), dtype=torch.float64)

        def hook(mod, q, k, v, _e=errs[name]):
            kk, vv, qq = k.detach().float(), v.detach().float(), q.detach().float()
            if qq.shape[1] != kk.shape[1]:  # grouped KV: each query head against its group's keys
                kk = kk.repeat_interleave(qq.shape[1] // kk.shape[1], 1)
            for i, r in enumerate(grid):
                _e[0, i] += float((qq @ (quant_tokens(kk, bits, r) - kk).transpose(-1, -2)).double().pow(2).sum())
                _e[1, i] += float((quant_tokens(vv, bits, r) - vv).double().pow(2).sum())
            return q, k, v
        add_attention_hook(attn, hook)
    with torch.no_grad():
        for b in batches:
            m(input_ids=b, use_cache=False)
    return {n: (float(grid[int(e[0].argmin())]), float(grid[int(e[1].argmin())])) for n, e in errs.items()}


def with_kv_quant(model: nn.Module, bits: int, ratios: dict[str, tuple] | None = None) -> nn.Module:
    """A copy whose keys and values are fake-quantized per token and head as the attention function receives
    them (after the positions and any query/key rotation)."""
    from ..nn.attention import add_attention_hook

    q = copy.deepcopy(model)
    mods = attention_modules(q)
    if not mods:
        raise ValueError(f"no attention layout known for {type(model).__name__}")
    for name, attn in mods.items():
        rk, rv = (1.0, 1.0) if ratios is None else ratios[name]
        add_attention_hook(attn, lambda mod, qq, k, v, _rk=rk, _rv=rv: (qq, quant_tokens(k, bits, _rk),
                                                                        quant_tokens(v, bits, _rv)))
    return q


# ---- input error against the Gaussian floor -------------------------------------------------------------------

def gaussian_rel_err(d: int, bits: int = 4, samples: int = 20000, seed: int = 0) -> float:
    """‖Q(x) − x‖/‖x‖ (root mean square over tokens) of per-token absmax round-to-nearest on x ~ N(0, I_d)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(samples, d, generator=g, dtype=torch.float64)
    return float(((quant_tokens(x, bits) - x).pow(2).sum(-1) / x.pow(2).sum(-1)).mean().sqrt())


def gaussian_rel_err_approx(d: int, bits: int = 4) -> float:
    """The same from the uniform-rounding model: step Δ = max|x|/(2^(b−1) − 1), error variance Δ²/12 per
    entry, E[max|x|] ≈ √(2 ln d) (the Gaussian maximum's leading term): √(2 ln d / 12) / (2^(b−1) − 1)."""
    return math.sqrt(2 * math.log(d) / 12) / (2 ** (bits - 1) - 1)


def site_kind(name: str) -> str:
    if name.endswith(("mlp.c_proj", "fc2", "dense_4h_to_h", "mlp.down_proj")):
        return "MLP down-proj inputs"
    if name.endswith(("attn.c_proj", "out_proj", "attention.dense", "self_attention.dense", "self_attn.dense")):
        return "attention-output inputs"
    return "stream-reader inputs"


def input_errors(model: nn.Module, batches: list[Tensor], bits: int = 4) -> list[dict]:
    """Per kind of site: width, #sites and the rms over tokens of ‖Q(x) − x‖/‖x‖ (per-token absmax)."""
    from ..nn.attention import add_attention_hook

    m = copy.deepcopy(model)
    acc: dict[tuple[str, int], list] = {}

    def add(kind, x):
        x = x.detach().double().reshape(-1, x.shape[-1])
        r = (quant_tokens(x, bits) - x).pow(2).sum(-1) / x.pow(2).sum(-1).clamp_min(1e-300)
        a = acc.setdefault((kind, x.shape[-1]), [0.0, 0, set()])
        a[0] += float(r.sum())
        a[1] += r.numel()
        return a

    for name, lin in quantizable_linears(m).items():
        lin.register_forward_pre_hook(lambda mod, args, _n=name: add(site_kind(_n), args[0])[2].add(_n) and None)
    for name, attn in attention_modules(m).items():
        def hook(mod, q, k, v, _n=name):
            add("keys (per head)", k)[2].add(_n)
            add("values (per head)", v)[2].add(_n)
            return q, k, v
        add_attention_hook(attn, hook)
    with torch.no_grad():
        for b in batches:
            m(input_ids=b, use_cache=False)
    return [{"site": kind, "width": d, "sites": len(a[2]), "rel_err": round(math.sqrt(a[0] / a[1]), 4),
             "gaussian_rel_err": round(gaussian_rel_err(d, bits), 4)} for (kind, d), a in acc.items()]


# ---- evaluation --------------------------------------------------------------------------------------------

def jobs() -> list[tuple]:
    """(form, weights, weight bits, activation bits, act clip, kv, kv clip) per row."""
    out = []
    for form in KV_FORMS:  # the KV cache alone
        out += [(form, "fp", None, None, False, 4, False), (form, "fp", None, None, False, 4, True)]
    for form in FORMS[:5]:  # 4-bit activations alone (the floor of W4A4)
        out += [(form, "fp", None, 4, False, None, False), (form, "fp", None, 4, True, None, False)]
    for form in ("original", "rotated+online", "rotated+online+vo+qk"):
        out.append((form, "fp", None, 4, True, 4, True))
    out.append(("original", "rtn", 4, 4, False, None, False))  # the reference of the 10× target
    out.append(("original", "rtn", 4, 4, False, 4, False))
    out.append(("rotated+online", "gptq+clip", 4, 4, True, None, False))
    for form in ("rotated+online", "rotated+online+qk", "rotated+online+vo+qk"):
        out.append((form, "gptq+clip", 4, 4, True, 4, True))
    return out


def evaluate(name: str, model: nn.Module, batches, cal, lm: bool, say, job_list=None) -> tuple[list, list]:
    variants = forms(model, say)
    ref = logits_of(model, batches)
    ref_ppl = perplexity(ref, batches) if lm else None
    rows, errs = [], []
    for form in FORMS:
        for e in input_errors(variants[form], batches[:2]):
            errs.append({"model": name, "form": form, **e})
    weighted: dict[tuple, nn.Module] = {}
    for form, wname, wbits, abits, aclip, kv, kvclip in (job_list or jobs()):
        t0 = time.perf_counter()
        base = variants[form]
        if wbits is not None:
            key = (form, wname, wbits)
            if key not in weighted:
                say(f"{name}: {form} {wname} W{wbits}")
                wq = copy.deepcopy(base)
                quantize_model(wq, cal, method=wname.split("+")[0], bits=wbits, act_order=True,
                               clip=DEFAULT_CLIP_GRID if "clip" in wname else None)
                weighted[key] = wq
            base = weighted[key]
        m = base
        if abits is not None:
            ratios = search_activation_clip(base, cal, abits) if aclip else None
            m = with_activation_quant(base, abits, ratios)
        if kv is not None:
            kvr = search_kv_clip(base, cal, kv) if kvclip else None
            m = with_kv_quant(m, kv, kvr)
        cname = f"W{wbits or 16}A{abits or 16}" + ("" if not aclip or abits is None else " clip")
        kvname = "" if kv is None else f"KV{kv} " + ("clip" if kvclip else "absmax")
        logits = logits_of(m, batches)
        ppl = perplexity(logits, batches) if lm else None
        row = {"model": name, "form": form, "weights": wname, "config": cname, "kv": kvname,
               "perplexity": "" if ppl is None else round(ppl, 3),
               "ppl_gap": "" if ppl is None else round(ppl - ref_ppl, 3),
               "logit_rel_err": round(float((logits - ref).norm() / ref.norm()), 5),
               "top1_agree": round(float((logits.argmax(-1) == ref.argmax(-1)).double().mean()), 4),
               "seconds": round(time.perf_counter() - t0, 1)}
        rows.append(row)
        say(f"  {form} {wname} {cname} {kvname}: gap {row['ppl_gap']} err {row['logit_rel_err']}")
    return rows, errs


def _summary(rows: list[dict], errs: list[dict]) -> str:
    lines = []
    for model in dict.fromkeys(r["model"] for r in rows):
        lm = any(r["model"] == model and r["perplexity"] != "" for r in rows)
        metric = "ppl_gap" if lm else "logit_rel_err"
        sel = [r for r in rows if r["model"] == model]
        keys = list(dict.fromkeys((r["weights"], r["config"], r["kv"]) for r in sel))
        forms_ = [f for f in FORMS if any(r["form"] == f for r in sel)]
        lines += [f"#### {model}: {metric}\n", "| weights | config | KV | " + " | ".join(forms_) + " |",
                  "| --- | --- | --- |" + " --- |" * len(forms_)]
        for w, c, kv in keys:
            vals = [next((r[metric] for r in sel if (r["weights"], r["config"], r["kv"], r["form"]) == (w, c, kv, f)),
                         "") for f in forms_]
            lines.append(f"| {w} | {c} | {kv or '–'} | " + " | ".join(
                f"{v:.4g}" if isinstance(v, float) else str(v) for v in vals) + " |")
        lines.append("")
    lines += ["#### Per-token 4-bit absmax: ‖Q(x) − x‖/‖x‖ at the sites (unquantized forms) vs a Gaussian vector of "
              "the same width\n", "| model | form | site | width | rel. error | Gaussian |", "| --- | --- | --- | --- | --- | --- |"]
    for e in errs:
        lines.append(f"| {e['model']} | {e['form']} | {e['site']} | {e['width']} | {e['rel_err']} | "
                     f"{e['gaussian_rel_err']} |")
    return "\n".join(lines) + "\n"


def _evaluate_task(task) -> tuple[list, list]:
    import sys

    from ..io import load_source

    model_dir, name, lm, batches, cal, progress, vocab, job_list = task
    torch.set_num_threads(1)
    say = (lambda msg: print(f"[bench quant --kv] {msg}", file=sys.stderr, flush=True)) if progress \
        else (lambda msg: None)
    if lm:
        model = load_source(model_dir)[0].float().eval()
        torch.manual_seed(0)
    else:
        model = outlier_gpt2(vocab=vocab)
    return evaluate(name, model, batches, cal, lm=lm, say=say, job_list=job_list)


def run(model_dir, out_dir, *, calibration: str = "bundled", quick: bool = False, progress: bool = True,
        windows: int | None = None, cal_windows: int | None = None, text=None):
    from ..io import load_source

    t0 = time.perf_counter()
    cal = calibration_batches(calibration, model_dir, windows=cal_windows or (8 if quick else 16), text=text)
    batches = heldout_batches(windows or (4 if quick else 16), text=text)
    model, _ = load_source(model_dir)
    name = "kjv-gpt2" if model_dir is None else Path(str(model_dir)).name
    vocab = int(model.config.vocab_size)
    job_list = None
    if quick:
        job_list = [("original", "fp", None, None, False, 4, False), ("rotated+online+qk", "fp", None, None, False, 4, True),
                    ("rotated+online", "fp", None, 4, True, None, False)]
    tasks = [(model_dir, name, True, batches, cal, progress, vocab, job_list),
             (None, "outlier-gpt2", False, [b.clamp_max(vocab - 1) for b in batches],
              [b.clamp_max(vocab - 1) for b in cal], progress, max(vocab, 2048), job_list)]
    if quick:
        parts = [_evaluate_task(t) for t in tasks]
    else:
        import multiprocessing as mp
        from concurrent.futures import ProcessPoolExecutor

        with ProcessPoolExecutor(2, mp_context=mp.get_context("spawn")) as pool:  # the two models side by side
            parts = list(pool.map(_evaluate_task, tasks))
    rows = [r for p in parts for r in p[0]]
    errs = [e for p in parts for e in p[1]]
    machine = machine_info()
    machine["seconds"] = round(time.perf_counter() - t0, 1)
    machine["heldout_tokens"] = int(sum(b.numel() for b in batches))
    machine["calibration"] = calibration
    machine["calibration_tokens"] = int(sum(b.numel() for b in cal))
    extra = _summary(rows, errs)
    paths_err = write(errs, "quant_kv_input_error", out_dir, machine, ["model"] + ERR_COLUMNS[1:],
                      "Per-token 4-bit absmax error at the sites of the unquantized forms vs a Gaussian vector")
    paths = write(rows, "quant_kv", out_dir, machine, COLUMNS,
                  f"KV4 and W16A4 rows, activations per token ({machine['heldout_tokens']} held-out KJV tokens; "
                  f"calibration: {calibration}, {machine['calibration_tokens']} tokens)", extra=extra)
    paths["input_error_csv"], paths["input_error_md"] = paths_err["csv"], paths_err["md"]
    return rows, paths
