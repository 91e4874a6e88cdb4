"""`normfold bench quant --gptq [MODEL] [--calibration FILE|bundled]`: GPTQ vs round-to-nearest weights on
the plain and rotated streams, with per-layer clipping searched on calibration data.

Same models and held-out evaluation as `bench quant` (MODEL, default the bundled kjv-gpt2: perplexity on
held-out KJV chapters; "outlier-gpt2": relative logit error against its fp32 self). Forms: the original
(LayerNorm), the plain Pre-RMSNorm conversion, `--rotate hadamard`, + online Hadamard before the MLP
down-projections, + online Hadamard before the attention output projections as well, + the per-head
value/output rotation in the weights (`--rotate-attention both`).

Weights (every linear, LM head included unless a config says "/head16", symmetric; an LM head tied to the
embedding is untied first, the embedding stays float): "rtn" (round-to-nearest, per output channel or
group), "gptq" (act-order, damping 0.01, block by block on the calibration data, `normfold.quant`),
"gptq+clip" (range ratio per output row searched on the calibration Hessian first). Activations: per
token, symmetric round-to-nearest at the module's input (after any online Hadamard); with "gptq+clip",
a range ratio per linear searched on the calibration set (minimising ‖(Q_r(X) − X)·Ŵᵀ‖²).

Calibration ("bundled"): windows of the bundled model's training split of the KJV (every chapter but each
20th, which is the held-out evaluation split): disjoint from the evaluation text by construction. FILE: a
UTF-8 text file tokenized with MODEL's tokenizer.
"""

from __future__ import annotations

import copy
import time
from pathlib import Path

import torch
from torch import Tensor, nn

from ..errors import NormfoldError
from ..quant import quantize_model
from ..quant.calibrate import quantizable_linears
from ..quant.gptq import DEFAULT_CLIP_GRID
from .quant import heldout_batches, logits_of, outlier_gpt2, perplexity
from .results import write
from .timing import machine_info

CTX = 256
WEIGHTS = ("rtn", "gptq", "gptq+clip")
FORMS = ("original", "plain", "rotated", "rotated+online", "rotated+online+attn", "rotated+online+attn+vo")
CONFIGS = ("W4A16", "W4A8", "W4A4", "W8A8", "W4A16/head16", "W4A4/head16")
ACT_CLIP_GRID = (1.0, 0.95, 0.9, 0.85, 0.8, 0.75, 0.7, 0.65, 0.6)
COLUMNS = ["model", "form", "weights", "config", "group", "perplexity", "ppl_gap", "logit_rel_err", "top1_agree",
           "seconds"]


class CalibrationError(NormfoldError):
    """Calibration data that cannot be used (missing file, too short)."""


# ---- calibration data --------------------------------------------------------------------------------------

