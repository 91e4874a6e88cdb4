"""One options object (issue 27): `normfold.ConvertOptions` or the same keywords give the same conversion in
convert, stream_convert, train.prepare and train.export, checked by one method (`ConvertOptions.check`) and
recorded in normfold.json. Outputs are compared, not flags."""

from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch

import normfold
from normfold import ConvertOptions
from normfold import train as nftrain
from normfold.errors import UnsupportedConversionError
from normfold.options import resolve

transformers = pytest.importorskip("transformers")
from helpers import realistic, run_flat  # noqa: E402


def gpt2(dtype=torch.float64):
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=61, n_positions=16, n_embd=24, n_layer=2, n_head=3)
    return realistic(transformers.GPT2LMHeadModel(cfg).to(dtype).eval())


IDS = {"input_ids": torch.randint(0, 61, (2, 9), generator=torch.Generator().manual_seed(1))}


def state(model):
    return {k: v.clone() for k, v in model.state_dict().items()}


def same_state(a, b):
    sa, sb = state(a), state(b)
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_resolve_lays_keywords_over_the_object():
    base = ConvertOptions(to="crmsnorm", pad=True, keep_affine=True)
    assert resolve(base, "t") is base
    assert resolve(base, "t", keep_affine=False) == ConvertOptions(to="crmsnorm", pad=True, keep_affine=False)
    assert resolve(None, "t", to="un", variant_options={"warmup": 3}).variant_options == {"warmup": 3}
    with pytest.raises(TypeError, match="unknown option"):
        resolve(None, "t", colour="red")
    with pytest.raises(TypeError, match="ConvertOptions"):
        resolve({"to": "crmsnorm"}, "t")


@pytest.mark.parametrize("kw", [dict(to="rmsnorm"), dict(to="rmsnorm", keep_affine=True, fold_final=True),
                                dict(to="crmsnorm", pad=True), dict(to="crmsnorm"),
                                dict(to="rmsnorm", rotate="orthogonal", rotate_seed=3)])
def test_convert_object_and_keywords_agree_and_are_exact(kw):
    model = gpt2()
    by_kw, r1 = normfold.convert(model, **kw)
    by_obj, r2 = normfold.convert(model, options=ConvertOptions(**kw))
    assert same_state(by_kw, by_obj)
    assert r1.variant == r2.variant == kw["to"]
    assert r1.verification["passed"] and r1.verification["fp64"]["max_rel_error"] <= 1e-9
    ref, got = run_flat(model, IDS)["logits"], run_flat(by_obj, IDS)["logits"]
    assert (got - ref).abs().max() <= 1e-9 * ref.abs().max()


def test_a_keyword_overrides_the_objects_field():
    model = gpt2()
    a, _ = normfold.convert(model, options=ConvertOptions(keep_affine=True), keep_affine=False)
    b, _ = normfold.convert(model)
    assert same_state(a, b)


def test_pad_is_refused_for_rmsnorm():
    with pytest.raises(UnsupportedConversionError, match="takes no options"):
        normfold.convert(gpt2(), to="rmsnorm", pad=True)


def test_prepare_keep_affine():
    a, b, c = gpt2(), gpt2(), gpt2()
    nftrain.prepare(a, options=ConvertOptions(keep_affine=False))
    nftrain.prepare(b, keep_affine=False)
    nftrain.prepare(c)  # default for rmsnorm: γ/β kept in the norm
    assert nftrain.state(a).fold and nftrain.state(b).fold and not nftrain.state(c).fold
    ref = run_flat(gpt2(), IDS)["logits"]
    for m in (a, b, c):
        got = run_flat(m.eval(), IDS)["logits"]
        assert (got - ref).abs().max() <= 1e-9 * ref.abs().max()
    with pytest.raises(UnsupportedConversionError, match="no training form"):
        nftrain.prepare(gpt2(), options=ConvertOptions(to="crmsnorm", pad=True))


def test_export_takes_the_options(tmp_path):
    model = gpt2(torch.float32)
    nftrain.prepare(model)
    conv, report = nftrain.export(model, tmp_path / "a", options=ConvertOptions(keep_affine=True))
    assert report.verification["passed"]
    assert any(rec.weight for rec in report.structure.norms)  # γ kept in the norms, as asked
    _, folded = nftrain.export(model, tmp_path / "b")
    assert not any(rec.weight for rec in folded.structure.norms if not rec.name.endswith("ln_f"))
    ref = run_flat(nftrain.restore(model).eval(), IDS)["logits"]
    for d in ("a", "b"):
        got = run_flat(normfold.load(tmp_path / d), IDS)["logits"]
        assert (got - ref).abs().max() <= 1e-4 * ref.abs().max()


