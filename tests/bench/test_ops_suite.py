"""`normfold bench ops` runs end to end on tiny shapes (a smoke test: no timings are asserted)."""

import csv

from normfold.bench import ops as bench_ops


def test_ops_suite_writes_every_pass(tmp_path, monkeypatch):
    monkeypatch.setenv("NORMFOLD_BENCH_ALLOCATOR", "default")  # leave this process's malloc alone
    rows, paths = bench_ops.run(tmp_path, shapes=[(8, 32), (4, 31)], dtypes=("float32", "bfloat16"), rounds=2,
                                progress=False)
    assert [r["pass"] for r in rows].count("forward") == 4 and len(rows) == 12
    with open(paths["csv"]) as f:
        table = list(csv.DictReader(f))
    assert len(table) == 12 and {"pass", "rms/ln", "rms/copy", "target"} <= set(table[0])
    md = paths["md"].read_text()
    assert md.count("### ") == 3 and "Backward" in md and "Fused residual add" in md
    for r in rows:
        assert r["rms_norm_us"] > 0 and r["layer_norm_us"] > 0 and r["copy_us"] > 0
        assert r["backend"].startswith("cpu-kernel") or r["backend"] == "reference"
    assert all(r["target"] == "met" or r["target"].startswith("miss: ") for r in rows)
    # the backward's floor (two reads, one write) has its own columns there and only there
    for r in rows:
        if r["pass"] == "backward":
            assert r["floor_us"] > 0 and r["rms/floor"] == r["rms_norm_us"] / r["floor_us"]
        else:
            assert r["floor_us"] == ""
    assert "rms/floor" in md.split("### ")[2] and "floor = torch.add(dy, x" in md


def _row(ln, rms, copy):
    return {"layer_norm_us": ln, "rms_norm_us": rms, "copy_us": copy, "rms/ln": rms / ln, "rms/copy": rms / copy}


def test_target_column_follows_issue_12():
    t = bench_ops._target
    # forward: 0.6 x LayerNorm, or 1.15 x copy where LayerNorm is within 1/0.6 of a copy; always <= 1.5 x copy
    assert t("forward", _row(100, 59, 50)) == "met"
    assert t("forward", _row(100, 70, 50)) == "miss: ln>0.6"  # LayerNorm is 2 x copy: no floor exception
    assert t("forward", _row(100, 70, 65)) == "met"  # LayerNorm at 1.54 x copy, RMSNorm at 1.08 x copy
    assert t("forward", _row(100, 80, 65)) == "miss: ln>0.6 and copy>1.15"
    assert t("forward", _row(100, 59, 30)) == "miss: copy>1.5"
    # backward: 0.8 x LayerNorm's backward; fused add: 0.6 x add + LayerNorm
    assert t("backward", _row(100, 80, 10)) == "met" and t("backward", _row(100, 81, 10)) == "miss: ln>0.8"
    assert t("add", _row(100, 60, 10)) == "met" and t("add", _row(100, 61, 10)) == "miss: ln>0.6"
