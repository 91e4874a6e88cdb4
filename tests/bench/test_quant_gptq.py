"""normfold.bench.quant_gptq: calibration data disjoint from the evaluation split, online Hadamard on the
attention output exact, the activation clip search, and the CLI end to end on a tiny budget."""

from __future__ import annotations

import torch

from normfold.bench import quant as Q
from normfold.bench import quant_gptq as G
from normfold.quant.calibrate import quantizable_linears


def test_bundled_calibration_is_the_training_split(monkeypatch):
    from normfold.bench import train

    g = torch.Generator().manual_seed(0)
    tr, va = torch.randint(0, 50, (5000,), generator=g), torch.randint(50, 100, (3000,), generator=g)
    monkeypatch.setattr(train, "token_streams", lambda text=None: (tr, va))
    cal = torch.cat(G.calibration_batches("bundled", windows=8, ctx=64))
    assert cal.shape == (8, 64) and int(cal.max()) < 50  # only training-split tokens
    assert torch.equal(cal[0], tr[:64]) and torch.equal(cal[-1], tr[(5000 // 64 - 1) * 64:(5000 // 64) * 64])


def test_calibration_file_errors(tmp_path):
    import pytest

    with pytest.raises(G.CalibrationError, match="no such file"):
        G.calibration_batches(str(tmp_path / "missing.txt"))
    short = tmp_path / "short.txt"
    short.write_text("In the beginning")
    with pytest.raises(G.CalibrationError, match="need at least"):
        G.calibration_batches(str(short))


def test_forms_are_the_same_function_and_attention_hadamard_is_placed():
    model = Q.outlier_gpt2(vocab=256)
    batches = [torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))]
    variants = G.forms(model.double(), lambda m: None)
    ref = Q.logits_of(model, batches)
    for f, m in variants.items():
        err = float((Q.logits_of(m, batches) - ref).norm() / ref.norm())
        assert err <= 1e-9, (f, err)
    from normfold.nn.online import has_input_hadamard

    mods = dict(variants["rotated+online+attn"].named_modules())
    assert all(has_input_hadamard(mods[f"transformer.h.{i}.attn.c_proj"]) for i in range(4))
    assert not has_input_hadamard(dict(variants["rotated+online"].named_modules())["transformer.h.0.attn.c_proj"])


def test_activation_clip_search_minimises_the_output_error():
    torch.manual_seed(0)
    model = Q.outlier_gpt2(vocab=256)
    cal = [torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(1))]
    ratios = G.search_activation_clip(model, cal, 4, grid=(1.0, 0.8, 0.6))
    assert set(ratios) == set(quantizable_linears(model)) and set(ratios.values()) <= {1.0, 0.8, 0.6}
    # brute force for one linear
    name = "transformer.h.1.mlp.c_fc"
    seen = []
    mod = dict(model.named_modules())[name]
    h = mod.register_forward_pre_hook(lambda m, a: seen.append(a[0].reshape(-1, a[0].shape[-1])))
    with torch.no_grad():
        model(input_ids=cal[0])
    h.remove()
    x, w = torch.cat(seen), mod.weight.detach().T
    errs = {r: float(((G.quant_tokens(x, 4, r) - x) @ w.T).pow(2).sum()) for r in (1.0, 0.8, 0.6)}
    assert ratios[name] == min(errs, key=errs.get)


def test_cli_bench_quant_gptq_writes_tables(tmp_path, monkeypatch, capsys):
    from normfold.cli import main

    ids = lambda windows, text=None, **kw: [torch.randint(0, 2048, (2, 32), generator=torch.Generator().manual_seed(0))]
    monkeypatch.setattr(G, "heldout_batches", ids)
    monkeypatch.setattr(G, "calibration_batches", lambda spec, model_dir=None, windows=32, text=None: ids(0))
    code = main(["bench", "quant", "--gptq", "--quick", "-q", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert code == 0 and "gptq" in out
    rows = (tmp_path / "quant_gptq.csv").read_text().splitlines()
    assert rows[0].startswith("model,form,weights,config,group") and any("outlier-gpt2,rotated+online,gptq" in r for r in rows)
    assert main(["bench", "quant", "--calibration", "bundled", "--out", str(tmp_path / "x")]) == 2
    assert not (tmp_path / "x").exists()
