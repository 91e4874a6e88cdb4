"""`normfold bench epilogue` runs end to end on tiny shapes (a smoke test: no timings asserted), and
the forms it times compute the same function."""

import csv

import torch
import torch.nn.functional as F

from normfold.bench import epilogue
from normfold.cli import main
from normfold.nn import NormLinear, RMSNorm


def test_epilogue_suite_writes_its_table(tmp_path, monkeypatch):
    monkeypatch.setenv("NORMFOLD_BENCH_ALLOCATOR", "default")
    rows, paths = epilogue.run(tmp_path, rounds=2, progress=False, shapes=[(3, 16, 24), (1, 32, 8)],
                               dtypes=("float32", "bfloat16"))
    assert len(rows) == 4 and {r["mode"] for r in rows} == {"eager"}
    with open(paths["csv"]) as f:
        table = list(csv.DictReader(f))
    assert len(table) == 4 and {"epilogue/separate", "gap captured", "linear_q25_us"} <= set(table[0])
    assert all(r["epilogue_us"] > 0 and r["norm+linear_us"] > 0 for r in rows)


def test_the_timed_forms_agree():
    torch.manual_seed(0)
    linear = torch.nn.Linear(64, 96).double()
    norm = RMSNorm(64, weight=False).double()
    x = torch.randn(5, 64, dtype=torch.float64)
    assert torch.allclose(NormLinear.fold(norm, linear)(x), F.linear(norm(x), linear.weight, linear.bias),
                          rtol=1e-12, atol=1e-12)


def test_epilogue_refuses_float16_and_foreign_options(capsys, tmp_path):
    assert main(["bench", "epilogue", "--dtypes", "float16", "-q", "--out", str(tmp_path)]) == 2
    assert "float16" in capsys.readouterr().err
    assert main(["bench", "epilogue", "--batches", "1", "-q", "--out", str(tmp_path)]) == 2
    assert "--batches" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())  # a refused run writes nothing
