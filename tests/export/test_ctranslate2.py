"""Converted models in CTranslate2: for a tiny model of every family the engine runs, the converted
model laid out as a CTranslate2 spec, written, run in the engine and compared with the *original*
PyTorch model (float32: ≤ 1e-4 relative on the logits, the same greedy tokens); the norms run as
RMSNorm wherever the stream is zero-mean in the engine and as LayerNorm where the engine has no place
for normfold's Recenter (Whisper encoder, BLOOM, mBART). int8 runs and agrees on most top-1 tokens.
The CLI's refusals exit 2 and write nothing. Skipped without the ctranslate2 package."""

from __future__ import annotations

import json

import pytest
import torch

import normfold
from helpers import realistic
from normfold.adapters import list_adapters
from normfold.cli import main

pytest.importorskip("transformers")
pytest.importorskip("ctranslate2")

from normfold.engines import ct2  # noqa: E402

TOL = 1e-4

# (family, example index, head, expected form per stream that has norms)
CASES = [
    ("gpt2", 0, "GPT2LMHeadModel", {"decoder": "RMSNorm"}),
    ("opt", 0, "OPTForCausalLM", {"decoder": "RMSNorm"}),
    ("opt", 1, "OPTForCausalLM", {"decoder": "LayerNorm"}),  # no reader biases: the norms keep β
    ("opt", 1, "OPTForCausalLM", {"decoder": "RMSNorm"}, {"allow_new_bias": True}),
    ("gpt_neox", 0, "GPTNeoXForCausalLM", {"decoder": "RMSNorm"}),
    ("gptj", 0, "GPTJForCausalLM", {"decoder": "LayerNorm"}),  # q/k/v have no bias to take the shared norm's β
    ("gptj", 0, "GPTJForCausalLM", {"decoder": "RMSNorm"}, {"allow_new_bias": True}),
    ("gptj", 1, "GPTJForCausalLM", {"decoder": "RMSNorm"}, {"allow_new_bias": True}),
    ("bloom", 0, "BloomForCausalLM", {"decoder": "LayerNorm"}),
    ("falcon", 1, "FalconForCausalLM", {"decoder": "RMSNorm"}),
    ("falcon", 2, "FalconForCausalLM", {"decoder": "RMSNorm"}, {"allow_new_bias": True}),
    ("falcon", 3, "FalconForCausalLM", {"decoder": "RMSNorm"}),
    ("gpt_bigcode", 0, "GPTBigCodeForCausalLM", {"decoder": "RMSNorm"}),
    ("whisper", 0, "WhisperForConditionalGeneration", {"encoder": "LayerNorm", "decoder": "RMSNorm"}),
    ("whisper", 1, "WhisperForConditionalGeneration", {"encoder": "LayerNorm", "decoder": "RMSNorm"}),
    ("mbart", 0, "MBartForConditionalGeneration", {"encoder": "LayerNorm", "decoder": "LayerNorm"}),
]


def _adapter(name):
    return next(a for a in list_adapters() if a.name == name)


def _models(family, index, head, **options):
    torch.manual_seed(0)
    original = realistic(_adapter(family).examples[index].build(head, torch.float32)).eval()
    conv, report = normfold.convert(original, to="rmsnorm", verify=False, **options)
    return original, conv.eval(), report


def _rel(got, want):
    ok = torch.isfinite(got)
    return float((got - want).abs().masked_fill(~ok, 0).max() / want.abs().masked_fill(~ok, 0).max())


def _param(c):
    opts = c[4] if len(c) > 4 else {}
    return pytest.param(*c[:4], opts, id=f"{c[0]}-{c[1]}" + "".join(f"-{k}" for k in opts))


