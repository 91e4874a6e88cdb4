"""Training with normfold.train: a real run (loss curves) and the step-time cost.

`normfold bench train` (paper 001 Figure 7 analogue): the bundled model's architecture (GPT-2, 6
layers, d = 192, its 2048-token tokenizer) from scratch on the King James Bible (Debian's
bible-kjv-text, the bundled model's data; every 20th chapter held out), four ways from the same
initial weights, the same batches and the same dropout masks:

- layernorm: the stock model;
- normfold Pre-RMSNorm / Pre-CRMSNorm: `normfold.train.prepare(model, to=...)` (θ trained, φ = h(θ));
- naive RMSNorm: every LayerNorm replaced by an RMSNorm with the same γ, β and no centring;
- layernorm-1ulp: the stock model with every initial weight moved by one float32 ulp at random (±):
  the float32 chaos floor, i.e. how far *any* rounding difference carries a float32 run.

The first three are the same optimization (float32: they drift apart by rounding only); the naive
swap is a different model. `normfold bench train-speed`: median time of one training step
(forward + backward + AdamW step) of the LayerNorm model vs the prepared models, eager and compiled.
"""

from __future__ import annotations

import copy
import math
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch
from torch import nn

from .results import write
from .timing import Bar, machine_info, measure, paired, ratio_verdict

VARIANTS = ("layernorm", "normfold-rmsnorm", "normfold-crmsnorm", "naive-rmsnorm", "layernorm-1ulp")
HOLDOUT_EVERY = 20
DEB_CACHE = Path("/var/cache/apt/archives")


# ---- data ---------------------------------------------------------------------------------------------

def kjv_text(text: str | Path | None = None) -> str:
    """The KJV as printed by Debian's `bible` tool (as scripts/train_default_model.py gets it): from
    `text`, or from the bible-kjv debs in apt's cache, or `apt-get download`ed."""
    if text is not None:
        return Path(text).read_text()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        debs = sorted(DEB_CACHE.glob("bible-kjv*.deb")) if DEB_CACHE.is_dir() else []
        if len({d.name.split("_")[0] for d in debs}) < 2:
            if shutil.which("apt-get") is None:
                raise RuntimeError("no KJV text: pass --text FILE (the `bible` tool's output)")
            subprocess.run(["apt-get", "download", "bible-kjv", "bible-kjv-text"], cwd=work, check=True,
                           capture_output=True)
            debs = sorted(work.glob("*.deb"))
        root = work / "root"
        for deb in debs:
            subprocess.run(["dpkg", "-x", str(deb), str(root)], check=True)
        out = subprocess.run([str(root / "usr/bin/bible"), "-p", str(root / "usr/lib"), "-l100000",
                              "Gen1:1-Rev22:21"], check=True, capture_output=True, text=True)
        return out.stdout


def chapters(raw: str) -> list[str]:
    import re

    out, cur = [], []
    for line in raw.splitlines():
        if re.fullmatch(r"[1-3A-Za-z ]+ \d+", line.strip()) and not line.startswith(" "):
            if cur:
                out.append(" ".join(cur))
            cur = []
            continue
        line = re.sub(r"^\s*\d+\s+", "", line).strip()
        if line:
            cur.append(line)
    if cur:
        out.append(" ".join(cur))
    return [re.sub(r"\s+", " ", c) for c in out]


def token_streams(text=None) -> tuple[torch.Tensor, torch.Tensor]:
    from tokenizers import Tokenizer

    from ..io import default_model_path

    tok = Tokenizer.from_file(str(default_model_path() / "tokenizer.json"))
    eot = tok.token_to_id("<|endoftext|>")
    chs = chapters(kjv_text(text))

    def enc(texts):
        ids = []
        for t, e in zip(texts, tok.encode_batch(texts)):
            ids += e.ids + [eot]
        return torch.tensor(ids, dtype=torch.long)

    train = [c for i, c in enumerate(chs) if i % HOLDOUT_EVERY != HOLDOUT_EVERY - 1]
    val = [c for i, c in enumerate(chs) if i % HOLDOUT_EVERY == HOLDOUT_EVERY - 1]
    return enc(train), enc(val)


