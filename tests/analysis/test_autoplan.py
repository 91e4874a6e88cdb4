"""Automatic conversion (issue 13): models without a hand-written adapter convert with the plan the analysis
derives — through the API and `normfold convert DIR` — exactly (float64 ≤ 1e-9); and on every family that has
an adapter, the derived plan agrees with the adapter's (which norms, and the outputs)."""

import fnmatch
import json
import subprocess
import sys

import pytest
import torch

import normfold
from auto_families import FAMILIES
from helpers import realistic, rel_err, run_flat
from normfold.adapters import find_adapter, list_adapters
from normfold.analysis.autoplan import derive_adapter, modality_inputs, resolve
from normfold.errors import UnsupportedModelError

transformers = pytest.importorskip("transformers")

BY_KEY = {f.key: f for f in FAMILIES}
# LayerNorms converted by the derived plan: (converted, total), and what the adapter-free analysis found
# before issue 13 (docs/families.md / docs/analyze.md list both).
EXPECTED = {"dinov2": (5, 5), "dinov2-24px": (5, 5), "beit": (5, 5), "data2vec-vision": (4, 4), "vit-mae": (5, 5),
            "persimmon": (5, 9), "stablelm": (5, 5), "codegen": (3, 3), "mpt": (5, 5)}


def _inputs(fam, model):
    inputs = modality_inputs(model)
    if fam.image_size:
        inputs["pixel_values"] = torch.randn(2, 3, fam.image_size, fam.image_size,
                                             generator=torch.Generator().manual_seed(3))
    return inputs


@pytest.mark.parametrize("key", sorted(EXPECTED))
def test_family_without_adapter_converts_exactly(key, tmp_path):
    fam = BY_KEY[key]
    model = realistic(fam.build())
    with pytest.raises(UnsupportedModelError):
        find_adapter(model)
    inputs = _inputs(fam, model)
    conv, report = normfold.convert(model, inputs=inputs)  # no adapter: the analysis' plan
    assert report.adapter == "analysis"
    converted = report.layernorms_total - len(report.kept)
    assert (converted, report.layernorms_total) == EXPECTED[key]
    tol = 1e-7 if key == "dinov2-24px" else 1e-9  # see test_dinov2_other_size_float32_interpolation
    assert report.verification["fp64"]["max_rel_error"] <= tol
    ref, got = run_flat(model, inputs), run_flat(conv, inputs)
    for name in ref:
        a, b = got[name], ref[name]
        if any(fnmatch.fnmatchcase(name, p) for p in report.centered_outputs):  # the raw stream, recentred
            a, b = a - a.mean(-1, keepdim=True), b - b.mean(-1, keepdim=True)
        assert rel_err(a, b) <= tol, name
    if report.structure.recenter_after:  # a kept tie (MPT): the original table, a Recenter after it
        # stock transformers reloads it without the Recenter (its LayerNorms re-centre their input)
        assert report.stock_reloadable
        import transformers

        stock = getattr(transformers, type(model).__name__).from_pretrained(
            normfold.save(conv, report, tmp_path / "out"), dtype=next(model.parameters()).dtype).eval()
        again = run_flat(stock, inputs)
        for name in ref:
            a, b = again[name], ref[name]
            if any(fnmatch.fnmatchcase(name, p) for p in report.centered_outputs):
                a, b = a - a.mean(-1, keepdim=True), b - b.mean(-1, keepdim=True)
            assert rel_err(a, b) <= tol, name
    assert report.stock_reloadable


def test_layerscale_is_folded_into_the_writer_and_set_to_one():
    model = realistic(BY_KEY["dinov2"].build())
    lam = model.encoder.layer[0].layer_scale1.lambda1.detach().clone()
    w = model.encoder.layer[0].attention.o_proj.weight.detach().clone()
    conv, report = normfold.convert(model, inputs=modality_inputs(model))
    layer = conv.encoder.layer[0]
    assert torch.equal(layer.layer_scale1.lambda1, torch.ones_like(lam))
    dense = layer.attention.o_proj.weight
    torch.testing.assert_close(dense, (w * lam[:, None]) - (w * lam[:, None]).mean(0), rtol=0, atol=1e-12)
    assert any("LayerScale" in n for n in report.notes)


def test_dinov2_other_size_float32_interpolation():
    """transformers interpolates Dinov2's position table in float32 even in a float64 model
    (`patch_pos_embed.to(torch.float32)` in interpolate_pos_encoding): the centred table rounds differently
    from the original, so the float64 check sees float32 rounding (~1e-8), not a conversion error. At the
    config's image size (no interpolation) the same plan is exact to 1e-15."""
    fam = BY_KEY["dinov2-24px"]
    model = realistic(fam.build())
    _, report = normfold.convert(model, inputs=_inputs(fam, model))
    err = report.verification["fp64"]["max_rel_error"]
    assert 1e-12 < err <= 1e-7


