"""Write a synthetic sharded safetensors checkpoint with GPT-2-XL shapes, shard by shard (issue 11 targets).

    python scripts/make_synthetic_checkpoint.py OUT --dtype float32 --layers 24   # ~3.3 GB, 7 shards
    python scripts/make_synthetic_checkpoint.py OUT --dtype bfloat16 --layers 48  # ~3.1 GB (full GPT-2-XL)

Random weights (N(0, 0.02); LayerNorm γ = 1 + N(0, 0.1), β and biases N(0, 0.02)); the model is never built in
memory: names and shapes come from a meta-device model, and at most one shard (~--shard-mb) is held at a time.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--layers", type=int, default=48, help="GPT-2-XL has 48")
    p.add_argument("--width", type=int, default=1600)
    p.add_argument("--heads", type=int, default=25)
    p.add_argument("--vocab", type=int, default=50257)
    p.add_argument("--shard-mb", type=int, default=500)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)

    from safetensors.torch import save_file
    from transformers import GPT2Config, GPT2LMHeadModel

    dtype = getattr(torch, args.dtype)
    cfg = GPT2Config(n_embd=args.width, n_layer=args.layers, n_head=args.heads, vocab_size=args.vocab,
                     n_positions=1024, architectures=["GPT2LMHeadModel"])
    with torch.device("meta"):
        meta = GPT2LMHeadModel(cfg)
    meta.tie_weights()
    seen, entries = set(), []
    for name, t in meta.state_dict(keep_vars=True).items():  # tied lm_head.weight: stored once, as wte
        if id(t) not in seen:
            seen.add(id(t))
            entries.append((name, tuple(t.shape)))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=False)
    g = torch.Generator().manual_seed(args.seed)
    limit = args.shard_mb * 1024 * 1024
    shards, current, size = [], {}, 0

    def value(name: str, shape) -> torch.Tensor:
        if ".ln_" in name and name.endswith("weight"):
            return (1 + 0.1 * torch.randn(shape, generator=g)).to(dtype)
        return (0.02 * torch.randn(shape, generator=g)).to(dtype)

    def flush():
        nonlocal current, size
        if current:
            shards.append(current)
            fname = f"part-{len(shards):05d}.safetensors"
            save_file(current, str(out / fname), metadata={"format": "pt"})
            print(f"{fname}: {size / 1e9:.2f} GB, {len(current)} tensors", file=sys.stderr, flush=True)
            shards[-1] = (fname, list(current))
            current, size = {}, 0

    for name, shape in entries:
        t = value(name, shape)
        if size and size + t.nbytes > limit:
            flush()
        current[name] = t
        size += t.nbytes
    flush()
    n = len(shards)
    weight_map, total = {}, 0
    for i, (fname, names) in enumerate(shards):
        final = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
        os.rename(out / fname, out / final)
        weight_map.update({k: final for k in names})
        total += (out / final).stat().st_size
    (out / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2, sort_keys=True) + "\n")
    cfg.dtype = dtype
    cfg.save_pretrained(out)
    print(f"{out}: {total / 1e9:.2f} GB in {n} shards ({args.dtype})", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
