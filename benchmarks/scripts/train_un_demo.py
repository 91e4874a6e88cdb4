"""Does Unified Normalization train? LayerNorm vs UN vs BN (and MABN, PN*) on a small byte-level GPT-2.

Task: next-byte prediction on Python's own standard-library source (offline, always present), a
real and structured text. Every run starts from the same initial weights; only the norm differs
(`normfold.unified.variant.swap_layernorms`). Offline norms are evaluated the way they are deployed: in eval
mode, with their running statistics (which is where BN-style train/eval mismatch shows).

    python benchmarks/scripts/train_un_demo.py                     # ~40 s on one idle CPU core
    python benchmarks/scripts/train_un_demo.py --methods ln un bn mabn pn --steps 200

Writes docs/un-training.png and docs/un-training.json (curves, final numbers, UN filtration counts).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]


def corpus(max_bytes: int = 3_000_000) -> tuple[torch.Tensor, torch.Tensor]:
    """Bytes of the stdlib's .py files (sorted, so the data is the same everywhere); files alternate
    between a train and a validation split (9:1)."""
    stdlib = Path(os.__file__).parent
    train, val, total = [], [], 0
    for i, f in enumerate(sorted(stdlib.glob("*.py"))):
        data = f.read_bytes()
        (val if i % 10 == 0 else train).append(data)
        total += len(data)
        if total >= max_bytes:
            break
    as_tensor = lambda parts: torch.frombuffer(bytearray(b"".join(parts)), dtype=torch.uint8).long()
    return as_tensor(train), as_tensor(val)


def batches(data: torch.Tensor, batch: int, seq: int, g: torch.Generator):
    while True:
        idx = torch.randint(0, len(data) - seq - 1, (batch,), generator=g)
        yield torch.stack([data[i:i + seq] for i in idx.tolist()])


def make_model(args):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(args.seed)
    cfg = GPT2Config(vocab_size=256, n_positions=args.seq, n_embd=args.width, n_layer=args.layers, n_head=4,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(cfg)


def with_norm(model, method: str, args):
    from normfold.unified.variant import swap_layernorms

    if method != "ln":
        opts = {"warmup": args.warmup, "M": args.window} if method == "un" else {"warmup": args.warmup}
        if method == "mabn":
            opts["M_grad"] = args.window
        swap_layernorms(model, method=method, **opts)
    return model


@torch.no_grad()
def evaluate(model, val_batches) -> float:
    model.eval()
    losses = [float(model(input_ids=b, labels=b).loss) for b in val_batches]
    model.train()
    return sum(losses) / len(losses)


def train(method: str, args, train_data, val_batches) -> dict:
    import copy

    model = with_norm(copy.deepcopy(args.init), method, args).train()
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01, betas=(0.9, 0.98))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 50))
    g = torch.Generator().manual_seed(args.seed + 1)  # same batches for every method
    stream = batches(train_data, args.batch, args.seq, g)
    curve, evals, t0 = [], [], time.perf_counter()
    for step in range(1, args.steps + 1):
        ids = next(stream)
        loss = model(input_ids=ids, labels=ids).loss
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        value = loss.item()
        curve.append(value if math.isfinite(value) else float("nan"))
        if step % args.eval_every == 0 or step == args.steps:
            evals.append((step, evaluate(model, val_batches)))
            print(f"  {method:5s} step {step:4d}  train {sum(curve[-args.eval_every:]) / len(curve[-args.eval_every:]):.3f}"
                  f"  eval {evals[-1][1]:.3f}  ({time.perf_counter() - t0:.0f}s)", flush=True)
    skipped = {n: int(m.skipped) for n, m in model.named_modules() if hasattr(m, "skipped") and m.method == "un"}
    return {"train": curve, "eval": evals, "seconds": time.perf_counter() - t0, "un_skipped_steps": skipped}


def smooth(xs, k=20):
    out, acc = [], []
    for x in xs:
        acc.append(x)
        acc = acc[-k:]
        good = [a for a in acc if math.isfinite(a)]
        out.append(sum(good) / len(good) if good else float("nan"))
    return out


def plot(results: dict, args, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = {"ln": "LayerNorm", "un": "UN", "bn": "BN", "mabn": "MABN", "pn": "PN*"}
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for m, r in results.items():
        a.plot(range(1, len(r["train"]) + 1), smooth(r["train"]), label=names[m])
        b.plot([s for s, _ in r["eval"]], [v for _, v in r["eval"]], marker="o", ms=3, label=names[m])
    a.set(title=f"training loss (moving average of 20 steps)", xlabel="step", ylabel="cross-entropy (nats/byte)")
    b.set(title="validation loss, eval mode (offline norms: running statistics)", xlabel="step")
    for ax in (a, b):
        ax.axvline(args.warmup, color="grey", lw=0.7, ls="--")
        ax.legend()
        ax.set_ylim(top=min(5.6, ax.get_ylim()[1]))
    fig.suptitle(f"byte-level GPT-2 ({args.layers} layers, width {args.width}) on Python stdlib source; "
                 f"batch {args.batch}x{args.seq}; dashed: end of warm-up", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--methods", nargs="+", default=["ln", "un", "bn"], help="ln un bn mabn pn")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--layers", type=int, default=3)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=60, help="offline norms' warm-up steps (paper: 4000 of ~100k)")
    p.add_argument("--window", type=int, default=4, help="UN's M (and MABN's SMAS window)")
    p.add_argument("--eval-every", type=int, default=50)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default=str(ROOT / "docs" / "un-training"))
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    train_data, val_data = corpus()
    gv = torch.Generator().manual_seed(12345)
    val_stream = batches(val_data, args.batch, args.seq, gv)
    val_batches = [next(val_stream) for _ in range(8)]
    args.init = make_model(args)
    print(f"train {len(train_data) / 1e6:.1f} MB, val {len(val_data) / 1e6:.2f} MB of stdlib source; "
          f"uniform model: {math.log(256):.3f} nats/byte")
    results = {}
    for m in args.methods:
        results[m] = train(m, args, train_data, val_batches)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    plot(results, args, out.with_suffix(".png"))
    settings = {k: v for k, v in vars(args).items() if k != "init"}
    summary = {m: {"final_eval": r["eval"][-1][1], "best_eval": min(v for _, v in r["eval"]),
                   "final_train_avg50": sum(r["train"][-50:]) / 50, "seconds": round(r["seconds"], 1),
                   "un_skipped_steps": r["un_skipped_steps"]} for m, r in results.items()}
    out.with_suffix(".json").write_text(json.dumps({"settings": settings, "summary": summary,
                                                    "curves": results}, indent=1) + "\n")
    print(json.dumps(summary, indent=1))
    print(f"written: {out.with_suffix('.png')}, {out.with_suffix('.json')}")


if __name__ == "__main__":
    main()