@pytest.mark.parametrize("family,index,head,forms,options", [_param(c) for c in CASES])
def test_family_runs_in_ctranslate2(family, index, head, forms, options, tmp_path):
    original, conv, report = _models(family, index, head, **options)
    spec = ct2.build_spec(conv, report)
    assert {n.stream for n in spec.norms} == set(forms)
    for n in spec.norms:
        # on an RMSNorm stream, only a norm that keeps a bias (β) stays LayerNorm (the same on a zero-mean input)
        assert n.form == forms[n.stream] or (n.form == "LayerNorm" and "bias" in n.why), n
    for stream, form in forms.items():
        assert any(n.form == form for n in spec.norms if n.stream == stream)
    out = ct2.write(spec, tmp_path / "ct2", "float32")
    inputs = ct2.check_inputs(conv, spec.kind, torch.Generator().manual_seed(1))
    before = ct2.torch_logits(conv, spec.kind, inputs)
    got = ct2.engine_logits(out, spec.kind, inputs)
    want = ct2.torch_logits(original, spec.kind, inputs)  # the original model, not the converted one
    # the engine's own float32 error on this model: the original laid out by its stock loader
    stock = ct2.engine_logits(ct2.write(ct2.build_spec(original), tmp_path / "stock", "float32"), spec.kind, inputs)
    assert got.shape == want.shape
    assert _rel(got, want) <= max(TOL, 2 * _rel(stock, want))
    if spec.kind == "generator" and _rel(stock, want) <= TOL:
        assert ct2.greedy_equal(out, original, inputs)
    # the export leaves the PyTorch model as it was (optimize() quantizes in place what it is given)
    q = ct2.write(ct2.build_spec(conv, report), tmp_path / "ct2-int8", "int8")
    got8 = ct2.engine_logits(q, spec.kind, inputs)
    assert torch.equal(ct2.torch_logits(conv, spec.kind, inputs), before)
    # int8 runs (its error on these random tiny models is the quantization's, measured by `bench quant --engine`)
    assert got8.shape == want.shape and torch.isfinite(got8[torch.isfinite(got)]).all()


def test_epsilon_is_written(tmp_path):
    """A model with eps 1e-6 (GPT-J full-rotary example): the engine's RMSNorm uses the model's epsilon."""
    original, conv, report = _models("gptj", 1, "GPTJForCausalLM")
    spec = ct2.build_spec(conv, report)
    assert spec.eps == pytest.approx(original.config.layer_norm_epsilon)
    out = ct2.write(spec, tmp_path / "m", "float32")
    assert json.loads((out / "config.json").read_text())["layer_norm_epsilon"] == pytest.approx(spec.eps)


def test_own_int8_weights_are_normfolds(tmp_path):
    """--int-weights normfold: the int8 rows and scales in the file are normfold.quant's (checked by
    reading the model back through the engine's output: the same logits as a float model whose weights
    are the dequantized rows would give up to the engine's activation rounding)."""
    from normfold.quant import dequantize, quantize_weight

    original, conv, report = _models("gpt2", 0, "GPT2LMHeadModel")
    spec = ct2.build_spec(conv, report)
    out = ct2.write(spec, tmp_path / "own", "int8", own_weights="rtn")
    w = conv.transformer.h[0].mlp.c_fc.weight.detach().t()  # Conv1D: [in, out] → [out, in]
    iw = quantize_weight(w, bits=8)
    assert (iw.q.abs() <= 127).all() and (dequantize(iw) - w).abs().max() <= iw.scale.max() / 2 + 1e-7
    inputs = ct2.check_inputs(conv, "generator", torch.Generator().manual_seed(1))
    own = ct2.engine_logits(out, "generator", inputs)
    engine = ct2.engine_logits(ct2.write(ct2.build_spec(conv, report), tmp_path / "engine", "int8"), "generator",
                               inputs)
    # normfold's RTN rows are the engine's own rounding (absmax per row): the same model, up to the scale's
    # float rounding (1 / (amax / 127) against 127 / amax)
    assert _rel(own, engine) <= 1e-3
    # and the file really holds what the registered method returns: halve every integer row
    from normfold.quant import IntWeight, register_method

    register_method("test-halved", lambda w, bits, g: (lambda iw: IntWeight(
        torch.div(iw.q, 2, rounding_mode="trunc").to(torch.int8), iw.scale * 2, bits, g))(quantize_weight(w, bits, g)))
    halved = ct2.engine_logits(ct2.write(ct2.build_spec(conv, report), tmp_path / "halved", "int8",
                                         own_weights="test-halved"), "generator", inputs)
    assert _rel(halved, own) > 1e-3  # coarser rows: another model


