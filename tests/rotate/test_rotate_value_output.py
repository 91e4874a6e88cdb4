"""The exact per-head rotation of the value/output projections (QuaRot), in the weights: float64 exactness on
every output per family and fused-QKV layout (grouped / multi-query KV included), refusal of unknown families,
composition with the stream rotation and both online Hadamards, save -> normfold.load, and the CLI flag."""

import copy
import json

import pytest
import torch

import normfold
from helpers import rel_err, run_flat
from normfold.rotate import HEAD_LAYOUTS, head_rotation, rotate_value_output
from test_rotate_families import _back, _build, _final_outputs, _ids, _qs, _ref

pytest.importorskip("transformers")

CASES = [("gpt2", "tied", "GPT2LMHeadModel"), ("gpt2", "untied-inv-idx", "GPT2LMHeadModel"),
         ("opt", "pre-ln", "OPTForCausalLM"), ("opt", "pre-ln-project-in-out-no-bias", "OPTForCausalLM"),
         ("gpt_neox", "parallel", "GPTNeoXForCausalLM"), ("gpt_neox", "sequential-no-bias-eps6", "GPTNeoXForCausalLM"),
         ("phi", "partial-rotary", "PhiForCausalLM"), ("phi", "qk-layernorm-eps6", "PhiForCausalLM"),
         ("gptj", "rotary4", "GPTJForCausalLM"), ("gpt_neo", "global-local-tied", "GPTNeoForCausalLM"),
         ("falcon", "new-arch-ln-attn-mlp", "FalconForCausalLM"), ("falcon", "parallel-mqa-7b-style", "FalconForCausalLM"),
         ("falcon", "sequential-alibi-bias-rw-style", "FalconForCausalLM"), ("bloom", "tied", "BloomForCausalLM")]


def test_head_rotation_is_orthogonal():
    for hd in (4, 8, 12, 6, 7):
        h, _ = head_rotation(hd, seed=5)
        assert torch.allclose(h @ h.T, torch.eye(hd, dtype=torch.float64), atol=1e-14)
    assert head_rotation(8)[1] == "randomized Hadamard" and head_rotation(7)[1] == "random orthogonal"


@pytest.mark.parametrize("case", CASES, ids=_ids(CASES))
def test_value_output_rotation_is_exact(case):
    _, model, inputs = _build(*case, torch.float64)
    rotated = copy.deepcopy(model)
    done = rotate_value_output(rotated, seed=1)
    assert done
    layout = HEAD_LAYOUTS[model.config.model_type]
    attn = rotated.get_submodule(done[0])
    before = model.get_submodule(done[0])
    # V and O really changed, and nothing else did
    changed = {n for (n, p), q in zip(rotated.named_parameters(), model.parameters()) if not torch.equal(p, q)}
    assert changed and all(n.startswith(tuple(f"{d}.{m}." for d in done for m in (layout.v, layout.o))) for n in changed)
    assert not torch.equal(getattr(attn, layout.o).weight, getattr(before, layout.o).weight)
    ref, got = run_flat(model, inputs), run_flat(rotated, inputs)
    for name in ref:
        assert rel_err(got[name], ref[name]) <= 1e-9, name


def test_grouped_kv_cases_have_groups():
    for case in [("falcon", "new-arch-ln-attn-mlp", "FalconForCausalLM"), ("falcon", "parallel-mqa-7b-style", "FalconForCausalLM")]:
        _, model, _ = _build(*case, torch.float64)
        h, kv, _ = HEAD_LAYOUTS["falcon"].heads(model.config)
        assert kv < h, case


@pytest.mark.parametrize("case", [("gpt_bigcode", "mqa-tied", "GPTBigCodeForCausalLM"), ("vit", "rgb16-p4", "ViTForImageClassification")],
                         ids=["gpt_bigcode", "vit"])
def test_unknown_family_is_refused(case):
    _, model, _ = _build(*case, torch.float64)
    with pytest.raises(normfold.NormfoldError, match=case[0]):
        rotate_value_output(model)


