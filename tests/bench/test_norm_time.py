"""`bench model`'s per-norm timing (normfold.bench.model.norm_time) on a fake clock: the hooks' own
cost is measured and taken off every call, and a slow outlier forward does not move the result."""

import time

import torch

from normfold.bench import model as bench_model


class Clock:
    """perf_counter that advances 1 µs per reading, plus whatever a module's forward spends."""

    def __init__(self):
        self.now = 0.0

    def __call__(self):
        self.now += 1e-6
        return self.now


class SlowLayerNorm(torch.nn.LayerNorm):
    def __init__(self, d, clock, cost):
        super().__init__(d)
        self.clock, self.cost = clock, cost

    def forward(self, x):
        self.clock.now += self.cost[0]
        return super().forward(x)


def test_norm_time_takes_off_the_hook_cost_and_ignores_an_outlier(monkeypatch):
    clock, cost = Clock(), [100e-6]
    monkeypatch.setattr(time, "perf_counter", clock)
    overhead = bench_model.hook_overhead(repeats=50)
    assert abs(overhead - 1e-6) < 1e-12  # two readings around an Identity: one tick
    model = torch.nn.Sequential(*(SlowLayerNorm(8, clock, cost) for _ in range(3)), torch.nn.Linear(8, 8))
    x = torch.randn(2, 8)
    forwards = [0]

    def run():
        forwards[0] += 1
        cost[0] = 50e-3 if forwards[0] == 4 else 100e-6  # one forward hit by a 50 ms stall
        model(x)

    ms = bench_model.norm_time(model, run, repeats=9, overhead=overhead)
    assert abs(ms - 0.3) < 1e-9, ms  # 3 norms x 100 µs; the ticks the hooks add are taken off
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())  # hooks removed


def test_norm_times_interleave_the_models_and_pair_their_forwards(monkeypatch):
    # The machine slows down steadily (every norm call costs more than the last). Run one model's
    # forwards after the other's and the later one looks slower; interleaved, forward i of each
    # sees the same machine, and the paired ratio is the true 0.5.
    clock = Clock()
    monkeypatch.setattr(time, "perf_counter", clock)
    calls = [0]

    class Drifting(torch.nn.LayerNorm):
        def __init__(self, d, scale):
            super().__init__(d)
            self.scale = scale

        def forward(self, x):
            calls[0] += 1
            clock.now += self.scale * 100e-6 * (1 + calls[0] // 2 * 0.1)  # both models' k-th call alike
            return super().forward(x)

    fast, slow = Drifting(8, 0.5), Drifting(8, 1.0)
    x = torch.randn(2, 8)
    order = []
    runs = {"original": (slow, lambda: (order.append("o"), slow(x))),
            "converted": (fast, lambda: (order.append("c"), fast(x)))}
    per_forward = bench_model.norm_times(runs, repeats=20, overhead=1e-6)
    assert order[2:6] == ["o", "c", "c", "o"]  # warm-ups, then rotating order
    assert all(len(v) == 20 for v in per_forward.values())
    ratios = [c / o for c, o in zip(per_forward["converted"], per_forward["original"])]
    assert max(abs(r - 0.5) for r in ratios) < 0.06  # each pair saw (nearly) the same machine
    assert abs(bench_model.paired_norm_ratio(per_forward["converted"], per_forward["original"]) - 0.5) < 0.03
    assert not fast._forward_hooks and not slow._forward_pre_hooks
