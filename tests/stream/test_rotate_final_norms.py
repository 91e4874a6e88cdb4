"""Rotated models: which final-norm outputs the verifiers compare (in memory: `normfold.convert(rotate=...)`,
`normfold verify --no-blockwise`; block-wise: `normfold.stream.blockverify`).

A base model's final norm (no head reads it: GPT2Model, BloomModel, WhisperModel's decoder, CLIPVisionModel's
post_layernorm) keeps γ/β and reads x·Qᵀ, so its output (last_hidden_state, hidden_states[-1], pooler_output) is
the original's exactly and must be compared: a wrong γ or β there fails. A final norm whose γ/β went into its
readers (a head, a decoder's cross-attention) gives an output in the rotated basis without γ/β: skipped, and
reported as skipped. A raw-stream last_hidden_state (CLIP vision) is compared as a stream."""

from __future__ import annotations

import json

import pytest
import torch

import normfold
from normfold.adapters import get_adapter
from normfold.stream import stream_convert
from normfold.stream.blockverify import verify_blockwise
from normfold.verify import LACKING_WHY

from _compare import make_checkpoint
from helpers import realistic
from test_blockverify import _rewrite

# (family, head, example, final norm, perturbed parameter, outputs that must be compared, outputs that must be skipped)
BASE = [
    ("gpt2", "GPT2Model", "tied", "ln_f", "weight", {"last_hidden_state", "hidden_states[2] (centred)"}, set()),
    ("bloom", "BloomModel", "tied", "ln_f", "bias", {"last_hidden_state", "hidden_states[2] (centred)"}, set()),
    ("whisper", "WhisperModel", "d32", "decoder.layer_norm", "weight",
     {"last_hidden_state", "decoder_hidden_states[2] (centred)"},
     {"encoder_last_hidden_state", "encoder_hidden_states[2]"}),  # the encoder's γ/β are in the cross-attention
    ("clip", "CLIPVisionModel", "vision", "post_layernorm", "bias",
     {"pooler_output", "last_hidden_state (centred)", "hidden_states[2] (centred)"}, set()),
]
HEADS = [  # controls: the final norm's γ/β are in the head
    ("gpt2", "GPT2LMHeadModel", "tied", "ln_f", "bias", {"logits"}, {"hidden_states[2]"}),
    ("whisper", "WhisperForConditionalGeneration", "d32", "model.decoder.layer_norm", "bias", {"logits"},
     {"encoder_last_hidden_state", "encoder_hidden_states[2]", "decoder_hidden_states[2]"}),
]
CASES = BASE + HEADS
IDS = [c[1] for c in CASES]


def _source(tmp_path, family, head, example):
    ex = next(e for e in get_adapter(family).examples if e.name == example)
    return make_checkpoint(ex, head, tmp_path / "src", dtype=torch.float32, shard="20KB")


def _key(directory, suffix):
    from safetensors import safe_open

    for f in directory.glob("*.safetensors"):
        with safe_open(str(f), "pt") as fh:
            keys = [k for k in fh.keys() if k == suffix or k.endswith("." + suffix)]
        if keys:
            return keys[0]
    raise AssertionError(f"{suffix} not in {directory}")


def _scale(t):
    return t * 1.01 + 0.01  # γ and β: a small, plainly wrong change


def _names(result, section="fp64"):
    return {o["name"] for o in result[section]["outputs"]}


def _check_good(result, compared, skipped):
    assert result["passed"], result["fp64"]
    names = _names(result)
    assert compared <= names, names
    assert not any(s in n for s in skipped for n in names), names
    assert set(result["skipped"]) == {s.replace(" (centred)", "") for s in skipped}
    assert all(why == LACKING_WHY for why in result["skipped"].values())


@pytest.mark.parametrize("family,head,example,norm,param,compared,skipped", CASES, ids=IDS)
def test_convert_compares_exact_final_outputs(family, head, example, norm, param, compared, skipped, monkeypatch):
    """normfold.convert(rotate=...): the final-norm outputs that are exact are compared (float64 and working
    dtype) and pass; the converted model's final norm γ/β changed after the conversion fails verification."""
    import sys

    conv_mod = sys.modules["normfold.conversion"]

    ex = next(e for e in get_adapter(family).examples if e.name == example)
    torch.manual_seed(0)
    model = realistic(ex.build(head, torch.float32))
    _, report = normfold.convert(model, rotate="hadamard")
    _check_good(report.verification, compared, skipped)
    rows = {r["name"] for r in report.verification["working"]["outputs"]}
    assert compared <= rows

    real = conv_mod.check_conversion  # what convert() verifies with (verify.verify_conversion given the dtype)

    def wrong_final(original, converted, inputs, **kw):  # a conversion that got the final norm's γ/β wrong
        (mod,) = [m for n, m in converted.named_modules() if n == norm or n.endswith("." + norm)]
        p = getattr(mod, param)
        with torch.no_grad():
            p.copy_(_scale(p))
        return real(original, converted, inputs, **kw)

    monkeypatch.setattr(conv_mod, "check_conversion", wrong_final)
    _, bad = normfold.convert(model, rotate="hadamard")
    assert not bad.verification["passed"]
    failing = {r["name"] for r in bad.verification["working"]["outputs"] if not r["ok"]}
    assert failing & compared, failing


