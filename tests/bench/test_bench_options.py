"""`normfold bench`: every suite honours or refuses each option; the progress bar's time left."""

import pytest
import torch

from normfold.bench.timing import Bar, forward_cost, measure_weights
from normfold.cli import main


@pytest.mark.parametrize("argv, refused", [
    (["bench", "model", "--models", "vit-tiny"], "--models"),
    (["bench", "model", "--compile"], "--compile"),
    (["bench", "ops", "--batches", "1"], "--batches"),
    (["bench", "ops", "--eager"], "--eager"),
    (["bench", "convert", "--dtypes", "float32"], "--dtypes"),
    (["bench", "un", "--dtypes", "float32"], "--dtypes"),
    (["bench", "ops", "somemodel"], "MODEL"),
])
def test_options_a_suite_does_not_honour_are_refused(argv, refused, capsys, tmp_path):
    assert main(argv + ["-q", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "does not take" in err and refused in err
    assert not any(tmp_path.iterdir())


def test_bad_dtype_is_refused(capsys, tmp_path):
    assert main(["bench", "model", "--dtypes", "float64", "-q", "--out", str(tmp_path)]) == 2
    assert "float64" in capsys.readouterr().err


def test_model_suite_honours_dtypes(monkeypatch, tmp_path):
    from normfold.bench import model

    seen = {}

    def fake_run(model_path, out, rounds, progress, **kw):
        seen.update(kw)
        raise SystemExit(0)

    monkeypatch.setattr(model, "run", fake_run)
    with pytest.raises(SystemExit):
        main(["bench", "model", "--dtypes", "float16,bfloat16", "-q", "--out", str(tmp_path)])
    assert seen["dtypes"] == ("float16", "bfloat16")


def _fake_clock(monkeypatch):
    clock = [0.0]
    monkeypatch.setattr("normfold.bench.timing.time.perf_counter", lambda: clock[0])
    return clock


def _etas(bar, clock, step_seconds, pause_at=None, pause=0.0):
    """Run the bar over steps of the given durations on a fake clock; the estimate after each step."""
    out = []
    for i, dt in enumerate(step_seconds):
        if i == pause_at:
            with bar.paused():  # untimed work between steps (building the next setting's models)
                clock[0] += pause
        clock[0] += dt
        bar.step()
        out.append(bar.eta())
    return out


def test_progress_eta_with_weights_does_not_jump_at_a_slow_setting(monkeypatch):
    # issue 26: 50 fast steps (0.1 s) then 50 slow ones (10 s, bfloat16 / a bigger model), with a 30 s
    # pause between them; the weights say the second half costs 100x per step
    clock = _fake_clock(monkeypatch)
    steps = [0.1] * 50 + [10.0] * 50
    bar = Bar(100, "t", enabled=False, weights=[1.0] * 50 + [100.0] * 50)
    etas = _etas(bar, clock, steps, pause_at=50, pause=30.0)
    truth = [sum(steps[i + 1:]) for i in range(100)]
    assert etas[0] == pytest.approx(truth[0], rel=0.05)  # right from the first step
    for a, b in zip(etas[:-2], etas[1:-1]):  # never a jump between consecutive lines
        assert b <= a * 1.15
    assert etas[-1] == 0.0
    # a weight off by 2x moves the estimate gradually, not in one jump
    clock[0] = 0.0
    bar = Bar(100, "t", enabled=False, weights=[1.0] * 50 + [50.0] * 50)
    etas = _etas(bar, clock, steps)
    ratios = [b / a for a, b in zip(etas[:-2], etas[1:-1])]
    # the first slow step shows the error (its 10 s double the elapsed time): one move of < 1.5x where
    # the step time grew 100x, then the estimate settles
    assert max(ratios) < 1.5
    assert sorted(ratios)[-2] < 1.1
    assert etas[0] < 0.6 * truth[0]  # the bad weight does show (the test sees it)


def test_progress_eta_without_weights_is_the_average_rate(monkeypatch):
    clock = _fake_clock(monkeypatch)
    bar = Bar(100, "t", enabled=False)
    etas = _etas(bar, clock, [0.1] * 50 + [1.0] * 20)
    assert etas[49] == pytest.approx(5.0)
    assert etas[-1] == pytest.approx((5.0 + 20.0) / 70 * 30)  # rises gradually with the slower steps
    assert max(b / a for a, b in zip(etas[49:-1], etas[50:])) < 1.2
    clock[0] += 6.0
    bar.step(3)  # a step worth 3 units
    assert bar.k == 73
    with pytest.raises(ValueError):
        Bar(3, "t", enabled=False, weights=[1.0])


def test_forward_cost_orders_settings():
    small = forward_cost(192, 12, 768, 197)
    big = forward_cost(1024, 24, 4096, 512, head_rows=50257)
    assert 0 < small < big
    assert forward_cost(384, 12, 1536, 197, batch=16) == pytest.approx(16 * forward_cost(384, 12, 1536, 197))
    assert forward_cost(384, 12, 1536, 197, dtype=torch.bfloat16) > 0


def test_measure_weights_carry_the_warm_up_and_min_time():
    w = measure_weights(5, 4, 0.1, 0.0, 2)
    assert w == pytest.approx([0.4 + 4 * 3 * 0.1] + [0.4] * 4)
    assert measure_weights(3, 2, 1e-4, 0.02, 2)[1] == pytest.approx(2 * 0.02)  # short calls: min_time a sample


def test_results_go_to_suite_machine_date_by_default():
    from normfold.bench.results import default_out, machine_tag

    epyc = {"cpu": "AMD EPYC 9R14 96-Core Processor", "normfold_cpu_isa": "avx2"}
    assert machine_tag(epyc) == "epyc-avx2"
    assert machine_tag({"cpu": "Intel(R) Xeon(R) Platinum 8480+", "normfold_cpu_isa": "avx512", "gpu": "H100"}) \
        == "xeon-avx512+gpu"
    assert machine_tag({"cpu": "", "normfold_cpu_isa": None}) == "cpu-portable"
    assert default_out("hf", epyc, "2026-12-07").as_posix() == "benchmarks/hf/epyc-avx2-2026-12-07"
