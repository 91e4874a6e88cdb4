"""`normfold bench`: every suite honours or refuses each option; the progress bar's time left."""

import pytest

from normfold.bench.timing import Bar
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


def test_progress_eta_follows_recent_step_times(monkeypatch):
    clock = [0.0]
    monkeypatch.setattr("normfold.bench.timing.time.perf_counter", lambda: clock[0])
    bar = Bar(100, "t", enabled=False)
    for _ in range(50):  # fast steps: 0.1 s each
        clock[0] += 0.1
        bar.step()
    assert bar.eta() == pytest.approx(5.0)
    for _ in range(Bar.RECENT):  # then 1 s each: the estimate follows, not the average so far
        clock[0] += 1.0
        bar.step()
    assert bar.eta() == pytest.approx(1.0 * (100 - 50 - Bar.RECENT))
    clock[0] += 6.0
    bar.step(3)  # a step worth 3 units
    assert bar.k == 50 + Bar.RECENT + 3
