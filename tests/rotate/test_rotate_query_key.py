"""The per-head rotation of queries and keys (QuaRot's keys for a 4-bit KV cache): in the Q/K weights for learned
positions and ALiBi, after the rotary positions at run time otherwise. Float64 exactness on every output against
the original model per family and fused-QKV layout (grouped / multi-query KV included), the keys the attention
function receives really rotated, incremental decoding with a KV cache, composition with every other rotation,
save -> normfold.load, torch.export, refusals and the CLI flag."""

import copy
import json

import pytest
import torch

import normfold
from helpers import rel_err, run_flat
from normfold.nn.attention import add_attention_hook, has_qk_rotation
from normfold.rotate import HEAD_LAYOUTS, QK_LAYOUTS, head_rotation, rotate_query_key
from test_rotate_families import _back, _build, _final_outputs, _ids, _qs, _ref
from test_rotate_value_output import CASES

pytest.importorskip("transformers")

ONLINE = {"gpt_neox", "gptj", "phi"}


def _is_online(model):
    return QK_LAYOUTS[model.config.model_type].rotary(model.config)


def _keys_seen(model, ids):
    """The keys each hookable attention module hands to its attention function (None where not hookable)."""
    seen = []
    pattern = HEAD_LAYOUTS[model.config.model_type].attention
    import re

    for path, m in model.named_modules():
        if re.search(pattern, path):
            try:
                add_attention_hook(m, lambda mod, q, k, v: (seen.append(k.detach().clone()), (q, k, v))[1])
            except ValueError:
                return None
    with torch.no_grad():
        model(input_ids=ids, use_cache=False)
    return seen


@pytest.mark.parametrize("case", CASES, ids=_ids(CASES))
def test_query_key_rotation_is_exact(case):
    _, model, inputs = _build(*case, torch.float64)
    rotated = copy.deepcopy(model)
    done = rotate_query_key(rotated, seed=1)
    assert done
    changed = {n for (n, p), q in zip(rotated.named_parameters(), model.parameters()) if not torch.equal(p, q)}
    if _is_online(model):
        assert model.config.model_type in ONLINE | {"falcon"} and not changed
        assert all(has_qk_rotation(rotated.get_submodule(p)) for p in done)
    else:
        lay = QK_LAYOUTS[model.config.model_type]
        assert changed and all(n.startswith(tuple(f"{d}.{m}." for d in done for m in (lay.q, lay.k))) for n in changed)
    ref, got = run_flat(model, inputs), run_flat(rotated, inputs)
    for name in ref:
        assert rel_err(got[name], ref[name]) <= 1e-9, name
    # the keys the attention function sees are k·R (an independent check that something was rotated)
    ids = inputs["input_ids"]
    k0, k1 = _keys_seen(copy.deepcopy(model), ids), _keys_seen(copy.deepcopy(rotated), ids)
    if k0 is not None:
        hd = k0[0].shape[-1]
        r, _ = head_rotation(hd, 1)
        for a, b in zip(k0, k1):
            assert rel_err(b, a @ r) <= 1e-12 and rel_err(b, a) > 0.1


@pytest.mark.parametrize("case", [c for c in CASES if c[0] in ONLINE or c[1] == "new-arch-ln-attn-mlp"],
                         ids=_ids([c for c in CASES if c[0] in ONLINE or c[1] == "new-arch-ln-attn-mlp"]))
def test_online_rotation_decodes_with_a_kv_cache(case):
    _, model, inputs = _build(*case, torch.float64)
    rotated = copy.deepcopy(model)
    rotate_query_key(rotated, seed=2)
    ids = inputs["input_ids"][:1]
    with torch.no_grad():
        full = model(input_ids=ids, use_cache=False).logits
        out = rotated(input_ids=ids[:, :-2], use_cache=True)
        step = rotated(input_ids=ids[:, -2:-1], cache=out.cache, use_cache=True)
        last = rotated(input_ids=ids[:, -1:], cache=step.cache, use_cache=True)
    assert rel_err(out.logits, full[:, :-2]) <= 1e-9
    assert rel_err(step.logits[:, -1], full[:, -2]) <= 1e-9 and rel_err(last.logits[:, -1], full[:, -1]) <= 1e-9


@pytest.mark.parametrize("case", CASES, ids=_ids(CASES))
def test_all_attention_rotations_with_stream_rotation_reload_and_export(case, tmp_path):
    _, model, inputs = _build(*case, torch.float64)
    conv, report = normfold.convert(model, rotate="hadamard", rotate_online=True, rotate_attention="all")
    rot = report.structure.rotation
    qk = rot["query_key"]
    assert qk["layers"] >= 2 and rot["value_output"]["layers"] >= 2 and rot["online"]
    assert ("online" in qk) == _is_online(model)
    assert report.verification["fp64"]["max_rel_error"] <= 1e-9
    qs = _qs(report)
    ref, got = run_flat(model, inputs), run_flat(conv, inputs)
    for name in ref:
        if name not in _final_outputs(ref):
            assert rel_err(_back(name, got[name], report, qs), _ref(name, ref[name], report)) <= 1e-9, name
    loaded = normfold.load(normfold.save(conv, report, tmp_path / "out"))
    if "online" in qk:
        assert all(has_qk_rotation(loaded.get_submodule(p)) for p in qk["online"])
    for name, t in run_flat(loaded, inputs).items():
        if case[0] == "gptj":  # GPT-J reloads within 1e-10 even unrotated (its rotary tables are rebuilt)
            assert rel_err(t, got[name]) <= 1e-9, name
        else:
            assert torch.equal(t, got[name]), name
    if case[0] in ("gpt_neox", "gpt2", "falcon"):
        ids = inputs["input_ids"]
        ep = torch.export.export(loaded, (), {"input_ids": ids, "use_cache": False})
        assert rel_err(ep.module()(input_ids=ids, use_cache=False).logits,
                       loaded(input_ids=ids, use_cache=False).logits) <= 1e-9


