"""`normfold bench hf`: inference time of real `transformers` models converted through the public API.

What users run is a `transformers` model taken through `normfold.convert` → `normfold.save` →
`normfold.load`, not the benchmark's own readable models (`bench e2e`, paper 001's Table 3). This
suite times exactly that, for ViT-S/16 (transformers `ViTForImageClassification`, hidden 384, 12
layers, 6 heads, batch 1) and a GPT-2 small shape with 4 of its layers (`GPT2LMHeadModel`, 768 wide,
12 heads, vocabulary 50257, 256 tokens, no KV cache), random weights, in float32 and bfloat16:

| candidate | what |
| --- | --- |
| original | the model as built (`nn.LayerNorm`) |
| A/A copy | a second, separately allocated copy of the original: the control |
| Pre-RMS | `normfold.convert(model, to="rmsnorm")`, saved, and reloaded with `normfold.load` |
| Pre-CRMS | the same with `to="crmsnorm"` (the d−1 stream) |
| no norm | the original with every LayerNorm replaced by the identity: not the same function, the floor |

Each round runs every candidate once, back to back, in rotating order; every time is divided by the
original's time **of the same round**, and the tables report the median (and quartiles) of those
per-round ratios. "gap captured" = (orig − conv) / (orig − floor) from the median ratios: the share
of what the norms cost that the conversion removes. The A/A row shows how large a difference this
machine invents between identical models. The norms' share of the original forward (and what the
converted norms cost in its place) comes from forward hooks, the two models' forwards interleaved
and paired (`bench model`'s method).
"""

from __future__ import annotations

import copy
import gc
import math
import tempfile
from dataclasses import dataclass, field

import torch
from torch import nn

