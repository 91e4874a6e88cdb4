"""`normfold bench quant --engine`: a tiny run through the whole suite (2 inputs, 1 timing round) writes
its tables with every form, stock's ratio to itself exactly 1, and KL computed as the float64 formula.
Measurements are the suite's business; nothing here asserts a quality or speed target."""

import csv

import pytest
import torch

pytest.importorskip("transformers")


def test_kl_is_the_float64_formula():
    from normfold.bench.quant_engine import kl_divergence

    torch.manual_seed(0)
    a, b = torch.randn(1, 5, 11), torch.randn(1, 5, 11)
    p, q = torch.softmax(a.double(), -1), torch.softmax(b.double(), -1)
    want = float((p * (p.log() - q.log())).sum(-1).mean())
    assert kl_divergence(a, b) == pytest.approx(want, rel=1e-12)
    assert kl_divergence(a, a) == pytest.approx(0.0, abs=1e-12)


@pytest.mark.parametrize("engine", ["ctranslate2", pytest.param("onnxruntime", marks=pytest.mark.slow)])
def test_engine_suite_writes_tables(engine, tmp_path):
    pytest.importorskip(engine)
    if engine == "onnxruntime":
        pytest.importorskip("onnxscript")
    from normfold.bench import quant_engine

    rows, speed, paths = quant_engine.run(engine, None, tmp_path, inputs=2, ctx=64, rounds=1, progress=False)
    forms = {r["form"] for r in rows}
    assert {"stock", "plain", "rotated", "stock+reduced", "plain+reduced", "rotated+reduced"} <= forms
    assert ("ln-folded" in forms) == (engine == "ctranslate2")
    for r in rows:
        assert r["kl_mean"] >= 0 and 0 <= r["top1_agree"] <= 1 and r["bytes"] > 0
        if r["form"] == "stock":
            assert r["kl_ratio_median"] == 1.0
    assert any(s["form"] == "stock (A/A)" for s in speed)
    with open(paths["csv"]) as f:
        assert len(list(csv.DictReader(f))) == len(rows)


@pytest.mark.parametrize("engine", ["ctranslate2", pytest.param("onnxruntime", marks=pytest.mark.slow)])
def test_engine_suite_gptq_rows(engine, tmp_path):
    """`bench quant --engine E --gptq`: the GPTQ forms are measured beside the engine's own and normfold's RTN ones,
    written as quant_<engine>_gptq.* (the int8 tables stay as they are)."""
    pytest.importorskip(engine)
    if engine == "onnxruntime":
        pytest.importorskip("onnxscript")
    from normfold.bench import quant_engine
    from normfold.bench.train import DEB_CACHE

    if not list(DEB_CACHE.glob("bible-kjv*.deb")) if DEB_CACHE.is_dir() else True:
        pytest.skip("no KJV text for the bundled calibration")
    rows, speed, paths = quant_engine.run(engine, None, tmp_path, inputs=2, ctx=64, rounds=1, progress=False,
                                          gptq=True, cal_windows=1)
    forms = {r["form"] for r in rows}
    if engine == "ctranslate2":
        want = {"stock", "plain+gptq", "rotated+gptq", "plain+gptq-reduced", "rotated+gptq-reduced", "rotated+reduced"}
    else:
        want = {"stock", "stock-int4", "plain-int4-rtn", "plain-int4-gptq", "rotated-int4-gptq", "original-int4-gptq"}
    assert want <= forms
    assert paths["csv"].endswith(f"quant_{engine}_gptq.csv") if isinstance(paths["csv"], str) else \
        paths["csv"].name == f"quant_{engine}_gptq.csv"
    for r in rows:
        assert r["kl_mean"] >= 0 and r["bytes"] > 0
        if r["form"] == "stock":
            assert r["kl_ratio_median"] == 1.0 and r["type"] == "int8"
