"""Peak memory and time of `normfold verify` on a synthetic sharded checkpoint, measured from outside.

    python benchmarks/scripts/measure_blockverify.py --dir /tmp/nf-big --shape gpt2-large [--in-memory]

Builds (once) a random GPT-2-shaped float32 checkpoint in 500 MB shards and its in-memory conversion,
resharded the same way. Then it runs `normfold verify` in a child process under `/usr/bin/time -v`
and prints peak RSS and wall time, next to `import torch, transformers, normfold` alone and a plain
copy of the original's shards (the I/O floor). Building gpt2-large (3.1 GB) needs about 5 GB of memory.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

SHAPES = {"gpt2-medium": dict(n_embd=1024, n_layer=24, n_head=16),
          "gpt2-large": dict(n_embd=1280, n_layer=36, n_head=20)}


def build(root: Path, shape: str) -> None:
    import torch
    from safetensors.torch import load_file, save_file
    from transformers import GPT2Config, GPT2LMHeadModel

    import normfold

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=50257, n_positions=1024, **SHAPES[shape])).eval()
    with torch.no_grad():  # non-trivial norms, so that folding them matters
        for m in model.modules():
            if isinstance(m, torch.nn.LayerNorm):
                m.weight.normal_(1, 0.2)
                m.bias.normal_(0, 0.2)
    model.save_pretrained(root / "orig", max_shard_size="500MB")
    conv, report = normfold.convert(model, verify=False, inplace=True)
    del model
    out = normfold.save(conv, report, root / "conv")
    del conv
    state = load_file(str(out / "model.safetensors"))
    shards, cur, size = [], {}, 0
    for k in sorted(state):
        nb = state[k].numel() * state[k].element_size()
        if cur and size + nb > 500_000_000:
            shards.append(cur)
            cur, size = {}, 0
        cur[k], size = state[k], size + nb
    shards.append(cur)
    weight_map = {}
    for i, shard in enumerate(shards, 1):
        name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(out / name), metadata={"format": "pt"})
        weight_map.update({k: name for k in shard})
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (out / "model.safetensors").unlink()


def timed(cmd: list[str]) -> tuple[float, float, int]:
    """(peak RSS in GB, wall seconds, exit code) of `cmd`, from /usr/bin/time -v."""
    t = time.perf_counter()
    proc = subprocess.run(["/usr/bin/time", "-v", *cmd], capture_output=True, text=True)
    wall = time.perf_counter() - t
    rss = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", proc.stderr).group(1))
    return rss / 1e6, wall, proc.returncode


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", type=Path, required=True)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="gpt2-large")
    ap.add_argument("--in-memory", action="store_true", help="also time the in-memory path (needs ~6x the weights)")
    args = ap.parse_args()
    if not (args.dir / "conv" / "model.safetensors.index.json").is_file():
        shutil.rmtree(args.dir, ignore_errors=True)
        build(args.dir, args.shape)
    size = sum(f.stat().st_size for d in ("orig", "conv") for f in (args.dir / d).glob("*.safetensors")) / 1e9
    py = sys.executable
    runs = {"import torch+transformers+normfold": [py, "-c", "import torch, transformers, normfold"],
            "normfold verify --blockwise": [py, "-m", "normfold", "verify", str(args.dir / "orig"),
                                            str(args.dir / "conv"), "--blockwise", "-q"]}
    if args.in_memory:
        runs["normfold verify --no-blockwise"] = runs["normfold verify --blockwise"][:-2] + ["--no-blockwise", "-q"]
    copy = args.dir / "copy"
    shutil.rmtree(copy, ignore_errors=True)
    runs["cp -r orig (I/O floor)"] = ["cp", "-r", str(args.dir / "orig"), str(copy)]
    print(f"checkpoints: {size:.2f} GB of weights (original + converted)")
    for name, cmd in runs.items():
        rss, wall, rc = timed(cmd)
        print(f"{name:40s} peak RSS {rss:6.2f} GB  wall {wall:6.1f} s  rc {rc}")
    shutil.rmtree(copy, ignore_errors=True)


if __name__ == "__main__":
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    main()