# ---- models -----------------------------------------------------------------------------------------------

class NaiveRMSNorm(nn.Module):
    """RMSNorm with the LayerNorm's γ and β on the uncentred stream (what a plain swap does)."""

    def __init__(self, ln: nn.LayerNorm):
        super().__init__()
        self.weight = nn.Parameter(ln.weight.detach().clone())
        self.bias = nn.Parameter(ln.bias.detach().clone())
        self.eps = ln.eps

    def forward(self, x):
        return nn.functional.rms_norm(x, x.shape[-1:], self.weight, self.eps) + self.bias


def naive_swap(model: nn.Module) -> nn.Module:
    for m in list(model.modules()):
        for name, child in list(m.named_children()):
            if isinstance(child, nn.LayerNorm):
                setattr(m, name, NaiveRMSNorm(child))
    return model


def bundled_model(seed: int = 0, ctx: int | None = None) -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    from ..io import default_model_path

    cfg = GPT2Config.from_pretrained(default_model_path())
    if ctx:
        cfg.n_positions = ctx
    torch.manual_seed(seed)
    return GPT2LMHeadModel(cfg)


def make_variant(base: nn.Module, name: str) -> nn.Module:
    from .. import train

    m = copy.deepcopy(base)
    if name in ("normfold-rmsnorm", "normfold-crmsnorm"):
        train.prepare(m, to=name.split("-")[1])
    elif name in ("normfold-rmsnorm-unfused", "normfold-crmsnorm-unfused"):  # transformers' own block code
        train.prepare(m, to=name.split("-")[1], fast=False)
    elif name == "naive-rmsnorm":
        naive_swap(m)
    elif name == "layernorm-1ulp":
        g = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for p in m.parameters():
                flip = torch.randint(0, 2, p.shape, generator=g).to(p.dtype) * 2 - 1
                p.copy_(torch.nextafter(p, p + flip * torch.inf))
    return m


def optimizer(model: nn.Module, lr: float):
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                             lr=lr, betas=(0.9, 0.95))


# ---- the run --------------------------------------------------------------------------------------------------

@torch.no_grad()
def evaluate(model, data: torch.Tensor, ctx: int, windows: int) -> float:
    model.eval()
    starts = torch.arange(windows) * ctx
    x = torch.stack([data[s:s + ctx] for s in starts])
    y = torch.stack([data[s + 1:s + ctx + 1] for s in starts])
    loss = nn.functional.cross_entropy(model(input_ids=x).logits.flatten(0, 1), y.flatten()).item()
    model.train()
    return loss


