"""`normfold bench hf` runs end to end on tiny transformers configs (no timing assertions): the
converted candidates really went through convert → save → load and compute the original function."""

import csv
import math

import pytest
import torch

pytest.importorskip("transformers")

from normfold.bench import hf  # noqa: E402
from normfold.cli import main  # noqa: E402

TINY = (
    hf.HFCase("tiny-vit", "vit", {"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
                                  "intermediate_size": 64, "image_size": 32, "patch_size": 8, "num_labels": 5}),
    hf.HFCase("tiny-gpt2", "gpt2", {"n_embd": 24, "n_layer": 1, "n_head": 2, "vocab_size": 61, "n_positions": 32},
              seq=8),
)


def test_hf_suite_runs_and_writes_its_tables(tmp_path):
    rows, paths = hf.run(tmp_path, cases=TINY, rounds=2, progress=False, dtypes=("float32", "bfloat16"))
    assert [(r["model"], r["dtype"]) for r in rows] == [("tiny-vit", "float32"), ("tiny-vit", "bfloat16"),
                                                        ("tiny-gpt2", "float32"), ("tiny-gpt2", "bfloat16")]
    for r in rows:
        for v in ("rmsnorm", "crmsnorm", "no-norm", "aa"):
            assert r[f"{v}/orig_q25"] <= r[f"{v}/orig"] <= r[f"{v}/orig_q75"] and r[f"{v}/orig"] > 0
            assert r[f"{v}_vs_orig"] in ("faster", "same", "slower")
        assert r["crms/rms"] > 0 and r["rounds"] == 2
        # two separate timings (the norms' time, the forward's) at 2 rounds: on a loaded machine their ratio
        # can pass 1, so only its presence is checked here (speed is for `normfold bench`, not for tests)
        assert math.isfinite(r["ln_norm_share"]) and r["ln_norm_share"] > 0 and r["norm rms/ln"] > 0
    md = paths["md"].read_text()
    assert "Mean over settings" in md and "gap captured (RMS)" in md and "A/A flagged" in md and "Machine:" in md
    assert len(list(csv.DictReader(open(paths["csv"])))) == 4


@pytest.mark.parametrize("case", TINY, ids=lambda c: c.name)
def test_candidates_compute_the_original_function(tmp_path, case):
    models = hf.candidates(case, torch.float64, str(tmp_path), variants=hf.VARIANTS + hf.EXTRA_VARIANTS)
    x = case.inputs(models["original"], torch.float64)
    with torch.no_grad():
        want = models["original"](**x).logits
        for v in ("aa", "rmsnorm", "crmsnorm", "rmsnorm-plain", "crmsnorm-plain"):
            got = models[v](**x).logits
            assert float((got - want).abs().max() / want.abs().max()) <= 1e-9, v
        assert float((models["no-norm"](**x).logits - want).abs().max() / want.abs().max()) > 1e-3
    for v in ("rmsnorm", "crmsnorm"):
        assert hasattr(models[v], "normfold_report")  # reloaded by normfold.load
    assert not any(isinstance(m, torch.nn.LayerNorm) for m in models["no-norm"].modules())


def test_cli_refuses_options_it_does_not_take(capsys):
    assert main(["bench", "hf", "--models", "vit-tiny"]) == 2
    assert "does not take --models" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without a GPU")
def test_cuda_refused_clearly_without_a_gpu(tmp_path, capsys):
    assert main(["bench", "hf", "--device", "cuda", "--quick", "--out", str(tmp_path / "out")]) == 2
    assert "no CUDA device" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()  # refused before any table was written


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_hf_suite_on_cuda(tmp_path):
    rows, _ = hf.run(tmp_path, cases=TINY, rounds=2, progress=False, dtypes=("float32", "bfloat16"), device="cuda")
    assert len(rows) == 4 and all(r["device"] == "cuda" for r in rows)
    for r in rows:
        assert r["rmsnorm/orig"] > 0 and r["crms/rms"] > 0
        assert "ln_norm_share" not in r  # host-side hooks are not used on the GPU