from .model import hook_overhead, median_ms, norm_times, paired_norm_ratio
from .results import write
from .timing import (Bar, forward_cost, machine_info, measure, measure_weights, norm_times_weights, paired,
                     ratio_verdict, steady_allocator)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class HFCase:
    """One model shape: `family` 'vit' or 'gpt2', the config's keyword arguments, and the input size."""

    name: str
    family: str
    config: dict = field(default_factory=dict)
    batch: int = 1
    seq: int = 0  # gpt2: tokens per sequence

    def build(self, seed: int = 0) -> nn.Module:
        import transformers

        torch.manual_seed(seed)
        if self.family == "vit":
            model = transformers.ViTForImageClassification(transformers.ViTConfig(**self.config))
        elif self.family == "gpt2":
            model = transformers.GPT2LMHeadModel(transformers.GPT2Config(**self.config))
        else:
            raise ValueError(f"unknown family {self.family!r}")
        return model.eval()

    def forward_cost(self, dtype: torch.dtype) -> float:
        """Estimated seconds of one forward (progress lines only; `timing.forward_cost`)."""
        c = self.config
        if self.family == "vit":
            tokens = (c["image_size"] // c["patch_size"]) ** 2 + 1
            return forward_cost(c["hidden_size"], c["num_hidden_layers"], c["intermediate_size"], tokens, 0,
                                self.batch, dtype)
        return forward_cost(c["n_embd"], c["n_layer"], 4 * c["n_embd"], self.seq, c["vocab_size"], self.batch, dtype)

    def inputs(self, model: nn.Module, dtype: torch.dtype, seed: int = 0) -> dict:
        g = torch.Generator().manual_seed(seed)
        cfg = model.config
        if self.family == "vit":
            shape = (self.batch, cfg.num_channels, cfg.image_size, cfg.image_size)
            return {"pixel_values": torch.randn(shape, generator=g).to(dtype)}
        ids = torch.randint(0, cfg.vocab_size, (self.batch, self.seq), generator=g)
        return {"input_ids": ids, "use_cache": False}


VIT_S16 = HFCase("ViT-S/16", "vit", {"hidden_size": 384, "num_hidden_layers": 12, "num_attention_heads": 6,
                                     "intermediate_size": 1536, "image_size": 224, "patch_size": 16,
                                     "num_labels": 1000}, batch=1)
GPT2_4L = HFCase("GPT-2 small, 4 layers", "gpt2", {"n_embd": 768, "n_layer": 4, "n_head": 12,
                                                   "vocab_size": 50257, "n_positions": 1024}, batch=1, seq=256)
GPT2_12L = HFCase("GPT-2 small", "gpt2", {"n_embd": 768, "n_layer": 12, "n_head": 12, "vocab_size": 50257,
                                          "n_positions": 1024}, batch=1, seq=256)
VIT_S16_B16 = HFCase("ViT-S/16", "vit", dict(VIT_S16.config), batch=16)

# --quick: the four settings (two models × two dtypes); the full run adds GPT-2 small's 12
# layers and ViT-S/16 at batch 16.
QUICK = (VIT_S16, GPT2_4L)
FULL = (VIT_S16, VIT_S16_B16, GPT2_4L, GPT2_12L)

VARIANTS = ("original", "aa", "rmsnorm", "crmsnorm", "no-norm")
# optional candidates (run(variants=...)): the converted models loaded with normfold.load(fast=False)
EXTRA_VARIANTS = ("rmsnorm-plain", "crmsnorm-plain")
LABELS = {"original": "original (LayerNorm)", "aa": "original copy (A/A)", "rmsnorm": "Pre-RMS",
          "crmsnorm": "Pre-CRMS", "no-norm": "no norm (floor)", "rmsnorm-plain": "Pre-RMS, fast=False",
          "crmsnorm-plain": "Pre-CRMS, fast=False"}


def no_norm_copy(model: nn.Module) -> nn.Module:
    """A copy of `model` with every nn.LayerNorm replaced by nn.Identity (a different function: the
    speed floor that no norm can beat)."""
    out = copy.deepcopy(model)
    for mod in list(out.modules()):
        for name, child in list(mod.named_children()):
            if isinstance(child, nn.LayerNorm):
                setattr(mod, name, nn.Identity())
    return out


def converted(model: nn.Module, to: str, workdir: str, **load_kwargs) -> nn.Module:
    """`model` through the public API: normfold.convert → normfold.save → normfold.load."""
    from ..conversion import convert
    from ..io import load, save

    conv, report = convert(model, to=to, verify=False)
    path = f"{workdir}/{to}-{len(load_kwargs)}"
    save(conv, report, path, force=True)
    del conv
    return load(path, **load_kwargs)


def candidates(case: HFCase, dtype: torch.dtype, workdir: str, seed: int = 0,
               variants=VARIANTS) -> dict[str, nn.Module]:
    """The models of one setting, every one in `dtype` (conversion runs on the model in `dtype`:
    float64 algebra inside, rounded once, as a user converting a bf16 checkpoint gets)."""
    orig = case.build(seed).to(dtype)
    out: dict[str, nn.Module] = {"original": orig}
    for v in variants:
        if v == "aa":
            out[v] = copy.deepcopy(orig)
        elif v in ("rmsnorm", "crmsnorm"):
            out[v] = converted(orig, v, workdir)
        elif v in ("rmsnorm-plain", "crmsnorm-plain"):  # normfold.load(fast=False): no runtime fast paths
            out[v] = converted(orig, v.split("-")[0], workdir, fast=False)
        elif v == "no-norm":
            out[v] = no_norm_copy(orig)
        elif v != "original":
            raise ValueError(f"unknown variant {v!r}")
    return {k: m.eval() for k, m in out.items()}


def _norm_columns(models, cands, repeats, tick, overhead) -> dict:
    per = norm_times({k: (models[k], cands[k]) for k in ("original", "rmsnorm")}, repeats, tick, overhead)
    ln_ms, rms_ms = median_ms(per["original"]), median_ms(per["rmsnorm"])
    return {"ln_norm_ms": ln_ms, "rms_norm_ms": rms_ms,
            "norm rms/ln": paired_norm_ratio(per["rmsnorm"], per["original"])}


def _row(case: HFCase, dtype: str, stats: dict, variants) -> dict:
    ref = stats["original"]
    row = {"model": case.name, "batch": case.batch, "seq": case.seq or "", "dtype": dtype}
    ratio = {v: paired(stats[v], ref) for v in variants if v != "original"}
    for v, r in ratio.items():
        row[f"{v}/orig"], row[f"{v}/orig_q25"], row[f"{v}/orig_q75"] = r.median, r.q25, r.q75
        row[f"{v}_vs_orig"] = ratio_verdict(r)
    if "no-norm" in ratio:
        gap = 1.0 - ratio["no-norm"].median
        for v in ("rmsnorm", "crmsnorm"):
            if v in ratio:
                row[f"gap_{v}"] = (1.0 - ratio[v].median) / gap if gap > 0 else math.nan
    if "rmsnorm" in stats and "crmsnorm" in stats:
        r = paired(stats["crmsnorm"], stats["rmsnorm"])
        row["crms/rms"], row["crms_vs_rms"] = r.median, ratio_verdict(r)
    for v in variants:
        row[f"{v}_ms"] = stats[v].median * 1e3
    row["rounds"] = ref.n
    return row


COLUMNS = ["model", "batch", "seq", "dtype", "rmsnorm/orig", "crmsnorm/orig", "no-norm/orig", "aa/orig",
           "gap_rmsnorm", "gap_crmsnorm", "crms/rms", "rmsnorm_vs_orig", "crmsnorm_vs_orig", "aa_vs_orig",
           "original_ms", "ln_norm_share", "norm rms/ln"]


def run(out_dir="benchmarks", quick: bool = False, rounds: int | None = None, progress: bool = True,
        dtypes=None, cases=None, seed: int = 0, variants=VARIANTS, min_time: float = 0.0,
        norm_hooks: bool = True, device: str = "cpu"):
    """Measure and write hf.{csv,md,machine.json,png}. Returns (rows, paths).

    `device="cuda"`: every model is converted, saved and reloaded on the CPU (as a user does), then
    moved to the GPU; times come from synchronized wall clocks, and the norms' hook timings are
    skipped (host-side hooks would time kernel launches, not kernels)."""
    device_type = "cuda" if str(device).startswith("cuda") else "cpu"
    if device_type == "cuda" and not torch.cuda.is_available():
        from ..errors import NormfoldError

        raise NormfoldError("bench hf --device cuda: no CUDA device is visible to torch")
    cases = tuple(cases or (QUICK if quick else FULL))
    dtypes = tuple(dtypes or DTYPES)
    for d in dtypes:
        if d not in DTYPES:
            from ..errors import NormfoldError

            raise NormfoldError(f"bench hf: unknown dtype {d!r}; choose from {', '.join(DTYPES)}")
    variants = tuple(v for v in VARIANTS + EXTRA_VARIANTS if v in variants or v == "original")
    rounds = rounds or (21 if quick else 31)
    machine = machine_info()
    machine["allocator"] = steady_allocator()
    settings = [(c, d) for c in cases for d in dtypes]
    hooks = norm_hooks and "rmsnorm" in variants and device_type == "cpu"
    # the bar's steps, weighted by their estimated cost: one per round of measure, one per hooked forward
    weights = []
    for case, d in settings:
        cost = case.forward_cost(DTYPES[d] if device_type == "cpu" else torch.float32)
        weights += measure_weights(rounds, len(variants), cost, min_time, 2)
        weights += norm_times_weights(rounds, 2, cost) if hooks else []
    bar = Bar(len(weights), "bench hf", enabled=progress, weights=weights)
    overhead = hook_overhead() if hooks else 0.0
    rows = []
    with tempfile.TemporaryDirectory(prefix="normfold-bench-hf-") as work:
        for case, dname in settings:
            dtype = DTYPES[dname]
            with bar.paused():  # convert -> save -> load: outside the timed units' rate
                models = {k: m.to(device) for k, m in candidates(case, dtype, work, seed, variants).items()}
            x = {k: v.to(device) if isinstance(v, torch.Tensor) else v
                 for k, v in case.inputs(models["original"], dtype, seed).items()}
            cands = {k: (lambda m=m: m(**x)) for k, m in models.items()}
            with torch.inference_mode():
                stats = measure(cands, rounds=rounds, warmup=2, min_time=min_time, device=device_type,
                                tick=bar.step)
                norms = _norm_columns(models, cands, rounds, bar.step, overhead) if hooks else {}
            row = _row(case, dname, stats, list(models))
            row["device"] = device_type
            if norms:
                row.update(norms, ln_norm_share=norms["ln_norm_ms"] / row["original_ms"])
            rows.append(row)
            del models, cands
            gc.collect()
            if device_type == "cuda":
                torch.cuda.empty_cache()
    bar.close()
    paths = write(rows, "hf", out_dir, machine, COLUMNS,
                  "transformers models through normfold.convert → save → load: time / original "
                  "(median of per-round ratios; lower is better)", plot=_plot, extra=summary(rows))
    return rows, paths


def summary(rows: list[dict]) -> str:
    """Per dtype: the mean ratios over the settings and the gap captured from them (the target:
    ≥ 0.8 in each dtype, no setting slower than the original, Pre-CRMS ≤ Pre-RMS)."""
    head = ["dtype", "settings", "Pre-RMS", "Pre-CRMS", "no norm", "A/A copy", "gap captured (RMS)",
            "gap captured (CRMS)", "slower than original (RMS, CRMS)", "A/A flagged", "CRMS ≤ RMS",
            "norms in the forward", "norm time RMS/LN"]
    lines = ["#### Mean over settings", "", "| " + " | ".join(head) + " |", "|" + "|".join(" --- " for _ in head) + "|"]
    for dtype in dict.fromkeys(r["dtype"] for r in rows):
        rs = [r for r in rows if r["dtype"] == dtype]
        mean = {v: _mean(r.get(f"{v}/orig", math.nan) for r in rs) for v in ("rmsnorm", "crmsnorm", "no-norm", "aa")}
        gap = 1.0 - mean["no-norm"]
        cells = [dtype, str(len(rs))] + [_f(mean[v]) for v in ("rmsnorm", "crmsnorm", "no-norm", "aa")]
        cells += [f"{(1.0 - mean[v]) / gap:.2f}" if gap > 0 and not math.isnan(mean[v]) else "n/a"
                  for v in ("rmsnorm", "crmsnorm")]
        cells.append(f"{sum(r.get('rmsnorm_vs_orig') == 'slower' for r in rs)}, "
                     f"{sum(r.get('crmsnorm_vs_orig') == 'slower' for r in rs)} of {len(rs)}")
        cells.append(f"{sum(r.get('aa_vs_orig', 'same') != 'same' for r in rs)} of {len(rs)}")
        cells.append(f"{sum(r.get('crms_vs_rms') != 'slower' for r in rs)} of {len(rs)}")
        share, nr = (_mean(r.get(k, math.nan) for r in rs) for k in ("ln_norm_share", "norm rms/ln"))
        cells += ["n/a" if math.isnan(share) else f"{share:.1%}", "n/a" if math.isnan(nr) else f"{nr:.2f}"]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "X/orig: the median over rounds of each round's X / original time (every round runs each "
              "candidate once, back to back, in rotating order). gap captured = (1 − X) / (1 − no norm) from "
              "the mean ratios (n/a when the floor is not below the original). 'slower': X took longer than the "
              "original in more than three rounds of four (paired lower quartile > 1); 'A/A flagged': the same "
              "verdict on a second copy of the original, i.e. how often this machine invents a difference. "
              "'CRMS ≤ RMS': settings where Pre-CRMS was not slower than Pre-RMS by that rule. The last two "
              "columns come from forward hooks on the norm modules (original and Pre-RMS forwards interleaved "
              "and paired): the norms' share of the original forward, and what the converted norms cost "
              "in their place (fused add+norm modules include the residual add they absorb)."]
    return "\n".join(lines) + "\n"