def test_qk_alone_in_the_weights_stays_stock_reloadable(tmp_path):
    _, model, inputs = _build("opt", "pre-ln", "OPTForCausalLM", torch.float64)
    plain, rp = normfold.convert(model, rotate="hadamard")
    conv, report = normfold.convert(model, rotate="hadamard", rotate_attention="qk")
    assert report.stock_reloadable == rp.stock_reloadable and "online" not in report.structure.rotation["query_key"]
    k = "model.decoder.layers.0.self_attn.k_proj.bias"
    assert not torch.equal(dict(conv.named_parameters())[k], dict(plain.named_parameters())[k])
    import transformers

    normfold.save(conv, report, tmp_path / "out")
    stock = transformers.OPTForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float64).eval()
    assert rel_err(run_flat(stock, inputs)["logits"], run_flat(conv, inputs)["logits"]) <= 1e-9


def test_online_qk_changes_no_weight_and_reloads_stock(tmp_path):
    _, model, inputs = _build("gpt_neox", "parallel", "GPTNeoXForCausalLM", torch.float64)
    plain, rp = normfold.convert(model, rotate="hadamard")
    conv, report = normfold.convert(model, rotate="hadamard", rotate_attention="qk")
    assert report.structure.rotation["query_key"]["online"] and report.stock_reloadable == rp.stock_reloadable
    assert all(torch.equal(p, q) for p, q in zip(conv.parameters(), plain.parameters()))
    assert model.config._attn_implementation != "normfold_hooked"  # the model's own config is untouched
    assert conv.config._attn_implementation != "normfold_hooked"
    import transformers

    normfold.save(conv, report, tmp_path / "out")
    stock = transformers.GPTNeoXForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float64).eval()
    assert rel_err(run_flat(stock, inputs)["logits"], run_flat(conv, inputs)["logits"]) <= 1e-9


@pytest.mark.parametrize("case", [("gpt_bigcode", "mqa-tied", "GPTBigCodeForCausalLM"), ("vit", "rgb16-p4", "ViTForImageClassification")],
                         ids=["gpt_bigcode", "vit"])
def test_unknown_family_is_refused(case):
    _, model, _ = _build(*case, torch.float64)
    with pytest.raises(normfold.NormfoldError, match=case[0]):
        rotate_query_key(model)


def test_cli_rotate_attention_qk(tmp_path, capsys):
    from normfold.cli import main

    _, model, _ = _build("phi", "partial-rotary", "PhiForCausalLM", torch.float32)
    model.save_pretrained(tmp_path / "src")
    code = main(["convert", str(tmp_path / "src"), "--rotate", "hadamard", "--rotate-attention", "qk",
                 "--out", str(tmp_path / "out"), "-q"])
    assert code == 0, capsys.readouterr().err
    rep = json.loads((tmp_path / "out" / "normfold.json").read_text())
    assert rep["structure"]["rotation"]["query_key"]["online"] and rep["verification"]["passed"]
    assert rep["options"]["rotate_attention"] == "qk"
    capsys.readouterr()
    code = main(["convert", str(tmp_path / "src"), "--rotate-attention", "qk", "--out", str(tmp_path / "n"), "-q"])
    err = capsys.readouterr().err
    assert code == 2 and "needs --rotate" in err and not (tmp_path / "n").exists()


def test_a_bad_query_key_record_is_refused(tmp_path):
    _, model, _ = _build("gpt_neox", "parallel", "GPTNeoXForCausalLM", torch.float32)
    conv, report = normfold.convert(model, rotate="hadamard", rotate_attention="qk")
    out = normfold.save(conv, report, tmp_path / "out")
    rep = json.loads((tmp_path / "out" / "normfold.json").read_text())
    rep["structure"]["rotation"]["query_key"]["online"] = ["gpt_neox.layers.9.attention"]
    (tmp_path / "out" / "normfold.json").write_text(json.dumps(rep))
    with pytest.raises(normfold.NormfoldError, match="query/key rotation"):
        normfold.load(out)


def test_cli_verify_a_qk_checkpoint(tmp_path, capsys):
    from normfold.cli import main

    _, model, _ = _build("gptj", "rotary4", "GPTJForCausalLM", torch.float32)
    model.save_pretrained(tmp_path / "src")
    assert main(["convert", str(tmp_path / "src"), "--rotate", "hadamard", "--rotate-online", "--rotate-attention",
                 "all", "--out", str(tmp_path / "out"), "-q"]) == 0
    capsys.readouterr()
    code = main(["verify", str(tmp_path / "src"), str(tmp_path / "out")])
    assert code == 0, capsys.readouterr().err