@pytest.mark.parametrize("family,head,example,norm,param,compared,skipped", CASES, ids=IDS)
def test_saved_checkpoint_with_a_wrong_final_norm_fails_in_memory_and_blockwise(
        tmp_path, capsys, family, head, example, norm, param, compared, skipped):
    """A streamed rotated checkpoint passes `normfold verify` in memory and block-wise with the same outputs
    compared; with its final norm's γ (or β) changed in the checkpoint, both fail."""
    from normfold.cli import main

    src = _source(tmp_path, family, head, example)
    (tmp_path / "st").mkdir()
    stream_convert(src, tmp_path / "st", rotate="hadamard", rotate_seed=2)

    def both():
        got = {}
        for flag in ("--no-blockwise", "--blockwise"):
            code = main(["verify", str(src), str(tmp_path / "st"), flag, "--json", "-q"])
            d = json.loads(capsys.readouterr().out)
            got[flag] = (code, d.get("verification", d))
        return got

    good = both()
    for flag, (code, d) in good.items():
        assert code == 0, (flag, d["fp64"])
        _check_good(d, compared, skipped)
    assert _names(good["--blockwise"][1]) == _names(good["--no-blockwise"][1])
    bw = good["--blockwise"][1]
    heads = {h["name"] for h in bw["fp64"]["heads"]}  # outputs computed from the original's last hidden states
    assert {c for c in compared if "hidden_states" not in c} <= heads

    _rewrite(tmp_path / "st", _key(tmp_path / "st", f"{norm}.{param}"), _scale)
    bad = both()
    for flag, (code, d) in bad.items():
        assert code != 0 and not d["passed"], flag
        assert not d["fp64"]["passed"], flag
    assert bad["--blockwise"][1]["blockwise"]["failed_blocks"] == []  # every block is right: the final norm is not


def test_blockwise_direct_call_reports_skipped(tmp_path):
    """verify_blockwise on a rotated WhisperModel: the encoder's final-norm outputs (γ/β in the decoder's
    cross-attention) are skipped, with the reason; the decoder's (γ/β kept) are compared."""
    src = _source(tmp_path, "whisper", "WhisperModel", "d32")
    (tmp_path / "st").mkdir()
    stream_convert(src, tmp_path / "st", rotate="orthogonal", rotate_seed=1)
    res = verify_blockwise(src, tmp_path / "st")
    assert res["passed"]
    assert set(res["skipped"]) == {"encoder_last_hidden_state", "encoder_hidden_states[2]"}
    assert "last_hidden_state" in _names(res) and "last_hidden_state" in _names(res, "working") | {
        r["name"] for r in res["working"]["outputs"]}


def test_clip_vision_raw_stream_is_compared_in_memory():
    """CLIPVisionModel: last_hidden_state is the raw stream (no final norm on it): compared, mapped by Qᵀ. A
    converted model wrong only on the patch tokens after the last block (pooler_output reads the class token
    alone) fails, where it passed when last_hidden_state and hidden_states[-1] were skipped."""
    from normfold.rotate import unrotate_outputs
    from normfold.verify import FinalNorms, compare_models

    ex = next(e for e in get_adapter("clip").examples if e.name == "vision")
    torch.manual_seed(0)
    model = realistic(ex.build("CLIPVisionModel", torch.float32))
    conv, report = normfold.convert(model, rotate="hadamard")
    inputs = get_adapter("clip").example_inputs(model, torch.Generator().manual_seed(0))
    kw = dict(centered=tuple(report.centered_outputs),
              output_map=unrotate_outputs(report.structure.rotation, tuple(report.centered_outputs)),
              final_norms=FinalNorms.of(report.structure))
    assert compare_models(model, conv, inputs, **kw).passed

    def wrong_patches(_m, _a, out):
        h = out[0] if isinstance(out, tuple) else out
        h = h.clone()
        h[:, 1:, 0] += 0.05 * h[:, 1:].abs().max()  # one coordinate: survives the re-centring
        h = h - h.mean(-1, keepdim=True)
        return (h, *out[1:]) if isinstance(out, tuple) else h

    conv.encoder.layers[-1].register_forward_hook(wrong_patches)
    bad = compare_models(model, conv, inputs, **kw)
    assert not bad.passed
    failing = {r["name"] for r in bad.working["outputs"] if not r["ok"]}
    assert "last_hidden_state (centred)" in failing and "pooler_output" not in failing


def test_cli_says_what_is_not_compared(tmp_path, capsys):
    """`normfold convert --rotate` and `normfold verify` (both modes) print the skipped outputs with the reason;
    a base model's compared final-norm output is not among them."""
    from normfold.cli import main

    src = _source(tmp_path, "whisper", "WhisperModel", "d32")
    assert main(["convert", str(src), "--rotate", "hadamard", "--out", str(tmp_path / "o"), "--stream", "never"]) == 0
    outs = [capsys.readouterr().out]
    for flag in ("--no-blockwise", "--blockwise"):
        assert main(["verify", str(src), str(tmp_path / "o"), flag]) == 0
        outs.append(capsys.readouterr().out)
    for out in outs:
        (line,) = [ln for ln in out.splitlines() if "not compared:" in ln]
        assert "encoder_last_hidden_state" in line and "encoder_hidden_states[2]" in line and "γ/β" in line
        assert " last_hidden_state" not in line.replace("encoder_last_hidden_state", "")