def test_auto_forces_the_derived_plan_and_resolve_prefers_the_adapter():
    ex = find_adapter_example("gpt2")
    model = realistic(ex.build(dtype=torch.float64))
    adapter, analysis = resolve(model)
    assert adapter.name == "gpt2" and analysis is None
    adapter, analysis = resolve(model, auto=True)
    assert adapter.name == "analysis" and analysis.total == len(analysis.foldable)
    _, report = normfold.convert(model, auto=True)
    assert report.adapter == "analysis" and report.verification["passed"]


def find_adapter_example(name):
    return next(a for a in list_adapters() if a.name == name).examples[0]


# Families whose adapter does something the analysis does not derive (said in docs/analyze.md):
# Whisper's explicit Recenter before encoder.layers.0 (its stem ends in a functional GELU: no module to
# recentre after), so the derived plan keeps the encoder's norms.
DIFFERS = {"whisper"}


@pytest.mark.parametrize("adapter", [a.name for a in list_adapters() if a.examples])
def test_derived_plan_agrees_with_the_adapter(adapter):
    a = next(x for x in list_adapters() if x.name == adapter)
    torch.manual_seed(0)
    model = realistic(a.examples[0].build(dtype=torch.float64))
    inputs = a.example_inputs(model, torch.Generator().manual_seed(0))
    derived, analysis = derive_adapter(model, inputs)
    ours = {s.path for st in derived.plan(model).streams for s in st.norms}
    theirs = {s.path for st in a.plan(model).streams for s in st.norms}
    conv_a, rep_a = normfold.convert(model, adapter=a, inputs=inputs)
    conv_d, rep_d = normfold.convert(model, adapter=derived, inputs=inputs)
    assert rep_d.verification["passed"] and rep_a.verification["passed"]
    if adapter in DIFFERS:
        assert ours < theirs
    else:
        assert ours == theirs
    out_a, out_d = run_flat(conv_a, inputs), run_flat(conv_d, inputs)
    for name in out_a:
        if "hidden_states" not in name:  # both recentred where they differ at all
            assert rel_err(out_d[name], out_a[name]) <= 1e-9, name


# ---- the CLI, no Python ------------------------------------------------------------------------------------

def _cli(*args):
    return subprocess.run([sys.executable, "-m", "normfold", *args], capture_output=True, text=True, timeout=300)


def test_cli_converts_a_model_without_adapter(tmp_path):
    fam = BY_KEY["beit"]
    model = realistic(fam.build(dtype=torch.float32))
    model.save_pretrained(tmp_path / "beit")
    out = tmp_path / "beit-rms"
    res = _cli("convert", str(tmp_path / "beit"), "--out", str(out))
    assert res.returncode == 0, res.stderr
    assert "plan derived from the analysis" in res.stderr + res.stdout
    assert "converted: layers.0.layernorm_before" in res.stdout.replace("beit.", "")
    report = json.loads((out / "normfold.json").read_text())
    assert report["adapter"] == "analysis" and report["layernorms"]["converted"] == 5
    assert report["verification"]["fp64"]["max_rel_error"] <= 1e-9
    # stock transformers reloads it (LayerScale λ = 1, norms as LayerNorms with folded affines)
    stock = transformers.BeitModel.from_pretrained(out).eval()
    pixels = torch.randn(2, 3, 16, 16)
    with torch.no_grad():
        a, b = stock(pixel_values=pixels).pooler_output, model(pixel_values=pixels).pooler_output
    assert rel_err(a, b) <= 1e-5


def test_cli_inputs_file_and_auto(tmp_path):
    from safetensors.torch import save_file

    fam = BY_KEY["dinov2"]
    model = fam.build(dtype=torch.float32)
    model.save_pretrained(tmp_path / "m")
    save_file({"pixel_values": torch.randn(1, 3, 24, 24)}, tmp_path / "in.safetensors")
    res = _cli("convert", str(tmp_path / "m"), "--dry-run", "--inputs", str(tmp_path / "in.safetensors"),
               "--fp64-tol", "1e-7", "--json")
    assert res.returncode == 0, res.stderr
    report = json.loads(res.stdout)
    assert report["verification"]["inputs"]["pixel_values"]["shape"] == [1, 3, 24, 24] if \
        "inputs" in report["verification"] else True
    assert report["layernorms"]["converted"] == 5
    bad = _cli("convert", str(tmp_path / "m"), "--dry-run", "--inputs", str(tmp_path / "missing.safetensors"))
    assert bad.returncode == 2 and "no such file" in bad.stderr


@pytest.mark.parametrize("key,pad", [("stablelm", False), ("dinov2", True)])
def test_derived_plan_converts_to_crmsnorm(key, pad):
    """The derived plan feeds --to crmsnorm too. LayerScale models need the padded form: λ (set to 1) keeps
    d entries and multiplies the stream, so the (d−1)-wide form is refused with a hint to --pad."""
    model = realistic(BY_KEY[key].build())
    conv, report = normfold.convert(model, to="crmsnorm", inputs=modality_inputs(model), pad=pad)
    assert report.adapter == "analysis" and report.verification["passed"]
    assert report.verification["fp64"]["max_rel_error"] <= 1e-9
