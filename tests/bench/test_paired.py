"""Paired per-round ratios (bench.timing.paired) and the verdict drawn from them."""

import pytest

from normfold.bench.timing import Stats, measure, paired, ratio_verdict


def test_paired_ratio_is_taken_round_by_round():
    r = paired(Stats.of([2.0, 4.0, 6.0, 8.0]), Stats.of([1.0, 2.0, 3.0, 4.0]))
    assert (r.q25, r.median, r.q75, r.n) == (2.0, 2.0, 2.0, 4)


def test_drift_that_moves_both_cancels():
    # A machine slowing down over the run: every round the test is 10 % faster than the reference,
    # yet the two quartile ranges overlap widely. The paired ratio sees the 10 % in every round.
    ref = [1.0 + 0.5 * i for i in range(20)]
    test = [0.9 * t for t in ref]
    a, b = Stats.of(test), Stats.of(ref)
    assert a.q75 > b.q25  # unpaired quartiles overlap: no verdict possible
    r = paired(a, b)
    assert r.median == pytest.approx(0.9) and r.q75 == pytest.approx(0.9)
    assert ratio_verdict(r) == "faster"


def test_verdict_needs_three_rounds_in_four():
    assert ratio_verdict(Stats.of([1.1] * 8)) == "slower"
    assert ratio_verdict(Stats.of([0.95] * 8)) == "faster"
    # slower in half the rounds only: not a verdict
    assert ratio_verdict(Stats.of([0.98, 1.02] * 4)) == "same"


def test_paired_refuses_unpaired_stats():
    with pytest.raises(ValueError, match="per-round samples"):
        paired(Stats(1.0, 1.0, 1.0, 3), Stats.of([1.0, 1.0, 1.0]))
    with pytest.raises(ValueError):
        paired(Stats.of([1.0, 2.0]), Stats.of([1.0, 2.0, 3.0]))


def test_measure_keeps_samples_in_round_order():
    calls = []
    stats = measure({"a": lambda: calls.append("a"), "b": lambda: calls.append("b")}, rounds=5, warmup=0,
                    min_time=0)
    assert all(s.n == 5 and len(s.samples) == 5 for s in stats.values())
    assert paired(stats["a"], stats["b"]).n == 5


def test_bench_model_verdict_is_paired():
    from normfold.bench.model import verdict

    ref = [1.0 + 0.5 * i for i in range(12)]  # a drifting machine
    assert verdict(Stats.of([1.05 * t for t in ref]), Stats.of(ref)) == "slower"
    assert verdict(Stats.of(ref), Stats.of(list(ref))) == "same (within noise)"
