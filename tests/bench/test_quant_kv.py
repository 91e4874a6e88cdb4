"""normfold.bench.quant_kv: the forms are the same function (query/key and value/output rotations included), the
fake-quantized KV cache really is 4-bit per token and head as the attention function sees it, the KV clip search
minimises its objective (brute force), the Gaussian floor against its closed-form estimate, and the CLI."""

from __future__ import annotations

import pytest
import torch

from normfold.bench import quant as Q
from normfold.bench import quant_gptq as G
from normfold.bench import quant_kv as K
from normfold.nn.attention import add_attention_hook


def _batches(n=32, seed=0):
    return [torch.randint(0, 256, (2, n), generator=torch.Generator().manual_seed(seed))]


def _seen(model, batches):
    """The keys and values each attention function receives, after every hook already there."""
    seen = []
    for attn in K.attention_modules(model).values():
        add_attention_hook(attn, lambda mod, q, k, v: (seen.append((k.detach().clone(), v.detach().clone())), (q, k, v))[1])
    with torch.no_grad():
        for b in batches:
            model(input_ids=b, use_cache=False)
    return seen


def test_forms_are_the_same_function_and_rotate_the_keys():
    model = Q.outlier_gpt2(vocab=256).double()
    batches = _batches()
    variants = K.forms(model, lambda m: None)
    ref = Q.logits_of(model, batches)
    for f, m in variants.items():
        err = float((Q.logits_of(m, batches) - ref).norm() / ref.norm())
        assert err <= 1e-9, (f, err)
    import copy

    k0 = _seen(copy.deepcopy(variants["rotated+online"]), batches)
    k1 = _seen(copy.deepcopy(variants["rotated+online+qk"]), batches)
    from normfold.rotate import head_rotation

    r, _ = head_rotation(32, 0)
    for (a, va), (b, vb) in zip(k0, k1):
        assert torch.allclose(b, a @ r, atol=1e-9 * float(a.abs().max())) and not torch.allclose(b, a, atol=1e-3)
        assert torch.allclose(va, vb, atol=1e-9 * float(va.abs().max()))  # values untouched by +qk


def test_kv_cache_is_four_bit_per_token_and_head():
    model = Q.outlier_gpt2(vocab=256)
    batches = _batches()
    q = K.with_kv_quant(model, 4)
    ref = _seen(q, batches)  # appended after the quantizing hook: sees what the cache would hold
    assert len(ref) == 4
    for k, v in ref:
        for t in (k, v):
            amax = t.abs().amax(-1, keepdim=True)
            levels = t / (amax / 7)
            assert torch.allclose(levels, levels.round(), atol=1e-4)  # integers −7…7 per (token, head)
            assert int(levels.round().abs().max()) == 7
    # and the attention really reads them: the logits move, by little
    a, b = Q.logits_of(model, batches), Q.logits_of(q, batches)
    assert 0 < float((a - b).norm() / a.norm()) < 0.2


def test_kv_clip_search_minimises_its_objective():
    model = Q.outlier_gpt2(vocab=256)
    cal = _batches(seed=1)
    grid = (1.0, 0.8, 0.6)
    ratios = K.search_kv_clip(model, cal, 4, grid=grid)
    assert set(ratios) == {f"transformer.h.{i}.attn" for i in range(4)}
    seen = []
    attn = model.get_submodule("transformer.h.2.attn")
    import copy

    m = copy.deepcopy(model)
    add_attention_hook(m.get_submodule("transformer.h.2.attn"), lambda mod, q, k, v: (seen.append((q, k, v)), (q, k, v))[1])
    with torch.no_grad():
        m(input_ids=cal[0], use_cache=False)
    q, k, v = seen[0]
    ek = {r: float(torch.einsum("bhqd,bhkd->bhqk", q.double(), (G.quant_tokens(k, 4, r) - k).double()).pow(2).sum())
          for r in grid}
    ev = {r: float((G.quant_tokens(v, 4, r) - v).double().pow(2).sum()) for r in grid}
    assert ratios["transformer.h.2.attn"] == (min(ek, key=ek.get), min(ev, key=ev.get))
    assert attn is not None and not hasattr(attn, "_normfold_attention_hooks")  # the search works on a copy


@pytest.mark.parametrize("d", [32, 64, 192, 768])
def test_gaussian_floor(d):
    mc = K.gaussian_rel_err(d, samples=4000)
    assert abs(mc / K.gaussian_rel_err_approx(d) - 1) < 0.15
    # 4-bit per token is never below the uniform-rounding error of its own step: ‖e‖/‖x‖ ≥ step/√12·√d/‖x‖
    assert 0.05 < mc < 0.2


def test_input_errors_cover_every_site():
    model = Q.outlier_gpt2(vocab=256)
    errs = {e["site"]: e for e in K.input_errors(model, _batches())}
    assert set(errs) == {"stream-reader inputs", "attention-output inputs", "MLP down-proj inputs", "keys (per head)",
                         "values (per head)"}
    assert errs["MLP down-proj inputs"]["width"] == 768 and errs["keys (per head)"]["sites"] == 4
    assert errs["stream-reader inputs"]["sites"] == 4 * 2 + 1  # c_attn, c_fc per block, the head


def test_cli_bench_quant_kv(tmp_path, monkeypatch, capsys):
    from normfold.cli import main

    ids = lambda windows, text=None, **kw: [torch.randint(0, 2048, (2, 32), generator=torch.Generator().manual_seed(0))]
    monkeypatch.setattr(K, "heldout_batches", ids)
    monkeypatch.setattr(K, "calibration_batches", lambda spec, model_dir=None, windows=32, text=None: ids(0))
    code = main(["bench", "quant", "--kv", "--quick", "-q", "--out", str(tmp_path)])
    assert code == 0, capsys.readouterr().err
    rows = (tmp_path / "quant_kv.csv").read_text().splitlines()
    assert rows[0].startswith("model,form,weights,config,kv") and any("outlier-gpt2,rotated+online+qk" in r for r in rows)
    assert (tmp_path / "quant_kv_input_error.csv").exists()
    capsys.readouterr()
    assert main(["bench", "quant", "--kv", "--gptq", "--out", str(tmp_path / "x")]) == 2
    assert main(["bench", "quant", "--kv", "--engine", "onnxruntime", "--out", str(tmp_path / "y")]) == 2
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()