def calibration_batches(spec: str, model_dir=None, windows: int = 32, ctx: int = CTX, batch: int = 8,
                        text=None) -> list[Tensor]:
    """`windows` ctx-token windows: "bundled" = spread evenly over the KJV training split (disjoint from the
    held-out chapters `bench quant` evaluates on); otherwise a text file, tokenized with MODEL's tokenizer
    (the bundled one when MODEL is None), windows from its start."""
    if spec == "bundled":
        from .train import token_streams

        train, _ = token_streams(text)
        n = train.numel() // ctx
        pick = torch.linspace(0, n - 1, min(windows, n)).round().long()
        ids = train[: n * ctx].view(n, ctx)[pick]
        return list(ids.split(batch))
    path = Path(spec)
    if not path.is_file():
        raise CalibrationError(f"--calibration {spec}: no such file (give a UTF-8 text file or 'bundled')")
    from tokenizers import Tokenizer

    from ..io import default_model_path

    tok_file = (default_model_path() if model_dir is None else Path(model_dir)) / "tokenizer.json"
    if not tok_file.is_file():
        raise CalibrationError(f"{tok_file} not found: --calibration FILE needs MODEL's tokenizer.json")
    ids = torch.tensor(Tokenizer.from_file(str(tok_file)).encode(path.read_text()).ids, dtype=torch.long)
    n = min(windows, ids.numel() // ctx)
    if n < 1:
        raise CalibrationError(f"--calibration {spec}: {ids.numel()} tokens, need at least {ctx}")
    return list(ids[: n * ctx].view(n, ctx).split(batch))


# ---- forms -------------------------------------------------------------------------------------------------

def forms(model: nn.Module, say) -> dict[str, nn.Module]:
    from ..conversion import convert
    from ..rotate import add_attention_online_hadamard

    out = {"original": model}
    say("converting (plain, rotated, rotated + online)")
    out["plain"], _ = convert(model, verify=False)
    out["rotated"], _ = convert(model, rotate="hadamard", verify=False)
    out["rotated+online"], _ = convert(model, rotate="hadamard", rotate_online=True, verify=False)
    out["rotated+online+attn"], rep2 = convert(model, rotate="hadamard", rotate_online=True, verify=False)
    add_attention_online_hadamard(out["rotated+online+attn"], rep2)
    out["rotated+online+attn+vo"], _ = convert(model, rotate="hadamard", rotate_online=True,
                                              rotate_attention="both", verify=False)
    return out


# ---- activation quantization with a searched clip ratio ------------------------------------------------------

def quant_tokens(x: Tensor, bits: int, ratio: float = 1.0) -> Tensor:
    """Per-token symmetric round-to-nearest with the range shrunk by `ratio`."""
    qmax = 2 ** (bits - 1) - 1
    scale = (x.abs().amax(-1, keepdim=True) * ratio / qmax).clamp_min(1e-12)
    return (x / scale).round().clamp(-qmax, qmax) * scale


def search_activation_clip(model: nn.Module, batches: list[Tensor], bits: int, grid=ACT_CLIP_GRID,
                           skip=()) -> dict[str, float]:
    """Per linear, the ratio minimising ‖(Q_r(X) − X)·Wᵀ‖² summed over the calibration batches."""
    from ..quant.calibrate import weight_matrix

    mods = quantizable_linears(model, skip)
    err = {n: torch.zeros(len(grid), dtype=torch.float64) for n in mods}
    handles = []
    for n, m in mods.items():
        def pre(mod, args, _n=n):
            x = args[0].detach().reshape(-1, args[0].shape[-1]).float()
            w = weight_matrix(mod).detach().float()
            for i, r in enumerate(grid):
                err[_n][i] += float(((quant_tokens(x, bits, r) - x) @ w.T).double().pow(2).sum())
        handles.append(m.register_forward_pre_hook(pre))
    try:
        with torch.no_grad():
            for b in batches:
                model(input_ids=b, use_cache=False)
    finally:
        for h in handles:
            h.remove()
    return {n: float(grid[int(e.argmin())]) for n, e in err.items()}


def with_activation_quant(model: nn.Module, bits: int, ratios: dict[str, float] | None = None,
                          skip=()) -> nn.Module:
    """Per-token activation quantization at every linear's input (after any online Hadamard pre-hook)."""
    q = copy.deepcopy(model)
    for n, m in quantizable_linears(q, skip).items():
        r = 1.0 if ratios is None else ratios.get(n, 1.0)
        m.register_forward_pre_hook(lambda mod, args, _r=r: (quant_tokens(args[0], bits, _r), *args[1:]))
    return q


# ---- evaluation --------------------------------------------------------------------------------------------

def _row(name, form, weights, cname, group, logits, ref, ref_ppl, batches, lm, seconds):
    ppl = perplexity(logits, batches) if lm else None
    return {"model": name, "form": form, "weights": weights, "config": cname,
            "group": "channel" if group is None else group,
            "perplexity": "" if ppl is None else round(ppl, 3),
            "ppl_gap": "" if ppl is None else round(ppl - ref_ppl, 3),
            "logit_rel_err": round(float((logits - ref).norm() / ref.norm()), 5),
            "top1_agree": round(float((logits.argmax(-1) == ref.argmax(-1)).double().mean()), 4),
            "seconds": round(seconds, 1)}


def head_of(model: nn.Module) -> str | None:
    """Path of the output embedding (the LM head), if the model has one."""
    get = getattr(model, "get_output_embeddings", None)
    head = get() if get is not None else None
    return next((n for n, m in model.named_modules() if head is not None and m is head), None)


def jobs(form: str, weights, groups, group_forms) -> list[tuple[str, int, int | None, bool, list]]:
    """(weights, weight bits, group, head kept float, [(config, activation bits)]) per weight quantization:
    per-channel W4 (A16, A8, A4) for every method; W8A8 with RTN everywhere and GPTQ on the plain and
    rotated+online forms; the LM head kept float (QuaRot's protocol) with "gptq+clip" on the online forms;
    the group sizes (W4A16) with RTN and GPTQ on `group_forms`."""
    out = []
    for w in weights:
        out.append((w, 4, None, False, [("W4A16", None), ("W4A8", 8), ("W4A4", 4)]))
        if "clip" in w:
            if "online" in form:
                out.append((w, 4, None, True, [("W4A16", None), ("W4A4", 4)]))
            continue
        if w == "rtn" or form in ("plain", "rotated+online"):
            out.append((w, 8, None, False, [("W8A8", 8)]))
        if form in group_forms:
            out += [(w, 4, g, False, [("W4A16", None)]) for g in groups]
    return out


def evaluate(name: str, model: nn.Module, batches, cal, lm: bool, say, *, weights=WEIGHTS, form_names=FORMS,
             groups=(64, 32), group_forms=("plain", "rotated+online"), act_order: bool = True,
             heads=(False, True)) -> list[dict]:
    variants = forms(model, say)
    ref = logits_of(model, batches)
    ref_ppl = perplexity(ref, batches) if lm else None
    rows = []
    for form in form_names:
        base = variants[form]
        head = head_of(base)
        for wname, wbits, group, head_float, configs in jobs(form, weights, groups, group_forms):
            if head_float not in heads:
                continue
            method, clip = wname.split("+")[0], ("+clip" in wname)
            t0 = time.perf_counter()
            say(f"{name}: {form} {wname} W{wbits} group {group}{' head float' if head_float else ''}")
            wq = copy.deepcopy(base)
            skip = [head] if head_float and head else []
            quantize_model(wq, cal, method=method, bits=wbits, group_size=group, act_order=act_order,
                           clip=DEFAULT_CLIP_GRID if clip else None, skip=skip)
            tq = time.perf_counter() - t0
            for cname, ab in configs:
                t1 = time.perf_counter()
                if ab is None:
                    m = wq
                else:
                    ratios = search_activation_clip(wq, cal, ab, skip=skip) if clip else None
                    m = with_activation_quant(wq, ab, ratios, skip=skip)
                logits = logits_of(m, batches)
                row = _row(name, form, wname, cname + ("/head16" if head_float else ""), group, logits, ref,
                           ref_ppl, batches, lm, tq + time.perf_counter() - t1)
                rows.append(row)
                say(f"  {row['config']}: gap {row['ppl_gap']} err {row['logit_rel_err']}")
    return rows


def _summary(rows: list[dict]) -> str:
    by = {(r["model"], r["form"], r["weights"], r["config"], r["group"]): r for r in rows}
    lines = []
    for model in dict.fromkeys(r["model"] for r in rows):
        lm = any(r["model"] == model and r["perplexity"] != "" for r in rows)
        metric = "ppl_gap" if lm else "logit_rel_err"
        lines += [f"#### {model}: {metric}, per-channel weights\n",
                  "| config | weights | " + " | ".join(FORMS) + " |", "| --- | --- |" + " --- |" * len(FORMS)]
        for cname in CONFIGS:
            for w in WEIGHTS:
                vals = [by.get((model, f, w, cname, "channel"), {}).get(metric, "") for f in FORMS]
                if all(v == "" for v in vals):
                    continue
                lines.append(f"| {cname} | {w} | " + " | ".join(
                    f"{v:.4g}" if isinstance(v, float) else str(v) for v in vals) + " |")
        lines.append("")
    return "\n".join(lines) + "\n"


def _plot(rows, path, machine):
    import matplotlib.pyplot as plt

    models = list(dict.fromkeys(r["model"] for r in rows))
    fig, axes = plt.subplots(1, len(models), figsize=(7 * len(models), 4.5), squeeze=False)
    for ax, model in zip(axes[0], models):
        lm = any(r["model"] == model and r["perplexity"] != "" for r in rows)
        metric = "ppl_gap" if lm else "logit_rel_err"
        sel = [r for r in rows if r["model"] == model and r["group"] == "channel" and r["config"] == "W4A4"]
        forms_ = list(dict.fromkeys(r["form"] for r in sel))
        ws = list(dict.fromkeys(r["weights"] for r in sel))
        width = 0.8 / max(1, len(ws))
        for j, w in enumerate(ws):
            vals = [next((float(r[metric]) for r in sel if r["form"] == f and r["weights"] == w), 0.0) for f in forms_]
            ax.bar([i + j * width for i in range(len(forms_))], vals, width, label=w)
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(forms_))], forms_, rotation=20, fontsize=8)
        ax.set_yscale("log")
        ax.set_title(f"{model}: W4A4 per token, {metric}")
        ax.legend(fontsize=8)
    fig.suptitle(f"GPTQ vs RTN ({machine.get('cpu', '')})", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _evaluate_task(task) -> list[dict]:
    import sys

    from ..io import load_source

    model_dir, name, lm, batches, cal, kw, progress, vocab = task
    torch.set_num_threads(1)
    say = (lambda msg: print(f"[bench quant --gptq] {msg}", file=sys.stderr, flush=True)) if progress \
        else (lambda msg: None)
    if lm:
        model = load_source(model_dir)[0].float().eval()
        torch.manual_seed(0)
    else:
        model = outlier_gpt2(vocab=vocab)
    return evaluate(name, model, batches, cal, lm=lm, say=say, **kw)


def run(model_dir, out_dir, *, calibration: str = "bundled", quick: bool = False, progress: bool = True,
        windows: int | None = None, cal_windows: int | None = None, text=None):
    from ..io import load_source

    t0 = time.perf_counter()
    cal = calibration_batches(calibration, model_dir, windows=cal_windows or (8 if quick else 16), text=text)
    batches = heldout_batches(windows or (4 if quick else 16), text=text)
    model, _ = load_source(model_dir)
    model = model.float().eval()
    name = "kjv-gpt2" if model_dir is None else Path(str(model_dir)).name
    kw = {}
    if quick:
        kw = dict(weights=("rtn", "gptq"), form_names=("plain", "rotated+online"), groups=(64,), heads=(False,))
    vocab = int(model.config.vocab_size)
    tasks = [(model_dir, name, True, batches, cal, kw, progress, vocab),
             (None, "outlier-gpt2", False, [b.clamp_max(vocab - 1) for b in batches],
              [b.clamp_max(vocab - 1) for b in cal], kw, progress, max(vocab, 2048))]
    if quick:
        rows = [r for t in tasks for r in _evaluate_task(t)]
    else:
        import multiprocessing as mp
        from concurrent.futures import ProcessPoolExecutor

        with ProcessPoolExecutor(2, mp_context=mp.get_context("spawn")) as pool:  # the two models side by side
            rows = [r for part in pool.map(_evaluate_task, tasks) for r in part]
    machine = machine_info()
    machine["seconds"] = round(time.perf_counter() - t0, 1)
    machine["heldout_tokens"] = int(sum(b.numel() for b in batches))
    machine["calibration"] = calibration
    machine["calibration_tokens"] = int(sum(b.numel() for b in cal))
    return rows, write(rows, "quant_gptq", out_dir, machine, COLUMNS,
                       f"GPTQ vs round-to-nearest weights, activations per token ({machine['heldout_tokens']} "
                       f"held-out KJV tokens; calibration: {calibration}, {machine['calibration_tokens']} tokens)",
                       plot=_plot, extra=_summary(rows))
