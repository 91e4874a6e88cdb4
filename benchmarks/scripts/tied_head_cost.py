"""Cost of nn.TiedHead against the plain tied nn.Linear it replaces.

    python benchmarks/scripts/tied_head_cost.py [--tokens 64] [--rounds 25]

GPT-2 small's head shapes (vocab 50,257, d 768), float32, batch 1: the plain matmul, a second copy of it (the
A/A control), TiedHead (row-mean term added in place) and the out-of-place formula, timed by
normfold.bench.timing (interleaved rounds); per-round paired ratios to the plain matmul with their verdict.
Results: docs/verification.md#tied-embeddings-stay-tied.
"""

from __future__ import annotations

import argparse

import torch
from torch import nn

from normfold.bench import timing
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

    ref = "nn.Linear (tied, stock)"
    fs = {ref: plain, "A/A: the same Linear": plain, "TiedHead": head, "out-of-place formula": out_of_place}
    with torch.no_grad():
        stats = timing.measure({k: (lambda f=f: f(y)) for k, f in fs.items()}, rounds=args.rounds)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s), {args.tokens} tokens, {args.rounds} rounds")
    for k, st in stats.items():
        ratio = timing.paired(st, stats[ref])
        print(f"{k:26s} {st.median * 1e3:8.2f} ms  x{ratio.median:.3f} [{ratio.q25:.3f}, {ratio.q75:.3f}] "
              f"{timing.ratio_verdict(ratio) if k != ref else ''}")

if __name__ == "__main__":
    main()
