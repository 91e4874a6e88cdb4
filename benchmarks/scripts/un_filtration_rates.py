"""How often does UN's outlier filtration (Yang et al., "Unified Normalization for Accelerating and Stabilizing Transformers", eq. 19) fire on stationary data, under the
two readings of its threshold M·V(Ω_{t−1}^{1/2})?

- per channel: V is each channel's variance over the window's M steps;
- per layer (normfold's choice, and the authors' released code): V over all M·C entries.

Input: i.i.d. Gaussian tokens (nothing to filter), channels of equal scale or of log-normal scales
(as in trained transformers). A filtered step records the running σ² in the window (eq. 19 and the
authors' code). Prints the fraction of filtered steps; the table is in docs/unified-norm.md.

    python benchmarks/scripts/un_filtration_rates.py
"""

from __future__ import annotations

import torch


def rate(C: int, tokens: int, per_layer: bool, spread: bool, steps: int = 300, M: int = 4, alpha: float = 0.9,
         seed: int = 0) -> float:
    g = torch.Generator().manual_seed(seed)
    scale = torch.exp(torch.randn(C, generator=g, dtype=torch.float64)) if spread else torch.ones(C, dtype=torch.float64)
    window, running, fired = [], torch.ones(C, dtype=torch.float64), 0
    for _ in range(steps):
        var = (torch.randn(tokens, C, generator=g, dtype=torch.float64) * scale).square().mean(0)
        skip = False
        if len(window) >= M:
            prev = torch.stack(window[-M:])
            cur = torch.cat([prev[1:], var[None]])
            am_gm = cur.mean(0) - torch.exp(torch.log(cur).mean(0))
            roots = prev.sqrt()
            threshold = M * (roots.var(unbiased=False) if per_layer else roots.var(0, unbiased=False))
            skip = bool((am_gm > threshold).any())
        fired += skip
        window.append(running.clone() if skip else var)
        used = var if (skip or len(window) < M) else torch.exp(torch.log(torch.stack(window[-M:])).mean(0))
        running = alpha * running + (1 - alpha) * used
    return fired / steps


def main() -> None:
    torch.set_num_threads(1)  # small tensors: one thread is fastest
    print("| channels | tokens/batch | per channel, equal scales | per channel, spread scales "
          "| per layer, equal scales | per layer, spread scales |")
    print("| --- | --- | --- | --- | --- | --- |")
    for C in (1, 64, 384):
        for tokens in (64, 2048):
            r = [rate(C, tokens, per_layer, spread) for per_layer in (False, True) for spread in (False, True)]
            print(f"| {C} | {tokens} | " + " | ".join(f"{100 * x:.0f}%" for x in r) + " |")


if __name__ == "__main__":
    main()
