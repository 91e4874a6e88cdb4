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
    assert all(r["target"] in ("met", "") or r["target"].startswith("miss") for r in rows)