# ---------------------------------------------------------------- the CLI


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("ct2cli")
    for family, index, head in (("gpt2", 0, "GPT2LMHeadModel"), ("phi", 1, "PhiForCausalLM"),
                                ("bert", 0, None)):
        a = _adapter(family)
        ex = a.examples[index]
        torch.manual_seed(0)
        model = realistic(ex.build(head or ex.heads[0], torch.float32)).eval()
        conv, report = normfold.convert(model, to="rmsnorm", verify=False)
        normfold.save(conv, report, root / family)
    return root


def test_cli_exports_and_checks(dirs, tmp_path, capsys):
    out = tmp_path / "m"
    assert main(["export", str(dirs / "gpt2"), "--ctranslate2", str(out), "--json", "-q"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["passed"] and res["greedy_equal"] and res["ct2_vs_pytorch"]["max_rel_error"] <= TOL
    assert res["streams"]["decoder"] == "RMSNorm"
    assert {n["name"] for n in res["norms"] if n["form"] == "LayerNorm"} <= {"transformer.ln_f"}  # β by a tied head
    assert (out / "model.bin").is_file()
    assert main(["export", str(dirs / "gpt2"), "--ctranslate2", str(tmp_path / "q"), "--quantization", "int8",
                 "--int-weights", "normfold-reduced", "-q"]) == 0
    text = capsys.readouterr().out
    assert "top-1 agreement" in text and "not checked" in text


@pytest.mark.parametrize("extra,what", [
    (["--quantization", "int4"], "int4"),
    (["--quantization", "float16", "--int-weights", "normfold"], "int8"),
    (["--opset", "18"], "ONNX options"),
])
def test_cli_refuses_bad_options(dirs, tmp_path, capsys, extra, what):
    out = tmp_path / "m"
    assert main(["export", str(dirs / "gpt2"), "--ctranslate2", str(out), *extra, "-q"]) == 2
    assert what in capsys.readouterr().err
    assert not out.exists() and not list(tmp_path.iterdir())


@pytest.mark.parametrize("family,what", [("phi", "Phi"), ("bert", "no CTranslate2 export")])
def test_cli_refuses_families(dirs, tmp_path, capsys, family, what):
    out = tmp_path / "m"
    assert main(["export", str(dirs / family), "--ctranslate2", str(out), "-q"]) == 2
    assert what in capsys.readouterr().err
    assert not out.exists() and not list(tmp_path.iterdir())


def test_cli_refuses_existing_output(dirs, tmp_path, capsys):
    out = tmp_path / "m"
    out.mkdir()
    (out / "keep").write_text("x")
    assert main(["export", str(dirs / "gpt2"), "--ctranslate2", str(out), "-q"]) == 2
    assert "exists" in capsys.readouterr().err and (out / "keep").read_text() == "x"


@pytest.mark.parametrize("family,index,head", [("gpt2", 0, "GPT2LMHeadModel"), ("falcon", 1, "FalconForCausalLM")])
def test_rotated_model_runs_in_ctranslate2(family, index, head, tmp_path):
    """A rotated checkpoint (Q·1 = 1 through the weights) is a model of the same architecture: it runs in
    the engine, RMSNorm'd, within the float32 tolerance of the original (rotation adds float32 rounding)."""
    original, conv, report = _models(family, index, head, rotate="hadamard")
    spec = ct2.build_spec(conv, report)
    assert any(n.form == "RMSNorm" for n in spec.norms)
    out = ct2.write(spec, tmp_path / "rot", "float32")
    inputs = ct2.check_inputs(conv, "generator", torch.Generator().manual_seed(1))
    assert _rel(ct2.engine_logits(out, "generator", inputs), ct2.torch_logits(original, "generator", inputs)) <= TOL


def test_explicit_rotation_is_refused(tmp_path):
    """Whisper's encoder stream starts at the conv stem: its rotation is an explicit x·Q the engine cannot run."""
    _, conv, report = _models("whisper", 0, "WhisperForConditionalGeneration", rotate="hadamard")
    with pytest.raises(ct2.CTranslate2Error, match="explicit rotation"):
        ct2.build_spec(conv, report)