def run(out_dir, *, steps: int = 120, batch: int = 8, ctx: int = 64, lr: float = 1e-3, eval_every: int = 20,
        eval_windows: int = 24, seed: int = 0, text=None, progress: bool = True, variants=VARIANTS):
    train_ids, val_ids = token_streams(text)
    base = bundled_model(seed, ctx)
    models = {v: make_variant(base, v) for v in variants}
    opts = {v: optimizer(m, lr) for v, m in models.items()}
    warmup = max(1, steps // 8)

    def lr_at(step):
        if step < warmup:
            return lr * (step + 1) / warmup
        return lr * (0.1 + 0.45 * (1 + math.cos(math.pi * (step - warmup) / max(1, steps - warmup))))

    gen = torch.Generator().manual_seed(seed)
    rows = []
    bar = Bar(steps * len(models), "train", progress)
    for step in range(steps):
        starts = torch.randint(0, train_ids.numel() - ctx - 1, (batch,), generator=gen)
        x = torch.stack([train_ids[s:s + ctx] for s in starts])
        y = torch.stack([train_ids[s + 1:s + ctx + 1] for s in starts])
        for v, m in models.items():
            for g in opts[v].param_groups:
                g["lr"] = lr_at(step)
            torch.manual_seed(seed * 100003 + step)  # the same dropout masks for every variant
            loss = nn.functional.cross_entropy(m(input_ids=x).logits.flatten(0, 1), y.flatten())
            opts[v].zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
            opts[v].step()
            val = evaluate(m, val_ids, ctx, eval_windows) if (step % eval_every == 0 or step == steps - 1) else None
            rows.append({"step": step + 1, "variant": v, "train_loss": loss.item(), "val_loss": val})
            bar.step()
    bar.close()
    return _write_run(rows, out_dir, dict(steps=steps, batch=batch, ctx=ctx, lr=lr, seed=seed))


def _summary(rows: list[dict]) -> tuple[list[dict], str]:
    by = {}
    for r in rows:
        by.setdefault(r["variant"], []).append(r)
    ln = by["layernorm"]
    table = []
    for v, rs in by.items():
        d_train = max(abs(a["train_loss"] - b["train_loss"]) for a, b in zip(rs, ln))
        vals = [(a["val_loss"], b["val_loss"]) for a, b in zip(rs, ln) if a["val_loss"] is not None]
        table.append({"variant": v, "final_train_loss": rs[-1]["train_loss"], "final_val_loss": vals[-1][0],
                      "max_abs_train_loss_diff_vs_layernorm": d_train,
                      "max_abs_val_loss_diff_vs_layernorm": max(abs(a - b) for a, b in vals)})
    lines = ["| variant | final train loss | final val loss | max abs train-loss diff vs LN | max abs val-loss diff vs LN |",
             "| --- | --- | --- | --- | --- |"]
    for t in table:
        lines.append(f"| {t['variant']} | {t['final_train_loss']:.4f} | {t['final_val_loss']:.4f} | "
                     f"{t['max_abs_train_loss_diff_vs_layernorm']:.2e} | {t['max_abs_val_loss_diff_vs_layernorm']:.2e} |")
    return table, "\n".join(lines) + "\n"


def _write_run(rows, out_dir, params):
    machine = machine_info()
    machine["run"] = params
    table, md = _summary(rows)

    def plot(rows, path, machine):
        import matplotlib.pyplot as plt

        fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.2))
        style = {"layernorm": ("k", "-", 3.0), "normfold-rmsnorm": ("tab:blue", "--", 1.6),
                 "normfold-crmsnorm": ("tab:orange", ":", 1.6), "naive-rmsnorm": ("tab:red", "-", 1.0),
                 "layernorm-1ulp": ("tab:gray", "-", 0.8)}
        by = {}
        for r in rows:
            by.setdefault(r["variant"], []).append(r)
        for v, rs in by.items():
            c, ls, lw = style.get(v, ("gray", "-", 1))
            a.plot([r["step"] for r in rs], [r["train_loss"] for r in rs], color=c, ls=ls, lw=lw, label=v + " (train)")
            ev = [r for r in rs if r["val_loss"] is not None]
            a.plot([r["step"] for r in ev], [r["val_loss"] for r in ev], color=c, ls=ls, lw=lw, marker="o", ms=3,
                   alpha=0.6)
            if v != "layernorm":
                d = [max(abs(x["train_loss"] - y["train_loss"]), 1e-9) for x, y in zip(rs, by["layernorm"])]
                b.semilogy([r["step"] for r in rs], d, color=c, ls="-", lw=1, label=v)
        a.set_xlabel("optimizer step")
        a.set_ylabel("cross-entropy (nats/token); dots: held-out")
        a.set_title("bundled-model architecture on the KJV, from scratch")
        a.legend(fontsize=8)
        b.set_xlabel("optimizer step")
        b.set_ylabel("|train loss − LayerNorm train loss|")
        b.set_title("distance to the LayerNorm run (float32)")
        b.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)

    cols = ["step", "variant", "train_loss", "val_loss"]
    paths = write(rows, "train-loss", out_dir, machine, cols, "Training from scratch: LayerNorm vs normfold vs naive",
                  plot=plot, extra="\n" + md)
    # the markdown's main table is long; keep the summary at the top for humans
    text = Path(paths["md"]).read_text()
    Path(paths["md"]).write_text(md + "\n" + text)
    return table, paths


