"""Cost of nn.TiedHead against the plain tied nn.Linear it replaces (issue 24 item 1).

    python benchmarks/scripts/tied_head_cost.py [--tokens 64] [--rounds 25]

GPT-2 small's head shapes (vocab 50,257, d 768), float32, batch 1: the plain matmul, TiedHead (row-mean
term added in place) and the out-of-place formula it replaced, timed in interleaved rounds; medians and
ratios to the plain matmul. Results: docs/verification.md#tied-embeddings-stay-tied.
"""

from __future__ import annotations

import argparse
import time

import torch
from torch import nn

from normfold.nn import TiedHead


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=25)
    args = p.parse_args()
    torch.manual_seed(0)
    vocab, d = 50257, 768
    table = nn.Embedding(vocab, d)
    plain = nn.Linear(d, vocab, bias=False)
    plain.weight = table.weight
    head = TiedHead(table, 0.01 * torch.randn(vocab))
    y = torch.randn(1, args.tokens, d)

    def out_of_place(x):
        out = nn.functional.linear(x, table.weight)
        return out + x.sum(-1, keepdim=True) * head.mean

    fs = {"nn.Linear (tied, stock)": plain, "TiedHead": head, "out-of-place formula": out_of_place}
    times = {k: [] for k in fs}
    with torch.no_grad():
        for f in fs.values():
            f(y), f(y)
        for _ in range(args.rounds):
            for k, f in fs.items():
                t0 = time.perf_counter()
                f(y)
                times[k].append(time.perf_counter() - t0)
    base = sorted(times["nn.Linear (tied, stock)"])[args.rounds // 2]
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s), {args.tokens} tokens, {args.rounds} rounds")
    for k, v in times.items():
        med = sorted(v)[args.rounds // 2]
        print(f"{k:26s} {med * 1e3:8.2f} ms  x{med / base:.3f}")


if __name__ == "__main__":
    main()