@pytest.mark.parametrize("case", CASES, ids=_ids(CASES))
def test_composes_with_stream_rotation_and_online_hadamards(case, tmp_path):
    _, model, inputs = _build(*case, torch.float64)
    conv, report = normfold.convert(model, rotate="hadamard", rotate_online=True, rotate_attention="both")
    rot = report.structure.rotation
    assert rot["value_output"]["layers"] >= 2 and rot["online"]
    assert report.verification["fp64"]["max_rel_error"] <= 1e-9
    qs = _qs(report)
    ref, got = run_flat(model, inputs), run_flat(conv, inputs)
    for name in ref:
        if name not in _final_outputs(ref):
            assert rel_err(_back(name, got[name], report, qs), _ref(name, ref[name], report)) <= 1e-9, name
    loaded = normfold.load(normfold.save(conv, report, tmp_path / "out"))
    for name, t in run_flat(loaded, inputs).items():
        if case[0] == "gptj":  # GPT-J reloads within 1e-10 even unrotated (its rotary tables are rebuilt)
            assert rel_err(t, got[name]) <= 1e-9, name
        else:
            assert torch.equal(t, got[name]), name


def test_vo_alone_is_weights_only_and_reloads(tmp_path):
    _, model, inputs = _build("opt", "pre-ln", "OPTForCausalLM", torch.float64)
    plain, rp = normfold.convert(model, rotate="hadamard")
    conv, report = normfold.convert(model, rotate="hadamard", rotate_attention="vo")
    assert report.stock_reloadable == rp.stock_reloadable and "online" not in report.structure.rotation
    assert report.verification["passed"] and report.verification["fp64"]["max_rel_error"] <= 1e-9
    v = "model.decoder.layers.0.self_attn.v_proj.weight"
    assert not torch.equal(dict(conv.named_parameters())[v], dict(plain.named_parameters())[v])
    got = run_flat(conv, inputs)
    loaded = normfold.load(normfold.save(conv, report, tmp_path / "out"))
    for name, t in run_flat(loaded, inputs).items():
        assert torch.equal(t, got[name]), name
    assert report.stock_reloadable  # weights only: stock transformers runs it as it runs the plain rotation
    import transformers

    stock = transformers.OPTForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float64).eval()
    assert rel_err(run_flat(stock, inputs)["logits"], got["logits"]) <= 1e-9
    ids = inputs["input_ids"]
    ep = torch.export.export(loaded, (), {"input_ids": ids, "use_cache": False})
    assert rel_err(ep.module()(input_ids=ids, use_cache=False).logits, loaded(input_ids=ids, use_cache=False).logits) <= 1e-9


def test_needs_rotate_and_a_known_choice():
    _, model, _ = _build("gpt2", "tied", "GPT2LMHeadModel", torch.float32)
    with pytest.raises(normfold.NormfoldError, match="--rotate-attention needs --rotate"):
        normfold.convert(model, rotate_attention="vo")
    with pytest.raises(normfold.NormfoldError, match="unknown attention rotation"):
        normfold.convert(model, rotate="hadamard", rotate_attention="xy")


def test_cli_rotate_attention(tmp_path, capsys):
    from normfold.cli import main

    _, model, _ = _build("gpt_neox", "parallel", "GPTNeoXForCausalLM", torch.float32)
    model.save_pretrained(tmp_path / "src")
    code = main(["convert", str(tmp_path / "src"), "--rotate", "hadamard", "--rotate-attention", "vo",
                 "--out", str(tmp_path / "out"), "-q"])
    assert code == 0, capsys.readouterr().err
    rep = json.loads((tmp_path / "out" / "normfold.json").read_text())
    assert rep["structure"]["rotation"]["value_output"]["layers"] == 2 and rep["verification"]["passed"]
    capsys.readouterr()
    # the streamed conversion cannot do it: --stream always refuses, nothing written
    code = main(["convert", str(tmp_path / "src"), "--rotate", "hadamard", "--rotate-attention", "both",
                 "--stream", "always", "--out", str(tmp_path / "s"), "-q"])
    err = capsys.readouterr().err
    assert code == 2 and "--rotate-attention" in err and "Traceback" not in err
    assert not (tmp_path / "s").exists()
    code = main(["convert", str(tmp_path / "src"), "--rotate-attention", "vo", "--out", str(tmp_path / "n"), "-q"])
    err = capsys.readouterr().err
    assert code == 2 and "needs --rotate" in err and not (tmp_path / "n").exists()
