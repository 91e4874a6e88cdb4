"""Where a prepared (θ → φ) Pre-RMS training step spends its time over the LayerNorm original
(docs/performance-breakdown.md, "Training step").

    python benchmarks/scripts/train_step_phi.py [ROUNDS] [VARIANTS]

One training step (forward + backward + AdamW) of the bundled GPT-2 (6L, d = 192, 8 × 256 tokens,
dropout 0), the models of `normfold bench train-speed`, every variant once per round in rotating
order. Reports, per variant, the median step (wall and process CPU) and the median of the per-round
ratios to `layernorm` with quartiles, and the thread CPU spent in φ: the `phi` calls of the forward
(compute φ = A·θ) and the VJP of the backward. Variants (comma-separated, default all):

- layernorm, layernorm-copy: the original and an A/A copy (what the machine invents);
- rms: `normfold.train.prepare(to="rmsnorm")` as it is;
- rms-reuse: the same with every recipe through the generic path (cached autograd graph, `Reuse`,
  one autograd.grad per parameter) — the code before `LinearPhi`;
- rms-nophi: φ := θ (no centring, no VJP): *not* LayerNorm training, only the step cost without the
  reparametrization, i.e. the floor the θ → φ step could reach.

Threads: OMP_NUM_THREADS (default 1: under load a descheduled 2-thread OpenMP team stalls whole
steps, CPU time does not count it).
"""

from __future__ import annotations

import collections
import os
import statistics
import sys
import time

import torch
from torch import nn

from normfold.bench.train import bundled_model, make_variant, optimizer
from normfold.train import phi as P
from normfold.train import swap as S

ALL = ("layernorm", "layernorm-copy", "rms", "rms-reuse", "rms-nophi")


def main(rounds: int, variants: list[str]) -> None:
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    base = bundled_model(0)
    for m in base.modules():
        if isinstance(m, nn.Dropout):
            m.p = 0.0
    ids = torch.randint(0, 2048, (8, 256), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "labels": ids}
    acc = collections.Counter()
    phi, linear = S.phi, P.Recipe.linear
    mode = ["rms"]

    def timed_phi(mod, attr):
        c = time.thread_time()
        try:
            return mod._parameters[attr] if mode[0] == "rms-nophi" else phi(mod, attr)
        finally:
            acc["phi_fwd"] += time.thread_time() - c

    S.phi = timed_phi
    for cls in (P.Reuse, P.LinearPhi):
        def bwd(ctx, g, f=cls.backward):
            c = time.thread_time()
            try:
                return f(ctx, g)
            finally:
                acc["phi_bwd"] += time.thread_time() - c
        cls.backward = staticmethod(bwd)

    steps = {}
    for v in variants:
        m = make_variant(base, "normfold-rmsnorm" if v.startswith("rms") else
                         ("layernorm-copy" if v == "layernorm-copy" else "layernorm")).train()
        opt = optimizer(m, 1e-4)

        def step(m=m, opt=opt, v=v):
            mode[0] = v
            P.Recipe.linear = property(lambda s: False) if v == "rms-reuse" else linear
            try:
                loss = m(**batch).loss
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
            finally:
                P.Recipe.linear = linear
        steps[v] = step
        for _ in range(2):
            step()
    wall = {v: [] for v in steps}
    cpu = {v: [] for v in steps}
    parts = {v: collections.defaultdict(list) for v in steps}
    for r in range(rounds):
        for v in variants[r % len(variants):] + variants[:r % len(variants)]:
            acc.clear()
            t, c = time.perf_counter(), time.process_time()
            steps[v]()
            wall[v].append(time.perf_counter() - t)
            cpu[v].append(time.process_time() - c)
            for k in ("phi_fwd", "phi_bwd"):
                parts[v][k].append(acc[k])
    print(f"{rounds} rounds, {torch.get_num_threads()} thread(s), load average at the end {os.getloadavg()}")
    print("| variant | wall ms | vs layernorm (wall) [q25, q75] | CPU ms | vs layernorm (CPU) [q25, q75] "
          "| φ forward ms | φ backward ms |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for v in variants:
        row = [v]
        for series in (wall, cpu):
            q = statistics.quantiles([a / b for a, b in zip(series[v], series["layernorm"])], n=4, method="inclusive")
            row += [f"{statistics.median(series[v]) * 1e3:.1f}", f"{q[1]:.3f} [{q[0]:.3f}, {q[2]:.3f}]"]
        row += [f"{statistics.median(parts[v][k]) * 1e3:.2f}" for k in ("phi_fwd", "phi_bwd")]
        print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 30,
         sys.argv[2].split(",") if len(sys.argv) > 2 else list(ALL))
