"""`normfold bench e2e`: end-to-end inference time of Pre-LN / Pre-RMS / Pre-CRMS / no-norm models
(paper 001 §4, Table 3 layout): ViTs of Table 2 and GPT-3 Small/Medium, random weights.

Every time is normalized to the Pre-LN model of the same setting, round by round: each round runs
every variant once, back to back, and `X/ln` is the median over rounds of that round's X / Pre-LN
time (a paired ratio: drifts of a shared machine move both and cancel). "gap captured" is
(LN − RMS) / (LN − no-norm): the share of everything normalization costs that the conversion
removes (1.0 would make the norm free). A second, separately allocated copy of the Pre-LN model
runs as a control (A/A): its ratio to Pre-LN is what "no difference" looks like on the machine,
and how often the verdict flags it says how far to trust the verdicts of the real variants.
With `compile=True` each variant is also timed under `torch.compile` (normalized to the compiled
Pre-LN model), which checks that a converted model is not slower with compilation on both sides.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import gc
import math
from dataclasses import dataclass

import torch

from ..errors import NormfoldError
from . import e2e_models as em
from .model import hook_overhead, median_ms, norm_times, paired_norm_ratio
from .results import write
from .timing import (Bar, forward_cost, machine_info, measure, measure_weights, norm_times_weights, paired,
                     ratio_verdict, steady_allocator)

# name -> (parameter dtype, autocast dtype or None)
DTYPES = {
    "float32": (torch.float32, None),
    "bfloat16": (torch.bfloat16, None),
    "float16": (torch.float16, None),
    "amp-bf16": (torch.float32, torch.bfloat16),
    "amp-fp16": (torch.float32, torch.float16),
}


@dataclass(frozen=True)
class Setting:
    cfg: em.ViTConfig | em.GPTConfig
    batch: int
    dtype: str


@dataclass(frozen=True)
class Plan:
    """What a run measures (see `plan()` for the presets)."""

    models: tuple[str, ...]
    vit_batches: tuple[int, ...]
    dtypes: tuple[str, ...]
    gpt_overrides: dict = dataclasses.field(default_factory=dict)

    def settings(self) -> list[Setting]:
        out = []
        for key in self.models:
            cfg = em.CONFIGS[key]
            if cfg.family == "gpt" and self.gpt_overrides:
                cfg = dataclasses.replace(cfg, **self.gpt_overrides)
                cfg = dataclasses.replace(cfg, name=f"{em.CONFIGS[key].name} ({cfg.depth} layers, seq {cfg.seq})")
            batches = self.vit_batches if cfg.family == "vit" else (1,)
            out += [Setting(cfg, b, d) for d in self.dtypes for b in batches]
        return out


PRESETS = {
    ("cpu", False): Plan(("vit-tiny", "vit-small", "vit-base", "gpt3-small", "gpt3-medium"), (1, 16, 64),
                         ("float32", "bfloat16")),
    # --quick on CPU: two small ViTs at batch 1 and 16, and GPT-3 Small's width with 4 of its 12
    # layers at sequence 256 (full vocabulary), in float32 and bfloat16.
    ("cpu", True): Plan(("vit-tiny", "vit-small", "gpt3-small"), (1, 16), ("float32", "bfloat16"),
                        {"depth": 4, "seq": 256}),
    ("cuda", False): Plan(("vit-tiny", "vit-small", "vit-base", "vit-large", "vit-huge", "gpt3-small",
                           "gpt3-medium"), (1, 16, 64), ("amp-bf16",)),
    ("cuda", True): Plan(("vit-tiny", "vit-base", "gpt3-small"), (1, 64), ("amp-bf16",)),
}


def plan(device: str = "cpu", quick: bool = False, models=None, batches=None, dtypes=None) -> Plan:
    """The preset for (device, quick), with any of models / ViT batch sizes / dtypes replaced."""
    base = PRESETS[("cuda" if device.startswith("cuda") else "cpu", quick)]
    for m in models or ():
        if m not in em.CONFIGS:
            raise NormfoldError(f"unknown model {m!r}; choose from {', '.join(em.CONFIGS)}")
    for d in dtypes or ():
        if d not in DTYPES:
            raise NormfoldError(f"unknown dtype {d!r}; choose from {', '.join(DTYPES)}")
        if DTYPES[d][1] is not None and not device.startswith("cuda"):
            raise NormfoldError(f"{d} (autocast) is for --device cuda; on CPU use float32 or bfloat16")
    return dataclasses.replace(base, models=tuple(models or base.models),
                               vit_batches=tuple(batches or base.vit_batches), dtypes=tuple(dtypes or base.dtypes))


def _forward(model, x, amp, device_type):
    ctx = torch.autocast(device_type, dtype=amp) if amp is not None else contextlib.nullcontext()

    def run():
        with ctx:
            return model(x)

    return run


CONTROL = "layernorm-copy"  # the A/A control: the Pre-LN model again, in memory of its own
CONTROL_LABEL = "Pre-LN copy (A/A)"


def _models(cfg, device: str, dtype: str, compile: bool) -> dict[str, torch.nn.Module]:
    param_dtype, _ = DTYPES[dtype]
    # Convert where the model will run (float64 algebra on a GPU is fast), then cast once.
    out = {k: m.to(dtype=param_dtype) for k, m in em.variants(em.build(cfg).to(device)).items()}
    out[CONTROL] = copy.deepcopy(out["layernorm"])
    if compile:
        out.update({f"{k}+compile": torch.compile(m) for k, m in list(out.items())})
    return out


def _row(setting: Setting, device: str, mode: str, stats: dict, suffix: str) -> dict:
    cfg = setting.cfg
    ln_stats = stats["layernorm" + suffix]
    ratio = {v: paired(stats[v + suffix], ln_stats) for v in (*em.VARIANTS, CONTROL)}
    row = {"model": cfg.name, "batch": setting.batch, "tokens": cfg.tokens(), "dtype": setting.dtype,
           "device": device, "mode": mode}
    for v in em.VARIANTS:
        row[f"{v}/ln"] = ratio[v].median
    gap = 1.0 - ratio["no-norm"].median
    for v in ("rmsnorm", "crmsnorm"):
        row[f"gap_captured_{v}"] = (1.0 - ratio[v].median) / gap if gap > 0 else math.nan
    row["rmsnorm/ln_q25"], row["rmsnorm/ln_q75"] = ratio["rmsnorm"].q25, ratio["rmsnorm"].q75
    row["aa/ln"], row["aa/ln_q25"], row["aa/ln_q75"] = (ratio[CONTROL].median, ratio[CONTROL].q25,
                                                         ratio[CONTROL].q75)
    row["rms_vs_ln"] = ratio_verdict(ratio["rmsnorm"])
    row["aa_vs_ln"] = ratio_verdict(ratio[CONTROL])  # anything but "same" is the machine's noise
    row["rounds"] = ln_stats.n
    for v in em.VARIANTS:
        s = stats[v + suffix]
        row[f"{v}_ms"], row[f"{v}_q25_ms"], row[f"{v}_q75_ms"] = s.median * 1e3, s.q25 * 1e3, s.q75 * 1e3
    return row


COLUMNS = ["model", "batch", "dtype", "mode", "no-norm/ln", "rmsnorm/ln", "rmsnorm/ln_q25", "rmsnorm/ln_q75",
           "crmsnorm/ln", "aa/ln", "layernorm_ms", "gap_captured_rmsnorm", "gap_captured_crmsnorm", "rms_vs_ln",
           "aa_vs_ln", "ln_norm_share", "norm rms/ln"]
NORM_VARIANTS = ("layernorm", "rmsnorm")
NORM_COLUMNS = ("ln_norm_ms", "rms_norm_ms", "norm rms/ln")


def _norm_time_columns(models: dict, cands: dict, repeats: int, tick, overhead: float) -> dict:
    """Time inside the norm modules per forward, Pre-LN against Pre-RMS (forward hooks, the two
    models' forwards interleaved and paired, as in `bench model`). It measures what the conversion
    saves on the norms themselves; the no-norm model's gap also drops the module calls and their
    output tensors, so it is not all norm time."""
    per = norm_times({k: (models[k], cands[k]) for k in NORM_VARIANTS}, repeats, tick, overhead)
    return dict(zip(NORM_COLUMNS, (median_ms(per["layernorm"]), median_ms(per["rmsnorm"]),
                                    paired_norm_ratio(per["rmsnorm"], per["layernorm"]))))


def _cost(s: Setting, device_type: str) -> float:
    """One forward's estimated cost, the weight of this setting's progress steps (GPT's head: every
    token times the vocabulary; ViT's: the class token only, negligible)."""
    cfg = s.cfg
    dtype = DTYPES[s.dtype][0] if device_type == "cpu" else torch.float32  # GPU: relative multiply-adds
    return forward_cost(cfg.dim, cfg.depth, cfg.mlp, cfg.tokens(), cfg.vocab if cfg.family == "gpt" else 0,
                        s.batch, dtype)


def run(out_dir="benchmarks", device: str = "cpu", quick: bool = False, rounds: int | None = None,
        compile: bool = False, progress: bool = True, models=None, batches=None, dtypes=None,
        settings: list[Setting] | None = None, seed: int = 0, min_time: float = 0.02):
    """Measure and write e2e.{csv,md,png}. Returns (rows, paths)."""
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise NormfoldError("--device cuda: no CUDA device is visible to torch")
    settings = settings if settings is not None else plan(device, quick, models, batches, dtypes).settings()
    # 15 rounds on CPU: the norms are 1-4 % of these forwards, about this machine's run-to-run
    # noise, and the paired verdict needs enough rounds to tell (five gave 'slower' on an A/A pair)
    rounds = rounds or (15 if device == "cpu" else (10 if quick else 30))
    machine = machine_info()
    machine["allocator"] = steady_allocator()  # no page faults inside the timings
    device_type = "cuda" if device.startswith("cuda") else "cpu"
    rows: list[dict] = []
    timed_norms = device_type == "cpu"  # host-side hooks would time CUDA launches, not kernels
    # One set of models per (config, dtype); batch sizes reuse them.
    groups: dict[tuple, list[Setting]] = {}
    for s in settings:
        groups.setdefault((s.cfg, s.dtype), []).append(s)
    # the bar's steps, weighted by their estimated cost: one per round of measure, one per hooked forward
    weights = []
    for s in (s for group in groups.values() for s in group):
        cost = _cost(s, device_type)
        weights += measure_weights(rounds, (len(em.VARIANTS) + 1) * (2 if compile else 1), cost, min_time, 2)  # + A/A
        weights += norm_times_weights(rounds, len(NORM_VARIANTS), cost) if timed_norms else []
    bar = Bar(len(weights), "bench e2e", enabled=progress, weights=weights)
    overhead = hook_overhead() if timed_norms else 0.0
    for (cfg, dtype), group in groups.items():
        with bar.paused():  # building and converting: outside the timed units' rate
            models = _models(cfg, device, dtype, compile)
        param_dtype, amp = DTYPES[dtype]
        for s in group:
            x = cfg.inputs(s.batch, torch.Generator().manual_seed(seed)).to(device)
            if x.is_floating_point():
                x = x.to(param_dtype)
            cands = {k: _forward(m, x, amp, device_type) for k, m in models.items()}
            with torch.inference_mode():
                stats = measure(cands, rounds=rounds, warmup=2, min_time=min_time, device=device_type,
                                tick=bar.step)
                norms = (_norm_time_columns(models, cands, rounds, bar.step, overhead) if timed_norms else
                         dict.fromkeys(NORM_COLUMNS, math.nan))
            rows.append(_row(s, device, "eager", stats, ""))
            rows[-1].update(norms, ln_norm_share=norms["ln_norm_ms"] / rows[-1]["layernorm_ms"])
            if compile:
                rows.append(_row(s, device, "compile", stats, "+compile"))
        del models
        gc.collect()
        if device_type == "cuda":
            torch.cuda.empty_cache()
    bar.close()
    paths = write(rows, "e2e", out_dir, machine, COLUMNS,
                  "End-to-end inference time normalized to Pre-LN (median; lower is better)",
                  plot=_plot, extra=summary(rows))
    return rows, paths


def summary(rows: list[dict]) -> str:
    """Paper 001 Table 3: the mean normalized time per (device, dtype, mode) over all settings."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["device"], r["dtype"], r["mode"]), []).append(r)
    head = ["setting", "settings", *(em.LABELS[v] for v in em.VARIANTS), "gap captured (RMS)",
            "gap captured (CRMS)", "RMS slower than LN", CONTROL_LABEL, "A/A flagged", "norms in Pre-LN forward",
            "norm time Pre-RMS / Pre-LN"]
    lines = ["#### Mean over settings (paper 001 Table 3 layout)", "",
             "| " + " | ".join(head) + " |", "|" + "|".join(" --- " for _ in head) + "|"]
    for (device, dtype, mode), rs in groups.items():
        mean = {v: _mean(r[f"{v}/ln"] for r in rs) for v in em.VARIANTS}
        cells = [f"{device}, {dtype}, {mode}", str(len(rs))]
        cells += [f"{mean[v]:.4f}" for v in em.VARIANTS]
        # from the means: per-setting ratios explode where LN and no-norm are within noise
        gap = 1.0 - mean["no-norm"]
        cells += [f"{(1.0 - mean[v]) / gap:.2f}" if gap > 0 else "n/a" for v in ("rmsnorm", "crmsnorm")]
        cells.append(f"{sum(r['rms_vs_ln'] == 'slower' for r in rs)} of {len(rs)}")
        cells.append(f"{_mean(r['aa/ln'] for r in rs):.4f}")
        cells.append(f"{sum(r['aa_vs_ln'] != 'same' for r in rs)} of {len(rs)}")
        share, norm_ratio = (_mean(r.get(k, math.nan) for r in rs) for k in ("ln_norm_share", "norm rms/ln"))
        cells.append("n/a" if math.isnan(share) else f"{share:.1%}")
        cells.append("n/a" if math.isnan(norm_ratio) else f"{norm_ratio:.2f}")
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    lines.append("Times are paired ratios to Pre-LN (per round, median over rounds). gap captured = "
                 "(LN − RMS) / (LN − no norm) from the mean ratios: the share of the normalization cost the "
                 "conversion removes (n/a when no-norm is not faster than LN). 'slower' counts settings where "
                 "RMS took longer than LN in more than three rounds of four (the paired ratio's lower "
                 f"quartile above 1). {CONTROL_LABEL} is the Pre-LN model again: 'A/A flagged' counts the "
                 "settings where that same test called two identical models different, i.e. how often the "
                 "verdict is noise on this machine. The last two columns come from forward hooks on the norm "
                 "modules (CPU, eager; Pre-LN and Pre-RMS forwards interleaved and paired): the share of the "
                 "Pre-LN forward spent in its norms, and what the same norms cost after conversion.")
    return "\n".join(lines) + "\n"


def _mean(values) -> float:
    vals = [v for v in values if not (isinstance(v, float) and math.isnan(v))]
    return sum(vals) / len(vals) if vals else math.nan


def _plot(rows, path, machine):
    import matplotlib.pyplot as plt

    labels = [f"{r['model'].replace(' (', chr(10) + '(')}\nb{r['batch']} {r['dtype']}"
              + ("\ncompile" if r["mode"] == "compile" else "") for r in rows]
    fig, ax = plt.subplots(figsize=(max(6, len(rows) * 1.1), 4))
    width = 0.2
    for i, v in enumerate(em.VARIANTS):
        xs = [j + (i - 1.5) * width for j in range(len(rows))]
        med = [r[f"{v}/ln"] for r in rows]
        lo = [(r[f"{v}_ms"] - r[f"{v}_q25_ms"]) / r["layernorm_ms"] for r in rows]
        hi = [(r[f"{v}_q75_ms"] - r[f"{v}_ms"]) / r["layernorm_ms"] for r in rows]
        ax.bar(xs, med, width, yerr=[lo, hi], capsize=2, label=em.LABELS[v])
    ax.axhline(1.0, color="grey", lw=0.8)
    meds = [r[f"{v}/ln"] for r in rows for v in em.VARIANTS]
    ax.set_ylim(max(0.0, min(meds) - 0.05), min(2.5, max(1.08, max(meds) + 0.05)))
    ax.set_xticks(list(range(len(rows))), labels, fontsize=6)
    ax.set_ylabel("inference time / Pre-LN")
    where = machine.get("gpu") or machine.get("cpu", "")
    ax.set_title(f"normalized inference time, median and quartiles ({where[:40]})", fontsize=9)
    ax.legend(fontsize=7, ncol=4)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