def test_stream_convert_takes_the_options(tmp_path):
    from normfold.stream import stream_convert

    model = gpt2(torch.float32)
    src = tmp_path / "src"
    model.save_pretrained(src)
    out_obj, out_kw = tmp_path / "o", tmp_path / "k"
    out_obj.mkdir(), out_kw.mkdir()
    stream_convert(src, out_obj, options=ConvertOptions(keep_affine=True))
    stream_convert(src, out_kw, keep_affine=True)
    assert same_state(normfold.load(out_obj), normfold.load(out_kw))
    c_obj, c_kw = tmp_path / "co", tmp_path / "ck"
    c_obj.mkdir(), c_kw.mkdir()
    stream_convert(src, c_obj, options=ConvertOptions(to="crmsnorm", pad=True))
    stream_convert(src, c_kw, to="crmsnorm", pad=True)
    assert same_state(normfold.load(c_obj), normfold.load(c_kw))
    assert normfold.load(c_obj).normfold_report.structure.compression["pad"] is True


def test_renamed_functions_keep_their_old_names_for_one_release():
    from normfold import ops

    with pytest.warns(DeprecationWarning, match="load_kernels"):
        ops.prepare()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ops.load_kernels()


def test_rotation_is_refused_where_it_has_no_form(tmp_path):
    """rotate is a field like the others; the entry points without a rotated form refuse it by name."""
    from normfold.stream import stream_convert
    from normfold.stream.source import StreamUnsupportedError

    with pytest.raises(UnsupportedConversionError, match="rotate"):
        nftrain.prepare(gpt2(), options=ConvertOptions(rotate="hadamard"))
    gpt2(torch.float32).save_pretrained(tmp_path / "src")
    (tmp_path / "out").mkdir()
    # the stream rotates, online Hadamard included (tests/stream/test_stream_rotate.py), but has no form of a
    # rotated Pre-CRMSNorm model, nor of online ops without the rotation
    for opts in (ConvertOptions(rotate="hadamard", to="crmsnorm"), ConvertOptions(rotate_online=True)):
        with pytest.raises(StreamUnsupportedError, match="rotate"):
            stream_convert(tmp_path / "src", tmp_path / "out", options=opts)
    assert list((tmp_path / "out").iterdir()) == []  # refused before anything was written


def test_options_round_trip_through_normfold_json(tmp_path):
    """normfold.json records the checked options (a versioned record) and reads them back as the same object."""
    from normfold.report import OptionsSpec

    assert [f.name for f in dataclasses.fields(OptionsSpec)] == ["version", *normfold.options.FIELDS]
    model = gpt2()
    options = ConvertOptions(to="rmsnorm", fold_final=True, allow_new_bias=True)
    conv, report = normfold.convert(model, options=options, verify=False)
    normfold.save(conv, report, tmp_path / "out")
    loaded = normfold.io.read_report(tmp_path / "out")
    assert ConvertOptions.from_record(loaded.options) == options.replace(keep_affine=False)
    rotated = ConvertOptions(rotate="hadamard", rotate_seed=3)
    assert ConvertOptions.from_record(rotated.check().to_record()) == rotated.check()
    assert rotated.check().fold_final and rotated.check().untie


def test_one_message_per_rule():
    for bad, message in [(ConvertOptions(rotate_online=True), "--rotate-online needs --rotate"),
                         (ConvertOptions(pad=True), "--pad applies to --to crmsnorm only"),
                         (ConvertOptions(to="crmsnorm", untie=True), "--untie applies to --to rmsnorm only"),
                         (ConvertOptions(to="crmsnorm", rotate="hadamard"), "--rotate works with --to rmsnorm"),
                         (ConvertOptions(rotate="hadamard", keep_affine=True), "--rotate needs every norm")]:
        with pytest.raises(UnsupportedConversionError, match=message):
            bad.check()


def test_an_options_record_with_an_unknown_field_is_refused(tmp_path):
    """normfold.json is untrusted input: its `options` record is checked field by field like the rest."""
    import json

    from normfold.errors import ReportSchemaError
    from normfold.report import ConversionReport

    conv, report = normfold.convert(gpt2(), verify=False)
    d = json.loads(report.to_json())
    assert d["options"]["version"] == normfold.options.OPTIONS_VERSION
    assert ConversionReport.from_dict(d).options == d["options"]
    d["options"]["rotate_sed"] = 3
    with pytest.raises(ReportSchemaError, match="rotate_sed"):
        ConversionReport.from_dict(d)
