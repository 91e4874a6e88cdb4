"""Benchmark a fused UN model against its LayerNorm original at inference (CPU, or whatever torch
runs on here), with the no-norm model as the floor. Writes benchmarks/un.{csv,md,machine.json}.

    python scripts/bench_un.py                    # ViT-Ti/16 and a small GPT-2, batch 1 and 8
    python scripts/bench_un.py --quick            # batch 1 only, 5 rounds
    python scripts/bench_un.py --threads 2
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "benchmarks"))
    p.add_argument("--models", nargs="+", default=["vit-tiny", "gpt2-mini"])
    p.add_argument("--batches", nargs="+", type=int, default=[1, 8])
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--quick", action="store_true")
    p.add_argument("-q", "--quiet", action="store_true")
    args = p.parse_args()
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    if args.threads:
        torch.set_num_threads(args.threads)
    from normfold.bench import un

    batches, rounds = ((1,), 5) if args.quick else (tuple(args.batches), args.rounds)
    rows, paths = un.run(args.out, models=tuple(args.models), batches=batches, rounds=rounds, progress=not args.quiet)
    print(Path(paths["md"]).read_text())
    print("written: " + ", ".join(str(p) for p in paths.values()))


if __name__ == "__main__":
    main()
