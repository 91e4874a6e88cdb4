"""`normfold bench onnx` runs end to end on a tiny GPT-2 (no timing assertions): every candidate is
exported, computes the original's function (except the no-norm floor) and gets a paired ratio."""

import csv

import pytest
import torch

from normfold.bench import onnxrt
from normfold.cli import main

transformers = pytest.importorskip("transformers")
for _m in ("onnx", "onnxscript", "onnxruntime"):
    pytest.importorskip(_m)


def test_onnx_suite_runs_on_a_tiny_gpt2(tmp_path, monkeypatch):
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=1, n_head=2)
    model = transformers.GPT2Model(cfg).eval()
    models = [("tiny-gpt2", model, {"input_ids": torch.randint(0, 64, (1, 8))}, 8)]
    monkeypatch.setattr(onnxrt, "OP_SHAPES", ((4, 24),))
    rows, paths = onnxrt.run(tmp_path, rounds=2, progress=False, models=models)
    r, ops = rows[0], rows[1:]
    for k in ("ln-copy", "rms", "rms-decomp", "rms-sln", "crms", "no-norm", "ln-opt"):
        assert r[f"{k}/ln_q25"] <= r[f"{k}/ln"] <= r[f"{k}/ln_q75"] and r[f"{k}/ln"] > 0
    assert r["rms_vs_ln"] in ("faster", "same", "slower") and r["aa_vs_ln"] in ("faster", "same", "slower")
    for k in ("rms", "rms-decomp", "rms-sln", "rms-opt"):  # the same function as the original, in onnxruntime
        assert float(r[f"{k}_err"]) <= 1e-5, (k, r[f"{k}_err"])
    # the single-op table: every norm form in onnxruntime, each against a float64 reference
    assert {o["op"] for o in ops} == set(onnxrt.OPS + onnxrt.FUSED)
    assert all(float(o["max_rel_err"]) <= 1e-5 and o["ratio_q25"] <= o["ratio_q75"] for o in ops)
    md = paths["md"].read_text()
    assert "Machine:" in md and "A/A control" in md and "| tiny-gpt2 | 8 |" in md
    assert "| 4x24 | SkipSimplifiedLayerNormalization |" in md and paths["ops_csv"].is_file()
    with open(paths["csv"]) as f:
        assert len(list(csv.DictReader(f))) == 1


def test_onnx_suite_refuses_options_it_ignores(capsys):
    assert main(["bench", "onnx", "--dtypes", "bfloat16", "-q"]) == 2
    assert "does not take --dtypes" in capsys.readouterr().err