# ---- step time -------------------------------------------------------------------------------------------------

def vit_small():
    """ViT-S/16 at 224x224 (paper 001 Table 2): 12 layers, width 384, 6 heads, 197 tokens."""
    from transformers import ViTConfig, ViTForImageClassification

    cfg = ViTConfig(image_size=224, patch_size=16, hidden_size=384, num_hidden_layers=12, num_attention_heads=6,
                    intermediate_size=1536, num_labels=1000, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    torch.manual_seed(0)
    return ViTForImageClassification(cfg)


def step_setups(quick: bool = False):
    """(name, model factory, batch factory, batch size label)."""
    def gpt(b, ctx=256):
        def batch(g):
            ids = torch.randint(0, 2048, (b, ctx), generator=g)
            return {"input_ids": ids, "labels": ids}
        return batch

    def vit(b):
        def batch(g):
            return {"pixel_values": torch.randn(b, 3, 224, 224, generator=g), "labels": torch.randint(0, 1000, (b,), generator=g)}
        return batch

    yield "bundled GPT-2 (6L, d=192), 8x256", lambda: bundled_model(0), gpt(8)
    if not quick:
        yield "ViT-S/16, batch 8", vit_small, vit(8)


# "layernorm-copy": a second, separately allocated LayerNorm model (the A/A control: the difference
# this machine invents between identical models); "-unfused": prepared with fast=False.
SPEED_VARIANTS = ("layernorm", "layernorm-copy", "normfold-rmsnorm", "normfold-rmsnorm-unfused", "normfold-crmsnorm",
                  "normfold-crmsnorm-unfused")


def run_speed(out_dir, *, rounds: int = 15, quick: bool = False, compile: bool = True, progress: bool = True,
              dropout: bool = False):
    """Eager settings first, then compiled ones; the tables are rewritten after every setting, so an
    interrupted run keeps what it measured."""
    rows = []
    setups = list(step_setups(quick))
    modes = ["eager"] + (["compiled"] if compile else [])
    cols = ["model", "mode", "variant", "median_ms", "q25_ms", "q75_ms", "vs_layernorm", "vs_layernorm_q25",
            "vs_layernorm_q75", "verdict"]
    machine = machine_info()
    name = "train-speed-dropout" if dropout else "train-speed"
    title = ("Training step time (forward + backward + AdamW), LayerNorm vs prepared"
             + (" (dropout 0.1 kept)" if dropout else ""))
    bar = Bar(len(setups) * len(modes), "train-speed", progress)
    paths = None
    for mode in modes:
        for label, factory, batch_fn in setups:
            base = factory()
            if not dropout:
                for m in base.modules():
                    if isinstance(m, nn.Dropout):
                        m.p = 0.0
            batch = batch_fn(torch.Generator().manual_seed(0))
            cands = {}
            for v in SPEED_VARIANTS:
                m = make_variant(base, v).train()
                fwd = torch.compile(m) if mode == "compiled" else m
                opt = optimizer(m, 1e-4)

                def step(fwd=fwd, opt=opt):
                    loss = fwd(**batch).loss
                    loss.backward()
                    opt.step()
                    opt.zero_grad(set_to_none=True)

                cands[v] = step
            stats = measure(cands, rounds=rounds, warmup=2 if mode == "eager" else 3, min_time=0)
            ln = stats["layernorm"]
            for v, st in stats.items():
                r = paired(st, ln)  # per-round ratios: each round times every variant once, back to back
                rows.append({"model": label, "mode": mode, "variant": v, "median_ms": st.median * 1e3,
                             "q25_ms": st.q25 * 1e3, "q75_ms": st.q75 * 1e3, "vs_layernorm": r.median,
                             "vs_layernorm_q25": r.q25, "vs_layernorm_q75": r.q75,
                             "verdict": ratio_verdict(r) if v != "layernorm" else ""})
            paths = write(rows, name, out_dir, machine, cols, title)
            bar.step()
    bar.close()
    return rows, paths
