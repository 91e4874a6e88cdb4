#!/usr/bin/env python3
"""Train normfold's bundled default model: a small GPT-2 on the King James Bible.

The text comes from Debian's ``bible-kjv-text`` package (the KJV text is in the public
domain; the package's retrieval program is GPL-2+, and we only run it to dump the text).
Nothing here needs the internet except Debian's package mirror, which this script uses
through ``apt-get download`` when no ``--text`` file is given.

    python scripts/train_default_model.py --out src/normfold/data/kjv-gpt2

Writes a Hugging Face model directory (config.json, model.safetensors, tokenizer files,
README.md with the data source, licence and validation perplexity, training_log.json).
Validation uses every 20th chapter, held out from training.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

HOLDOUT_EVERY = 20  # every 20th chapter is validation text


def dump_kjv_text(workdir: Path) -> str:
    """Download Debian's bible-kjv packages and dump the whole text with their `bible` tool."""
    for tool in ("apt-get", "dpkg"):
        if shutil.which(tool) is None:
            sys.exit(f"error: {tool} not found; pass --text with a plain-text KJV instead")
    subprocess.run(["apt-get", "download", "bible-kjv", "bible-kjv-text"], cwd=workdir, check=True)
    root = workdir / "root"
    for deb in workdir.glob("*.deb"):
        subprocess.run(["dpkg", "-x", str(deb), str(root)], check=True)
    out = subprocess.run(
        [str(root / "usr/bin/bible"), "-p", str(root / "usr/lib"), "-l100000", "Gen1:1-Rev22:21"],
        check=True, capture_output=True, text=True,
    )
    return out.stdout


def split_chapters(raw: str) -> list[str]:
    """Turn the `bible` dump into one string per chapter, verse numbers removed."""
    chapters, current = [], []
    for line in raw.splitlines():
        if re.fullmatch(r"[1-3A-Za-z ]+ \d+", line.strip()) and not line.startswith(" "):
            if current:
                chapters.append(" ".join(current))
            current = []
            continue
        line = re.sub(r"^\s*\d+\s+", "", line).strip()
        if line:
            current.append(line)
    if current:
        chapters.append(" ".join(current))
    return [re.sub(r"\s+", " ", c) for c in chapters]


