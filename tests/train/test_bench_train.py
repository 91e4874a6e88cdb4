"""`normfold bench train` / `train-speed` run end to end on tiny settings (numbers checked, never speed)."""

from __future__ import annotations

import csv

import pytest
import torch

from normfold.bench import train as btrain

TEXT = "\n".join(
    f"Genesis {c}\n" + "\n".join(f"  {v} And God said, Let there be light: and there was light, and the {c}th day {v}."
                                 for v in range(1, 30))
    for c in range(1, 45))


def test_bench_train_curves(tmp_path):
    pytest.importorskip("tokenizers")
    text = tmp_path / "kjv.txt"
    text.write_text(TEXT)
    table, paths = btrain.run(tmp_path / "out", steps=4, batch=2, ctx=16, eval_every=2, eval_windows=2, text=text,
                              progress=False)
    rows = list(csv.DictReader(open(paths["csv"])))
    assert len(rows) == 4 * len(btrain.VARIANTS)
    by = {t["variant"]: t for t in table}
    assert set(by) == set(btrain.VARIANTS)
    # float32: the normfold runs follow the LayerNorm run to rounding; the naive swap does not
    for v in ("normfold-rmsnorm", "normfold-crmsnorm"):
        assert by[v]["max_abs_train_loss_diff_vs_layernorm"] < 1e-4
    assert by["naive-rmsnorm"]["max_abs_train_loss_diff_vs_layernorm"] > 1e-4
    if "png" in paths:
        assert paths["png"].stat().st_size > 1000


def test_chapters_parser():
    chs = btrain.chapters("Genesis 1\n  1 In the beginning\n  2 And the earth\nGenesis 2\n  1 Thus the heavens\n")
    assert chs == ["In the beginning And the earth", "Thus the heavens"]


def test_train_speed_runs(tmp_path, monkeypatch):
    def tiny():
        import transformers

        cfg = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=24, n_layer=1, n_head=2)
        return transformers.GPT2LMHeadModel(cfg)

    def setups(quick=False):
        def batch(g):
            ids = torch.randint(0, 64, (2, 8), generator=g)
            return {"input_ids": ids, "labels": ids}
        yield "tiny", tiny, lambda g: batch(g)

    monkeypatch.setattr(btrain, "step_setups", setups)
    rows, paths = btrain.run_speed(tmp_path, rounds=2, compile=False, progress=False)
    assert [r["variant"] for r in rows] == list(btrain.SPEED_VARIANTS)
    assert rows[0]["vs_layernorm"] == 1.0 and rows[0]["verdict"] == ""
    assert all(r["q25_ms"] <= r["median_ms"] <= r["q75_ms"] for r in rows)
    assert all(r["vs_layernorm_q25"] <= r["vs_layernorm"] <= r["vs_layernorm_q75"] for r in rows)
    assert all(r["verdict"] in ("faster", "same", "slower") for r in rows[1:])