def _f(v: float) -> str:
    return "n/a" if math.isnan(v) else f"{v:.3f}"


def _mean(values) -> float:
    vals = [v for v in values if not (isinstance(v, float) and math.isnan(v))]
    return sum(vals) / len(vals) if vals else math.nan


def _plot(rows, path, machine):
    import matplotlib.pyplot as plt

    shown = [v for v in ("rmsnorm", "crmsnorm", "no-norm", "aa") if any(f"{v}/orig" in r for r in rows)]
    labels = [f"{r['model']}\nb{r['batch']} {r['dtype']}" for r in rows]
    fig, ax = plt.subplots(figsize=(max(6, len(rows) * 1.6), 4))
    width = 0.8 / max(1, len(shown))
    for i, v in enumerate(shown):
        xs = [j + (i - (len(shown) - 1) / 2) * width for j in range(len(rows))]
        med = [r.get(f"{v}/orig", math.nan) for r in rows]
        lo = [r[f"{v}/orig"] - r[f"{v}/orig_q25"] if f"{v}/orig" in r else 0 for r in rows]
        hi = [r[f"{v}/orig_q75"] - r[f"{v}/orig"] if f"{v}/orig" in r else 0 for r in rows]
        ax.bar(xs, med, width, yerr=[lo, hi], capsize=2, label=LABELS[v])
    ax.axhline(1.0, color="grey", lw=0.8)
    meds = [r[f"{v}/orig"] for r in rows for v in shown if f"{v}/orig" in r]
    if meds:
        ax.set_ylim(max(0.0, min(meds) - 0.05), max(1.08, max(meds) + 0.05))
    ax.set_xticks(list(range(len(rows))), labels, fontsize=7)
    ax.set_ylabel("time / original (paired, median)")
    ax.set_title(f"transformers models via normfold.convert/save/load ({machine.get('cpu', '')[:40]})", fontsize=9)
    ax.legend(fontsize=7, ncol=4)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