def train_tokenizer(texts: list[str], vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def encode_stream(tok, texts: list[str], eot: int) -> torch.Tensor:
    ids: list[int] = []
    for t in texts:
        ids.extend(tok.encode(t).ids)
        ids.append(eot)
    return torch.tensor(ids, dtype=torch.long)


@torch.no_grad()
def evaluate(model, data: torch.Tensor, ctx: int, batch: int) -> float:
    """Mean next-token cross-entropy over non-overlapping windows of `data`."""
    model.eval()
    n = (data.numel() - 1) // ctx
    total, count = 0.0, 0
    for s in range(0, n, batch):
        idx = torch.arange(s, min(s + batch, n)) * ctx
        x = torch.stack([data[i : i + ctx] for i in idx])
        y = torch.stack([data[i + 1 : i + ctx + 1] for i in idx])
        logits = model(input_ids=x).logits
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="sum")
        total += loss.item()
        count += y.numel()
    model.train()
    return total / count


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True, help="output model directory")
    ap.add_argument("--text", type=Path, help="plain KJV text as printed by Debian's `bible` tool")
    ap.add_argument("--vocab", type=int, default=2048)
    ap.add_argument("--d-model", type=int, default=192)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--heads", type=int, default=6)
    ap.add_argument("--ctx", type=int, default=256)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--steps", type=int, default=1200)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    args = ap.parse_args()

    from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast

    torch.manual_seed(args.seed)
    random.seed(args.seed)
    torch.set_num_threads(args.threads)

    with tempfile.TemporaryDirectory() as tmp:
        raw = args.text.read_text() if args.text else dump_kjv_text(Path(tmp))
    chapters = split_chapters(raw)
    train_txt = [c for i, c in enumerate(chapters) if i % HOLDOUT_EVERY != HOLDOUT_EVERY - 1]
    val_txt = [c for i, c in enumerate(chapters) if i % HOLDOUT_EVERY == HOLDOUT_EVERY - 1]
    print(f"{len(chapters)} chapters: {len(train_txt)} train, {len(val_txt)} validation", flush=True)

    tok = train_tokenizer(train_txt, args.vocab)
    eot = tok.token_to_id("<|endoftext|>")
    train_ids = encode_stream(tok, train_txt, eot)
    val_ids = encode_stream(tok, val_txt, eot)
    print(f"tokens: {train_ids.numel()} train, {val_ids.numel()} validation", flush=True)

    cfg = GPT2Config(
        vocab_size=tok.get_vocab_size(), n_positions=args.ctx, n_embd=args.d_model,
        n_layer=args.layers, n_head=args.heads, bos_token_id=eot, eos_token_id=eot,
        tie_word_embeddings=True,
    )
    model = GPT2LMHeadModel(cfg)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"parameters: {n_params / 1e6:.2f} M", flush=True)

    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr, betas=(0.9, 0.95),
    )
    warmup = max(1, args.steps // 20)

    def lr_at(step: int) -> float:
        if step < warmup:
            return args.lr * (step + 1) / warmup
        frac = (step - warmup) / max(1, args.steps - warmup)
        return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))

    log = {"steps": [], "train_loss": [], "val_loss": []}
    model.train()
    t0 = time.time()
    gen = torch.Generator().manual_seed(args.seed)
    for step in range(args.steps):
        for g in opt.param_groups:
            g["lr"] = lr_at(step)
        starts = torch.randint(0, train_ids.numel() - args.ctx - 1, (args.batch,), generator=gen)
        x = torch.stack([train_ids[s : s + args.ctx] for s in starts])
        y = torch.stack([train_ids[s + 1 : s + args.ctx + 1] for s in starts])
        loss = torch.nn.functional.cross_entropy(model(input_ids=x).logits.flatten(0, 1), y.flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % 25 == 0:
            print(f"step {step:5d}  train {loss.item():.3f}  {time.time() - t0:6.0f}s", flush=True)
        if step % 200 == 0 or step == args.steps - 1:
            val = evaluate(model, val_ids, args.ctx, 16)
            log["steps"].append(step)
            log["train_loss"].append(loss.item())
            log["val_loss"].append(val)
            print(f"step {step:5d}  train {loss.item():.3f}  val {val:.3f}  ppl {math.exp(val):7.2f}"
                  f"  {time.time() - t0:6.0f}s", flush=True)

    val = evaluate(model, val_ids, args.ctx, 16)
    summary = {
        "validation_loss": val, "validation_perplexity": math.exp(val),
        "uniform_perplexity": float(cfg.vocab_size), "parameters": n_params,
        "train_tokens": train_ids.numel(), "validation_tokens": val_ids.numel(),
        "train_seconds": round(time.time() - t0), "args": {k: str(v) for k, v in vars(args).items()},
        "torch": torch.__version__,
    }
    print(json.dumps(summary, indent=2))

    args.out.mkdir(parents=True, exist_ok=True)
    model.eval()
    model.save_pretrained(args.out)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|endoftext|>", eos_token="<|endoftext|>",
        unk_token="<|endoftext|>", pad_token="<|endoftext|>", model_max_length=args.ctx,
    )
    fast.save_pretrained(args.out)
    (args.out / "training_log.json").write_text(json.dumps({**summary, "curve": log}, indent=1))
    (args.out / "README.md").write_text(MODEL_CARD.format(**summary, d=args.d_model, L=args.layers,
                                                          h=args.heads, ctx=args.ctx, steps=args.steps))


MODEL_CARD = """# kjv-gpt2: normfold's bundled default model

A GPT-2-architecture language model ({L} layers, d_model {d}, {h} heads, context {ctx},
{parameters} parameters, byte-level BPE vocabulary trained on the same text) trained from
scratch on the King James Version of the Bible for {steps} steps on a CPU.

- **Data**: the text of Debian's `bible-kjv-text` package (version 4.38), dumped with that
  package's `bible` program. The King James Version's copyright has expired (1611);
  the Debian package's copyright file states the text's copyright is expired. Every 20th
  chapter is held out for validation.
- **Validation perplexity**: {validation_perplexity:.2f} (a uniform model over the vocabulary:
  {uniform_perplexity:.0f}); validation loss {validation_loss:.4f} nats/token over
  {validation_tokens} held-out tokens.
- **Reproduce**: `python scripts/train_default_model.py --out DIR` ({train_seconds} s here).
- **Licence**: the weights are released under the same licence as normfold (MIT); the text
  they were trained on is in the public domain.
"""

if __name__ == "__main__":
    main()
