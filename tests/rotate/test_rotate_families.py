"""Rotated conversions per adapter family (issue 25): float64 exactness on every output (stream outputs
mapped back by Qᵀ), a zero-mean rotated stream, save -> normfold.load and stock reload, refusals with
their reasons, and the CLI."""

import copy
import json

import pytest
import torch

import normfold
from helpers import realistic, rel_err, run_flat
from normfold.adapters import list_adapters
from normfold.algebra import rotation_matrix

pytest.importorskip("transformers")

F32_EPS = torch.finfo(torch.float32).eps

ROTATABLE = [
    ("gpt2", "tied", "GPT2LMHeadModel"), ("gpt2", "untied-inv-idx", "GPT2LMHeadModel"),
    ("gpt2", "tied", "GPT2ForSequenceClassification"),
    ("gpt_neo", "global-local-tied", "GPTNeoForCausalLM"), ("gpt_neo", "local-untied-eps6", "GPTNeoForCausalLM"),
    ("gptj", "rotary4", "GPTJForCausalLM"), ("gptj", "full-rotary-eps6", "GPTJForCausalLM"),
    ("gpt_neox", "parallel", "GPTNeoXForCausalLM"), ("gpt_neox", "sequential-no-bias-eps6", "GPTNeoXForCausalLM"),
    ("opt", "pre-ln", "OPTForCausalLM"), ("opt", "pre-ln-project-in-out-no-bias", "OPTForCausalLM"),
    ("phi", "partial-rotary", "PhiForCausalLM"),
    ("gpt_bigcode", "mqa-tied", "GPTBigCodeForCausalLM"), ("gpt_bigcode", "mha-untied-eps6", "GPTBigCodeForCausalLM"),
    ("falcon", "new-arch-ln-attn-mlp", "FalconForCausalLM"), ("falcon", "new-arch-one-ln-bias-eps6", "FalconForCausalLM"),
    ("falcon", "parallel-mqa-7b-style", "FalconForCausalLM"),
    ("falcon", "sequential-alibi-bias-rw-style", "FalconForCausalLM"),
    ("vit", "rgb16-p4", "ViTForImageClassification"), ("vit", "gray12-noqkvbias-eps6", "ViTForMaskedImageModeling"),
    ("deit", "rgb16-p4", "DeiTForImageClassificationWithTeacher"),
    ("clip", "text", "CLIPTextModelWithProjection"), ("siglip", "text", "SiglipTextModel"),
    ("siglip2", "text", "Siglip2TextModel"), ("whisper", "d24-untied-3x2", "WhisperForCausalLM"),
    ("phi", "qk-layernorm-eps6", "PhiForCausalLM"),
    # explicit rotations: after a Recenter (non-linear stem / a norm on the stream), before a head-less final norm
    ("gpt2", "tied", "GPT2Model"), ("opt", "pre-ln", "OPTModel"), ("clip", "text", "CLIPTextModel"),
    ("bloom", "tied", "BloomForCausalLM"), ("bloom", "untied-eps6-tp2", "BloomForCausalLM"),
    ("clip", "vision", "CLIPVisionModelWithProjection"), ("clip", "dual-eps6-eos2", "CLIPModel"),
    ("whisper", "d32", "WhisperForConditionalGeneration"), ("whisper", "d32", "WhisperModel"),
    ("mbart", "d32-scaled", "MBartForConditionalGeneration"), ("mbart", "d24-3x2-untied", "MBartForConditionalGeneration"),
    ("siglip", "vision-no-head-eps5", "SiglipVisionModel"),
]
BASE = [c for c in ROTATABLE if c[2] in ("GPT2Model", "OPTModel", "CLIPTextModel", "WhisperModel", "SiglipVisionModel")]
REFUSED = [
    ("opt", "post-ln-no-affine-350m-style", "OPTForCausalLM", "post-LN"),
    ("bert", "base", "BertForMaskedLM", "Post-LN"),
    ("bloom", "residual-post-layernorm", "BloomForCausalLM", "apply_residual_connection_post_layernorm"),
    ("bart", "d32", "BartForConditionalGeneration", "Post-LN"),
    ("siglip", "vision-map-head", "SiglipVisionModel", "not a linear module"),
]


def _case(adapter_name, example_name):
    for a in list_adapters():
        if a.name == adapter_name:
            for ex in a.examples:
                if ex.name == example_name:
                    return a, ex
    raise KeyError((adapter_name, example_name))


def _build(adapter_name, example_name, head, dtype):
    adapter, ex = _case(adapter_name, example_name)
    torch.manual_seed(0)
    model = realistic(ex.build(head, dtype))
    return adapter, model, adapter.example_inputs(model, torch.Generator().manual_seed(0))


def _qs(report):
    rot = report.structure.rotation
    return {s["width"]: rotation_matrix(rot["kind"], s["width"], rot["seed"])[0] for s in rot["streams"]}


def _is_stream(name, report):
    import fnmatch

    return any(fnmatch.fnmatchcase(name, p) for p in report.centered_outputs)


def _back(name, t, report, qs):
    """An output of the rotated model in the original basis (stream outputs: centred, times Qᵀ)."""
    t = t.double()
    if _is_stream(name, report):
        t = t - t.mean(-1, keepdim=True)
        q = qs.get(t.shape[-1])
        if q is not None:
            t = t @ q.T
    return t


def _ref(name, t, report):
    t = t.double()
    return t - t.mean(-1, keepdim=True) if _is_stream(name, report) else t


def _final_outputs(names):
    """The final norm's outputs (γ/β folded into the heads, so not comparable): last_hidden_state and the
    last entry of every hidden_states tuple."""
    import re

    last = {}
    for n in names:
        m = re.fullmatch(r"(.*hidden_states)\[(\d+)\]", n)
        if m:
            last[m.group(1)] = max(last.get(m.group(1), -1), int(m.group(2)))
    return {f"{k}[{i}]" for k, i in last.items()} | {n for n in names if n.endswith("last_hidden_state")}


def _ids(cases):
    return ["-".join(c[:3]) for c in cases]


@pytest.mark.parametrize("kind", ["hadamard", "orthogonal"])
@pytest.mark.parametrize("case", ROTATABLE, ids=_ids(ROTATABLE))
def test_rotated_float64_is_exact_on_every_output(case, kind):
    adapter, model, inputs = _build(*case, torch.float64)
    conv, report = normfold.convert(model, rotate=kind, rotate_seed=5, verify=False)
    explicit = report.structure.rotation.get("explicit", [])
    assert report.structure.rotation["kind"] == kind and report.stock_reloadable == (not explicit)
    if case in BASE:  # the output is the stream itself: its final norm keeps γ/β and reads the stream rotated back
        assert any(e["transpose"] for e in explicit)
        got_last = run_flat(conv, inputs)["last_hidden_state"]
        assert rel_err(got_last, run_flat(model, inputs)["last_hidden_state"]) <= 1e-9
    qs = _qs(report)
    ref, got = run_flat(model, inputs), run_flat(conv, inputs)
    assert set(got) == set(ref)
    checked = 0
    for name in ref:
        if name in _final_outputs(ref):
            continue
        err = rel_err(_back(name, got[name], report, qs), _ref(name, ref[name], report))
        assert err <= 1e-9, (name, err)
        checked += 1
        if _is_stream(name, report) and got[name].shape[-1] in qs:  # the rotated stream stays zero-mean
            g = got[name]
            assert float(g.mean(-1).abs().max()) <= 1e-12 * float(g.abs().max()), name
    assert checked >= 2
    # the stream really is rotated: a hidden state differs from the (centred) original
    streams = [n for n in ref if _is_stream(n, report) and n not in _final_outputs(ref) and got[n].shape[-1] in qs]
    if streams:
        n = streams[-1]
        assert rel_err(got[n], _ref(n, ref[n], report)) > 1e-2


@pytest.mark.parametrize("case", ROTATABLE[::3], ids=_ids(ROTATABLE[::3]))
def test_rotated_save_load_and_stock_reload(case, tmp_path):
    import transformers

    adapter, model, inputs = _build(*case, torch.float32)
    conv, report = normfold.convert(model, rotate="hadamard")
    assert report.verification["passed"], report.verification
    assert report.verification["fp64"]["max_rel_error"] <= 1e-9
    out = normfold.save(conv, report, tmp_path / "out")
    rep = json.loads((out / "normfold.json").read_text())
    assert rep["structure"]["rotation"]["kind"] == "hadamard"
    loaded = normfold.load(out)
    assert loaded.normfold_report.structure.rotation == report.structure.rotation
    got = run_flat(conv, inputs)
    for name, t in run_flat(loaded, inputs).items():
        assert torch.equal(t, got[name]), name
    if not report.stock_reloadable:
        assert report.structure.rotation.get("explicit") or report.structure.rotation.get("online") or \
            not normfold.convert(model, verify=False)[1].stock_reloadable
        return
    stock = getattr(transformers, case[2]).from_pretrained(out).eval()
    assert not any(type(m).__module__.startswith("normfold") for m in stock.modules())
    qs = _qs(report)
    exact = run_flat(model.double(), inputs)
    model.float()
    orig, re = run_flat(model, inputs), run_flat(stock, inputs)
    for name in exact:
        if name in _final_outputs(exact):
            continue
        e = _ref(name, exact[name], report)
        base = rel_err(_ref(name, orig[name], report), e)
        assert rel_err(_back(name, re[name], report, qs), e) <= 4 * base + 64 * F32_EPS, name


EXPLICIT_EXPORT = [("gpt2", "tied", "GPT2Model"), ("bloom", "tied", "BloomForCausalLM")]


@pytest.mark.parametrize("case", EXPLICIT_EXPORT, ids=_ids(EXPLICIT_EXPORT))
def test_explicit_rotations_reload_and_export(case, tmp_path):
    adapter, model, inputs = _build(*case, torch.float32)
    conv, report = normfold.convert(model, rotate="hadamard")
    assert report.verification["passed"] and report.structure.rotation["explicit"]
    loaded = normfold.load(normfold.save(conv, report, tmp_path / "out"))
    got = run_flat(conv, inputs)
    for name, t in run_flat(loaded, inputs).items():
        assert torch.equal(t, got[name]), name
    ids = inputs["input_ids"]
    ep = torch.export.export(loaded, (), {"input_ids": ids, "use_cache": False})
    want = loaded(input_ids=ids, use_cache=False)[0]
    assert rel_err(ep.module()(input_ids=ids, use_cache=False)[0], want) <= 1e-5


def test_width_without_hadamard_uses_a_random_orthogonal_rotation():
    import transformers

    cfg = transformers.GPT2Config(n_embd=36, n_layer=2, n_head=3, vocab_size=64, n_positions=16)
    torch.manual_seed(0)
    model = realistic(transformers.GPT2LMHeadModel(cfg).eval())
    conv, report = normfold.convert(model, rotate="hadamard")
    assert report.structure.rotation["streams"][0]["construction"] == "orthogonal"
    assert report.verification["passed"] and report.verification["fp64"]["max_rel_error"] <= 1e-9


@pytest.mark.parametrize("case", REFUSED, ids=_ids(REFUSED))
def test_refusals_say_why(case):
    adapter, model, _ = _build(*case[:3], torch.float32)
    with pytest.raises(normfold.NormfoldError, match="cannot rotate") as err:
        normfold.convert(model, rotate="hadamard")
    assert case[3] in str(err.value)


def test_rotate_only_with_rmsnorm_and_without_keep_affine():
    _, model, _ = _build("gpt2", "tied", "GPT2LMHeadModel", torch.float32)
    with pytest.raises(normfold.NormfoldError, match="--to rmsnorm"):
        normfold.convert(model, to="crmsnorm", rotate="hadamard")
    with pytest.raises(normfold.NormfoldError, match="keep-affine"):
        normfold.convert(model, rotate="hadamard", keep_affine=True)
    with pytest.raises(normfold.NormfoldError, match="unknown rotation"):
        normfold.convert(model, rotate="givens")


def test_cli_rotate(tmp_path, capsys):
    from normfold.cli import main

    _, model, _ = _build("opt", "pre-ln", "OPTForCausalLM", torch.float32)
    model.save_pretrained(tmp_path / "src")
    code = main(["convert", str(tmp_path / "src"), "--rotate", "orthogonal", "--rotate-seed", "3",
                 "--out", str(tmp_path / "out"), "-q"])
    assert code == 0, capsys.readouterr().err
    rep = json.loads((tmp_path / "out" / "normfold.json").read_text())
    assert rep["structure"]["rotation"] == {"kind": "orthogonal", "seed": 3,
                                            "streams": [{"name": "decoder", "width": 24, "construction": "orthogonal"}]}
    assert rep["verification"]["passed"]
    _, bloom, _ = _build("bert", "base", "BertForMaskedLM", torch.float32)
    bloom.save_pretrained(tmp_path / "bloom")
    capsys.readouterr()
    code = main(["convert", str(tmp_path / "bloom"), "--rotate", "hadamard", "--out", str(tmp_path / "b"), "-q"])
    err = capsys.readouterr().err
    assert code == 2 and "cannot rotate" in err and "Traceback" not in err
    assert not (tmp_path / "b").exists()


ONLINE = [("gpt2", "tied", "GPT2LMHeadModel"), ("opt", "pre-ln", "OPTForCausalLM"),
          ("gpt_neox", "parallel", "GPTNeoXForCausalLM"), ("phi", "partial-rotary", "PhiForCausalLM")]


@pytest.mark.parametrize("case", ONLINE, ids=_ids(ONLINE))
def test_online_hadamard_is_exact_reloads_and_exports(case, tmp_path):
    adapter, model, inputs = _build(*case, torch.float64)
    conv, report = normfold.convert(model, rotate="hadamard", rotate_online=True)
    online = report.structure.rotation["online"]
    assert online and not report.stock_reloadable
    assert report.verification["fp64"]["max_rel_error"] <= 1e-9
    qs = _qs(report)
    ref, got = run_flat(model, inputs), run_flat(conv, inputs)
    for name in ref:
        if name not in _final_outputs(ref):
            assert rel_err(_back(name, got[name], report, qs), _ref(name, ref[name], report)) <= 1e-9, name
    # the down-projection really sees a rotated input: its weight differs from the plain rotation's
    plain, _ = normfold.convert(model, rotate="hadamard", verify=False)
    w_on = dict(conv.named_parameters())[online[0] + ".weight"]
    w_pl = dict(plain.named_parameters())[online[0] + ".weight"]
    assert (w_on - w_pl).abs().max() > 1e-3 * w_pl.abs().max()
    out = normfold.save(conv, report, tmp_path / "out")
    loaded = normfold.load(out)
    for name, t in run_flat(loaded, inputs).items():
        assert torch.equal(t, got[name]), name
    ids = inputs["input_ids"]
    ep = torch.export.export(loaded, (), {"input_ids": ids, "use_cache": False})
    want = loaded(input_ids=ids, use_cache=False).logits
    assert rel_err(ep.module()(input_ids=ids, use_cache=False).logits, want) <= 1e-9


def test_online_needs_rotate():
    _, model, _ = _build("gpt2", "tied", "GPT2LMHeadModel", torch.float32)
    with pytest.raises(normfold.NormfoldError, match="--rotate-online needs --rotate"):
        normfold.convert(model, rotate_online=True)


def test_cli_verify_a_rotated_checkpoint(tmp_path, capsys):
    from normfold.cli import main

    _, model, _ = _build("gpt_neox", "parallel", "GPTNeoXForCausalLM", torch.float32)
    model.save_pretrained(tmp_path / "src")
    assert main(["convert", str(tmp_path / "src"), "--rotate", "hadamard", "--out", str(tmp_path / "out"), "-q"]) == 0
    capsys.readouterr()
    code = main(["verify", str(tmp_path / "src"), str(tmp_path / "out"), "--json", "-q"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert json.loads(out)["passed"]


def test_zero_gamma_that_must_stay_is_refused():
    _, model, _ = _build("gpt2", "tied", "GPT2LMHeadModel", torch.float32)
    with torch.no_grad():
        model.transformer.ln_f.weight[3] = 0.0  # lm_head has no bias: β stays as β/γ
    with pytest.raises(normfold.NormfoldError, match="zero entries"):
        normfold.convert(model, rotate="hadamard")


@pytest.mark.parametrize("bad", [
    {"path": "h.0", "where": "output", "width": 10 ** 6, "transpose": False},
    {"path": "ln_f.__class__", "where": "output", "width": 24, "transpose": False},
    {"path": "ln_f", "where": "sideways", "width": 24, "transpose": False},
    {"path": "ln_f", "where": "input", "width": 24, "extra": 1},
])
def test_hostile_rotation_records_are_refused(bad, tmp_path):
    _, model, _ = _build("gpt2", "tied", "GPT2Model", torch.float32)
    conv, report = normfold.convert(model, rotate="hadamard", verify=False)
    out = normfold.save(conv, report, tmp_path / "out")
    rep = json.loads((out / "normfold.json").read_text())
    rep["structure"]["rotation"]["explicit"] = [bad]
    (out / "normfold.json").write_text(json.dumps(rep))
    with pytest.raises(normfold.NormfoldError, match="rotation"):
        normfold.load(out)


def test_reverse_conversions_of_rotated_checkpoints(tmp_path):
    """Weights-only rotation: --to layernorm gives a stock LayerNorm model with the same function; a
    checkpoint with explicit rotation ops is refused (the reverse conversions would drop them)."""
    _, model, inputs = _build("gpt2", "tied", "GPT2LMHeadModel", torch.float32)
    conv, report = normfold.convert(model, rotate="hadamard")
    loaded = normfold.load(normfold.save(conv, report, tmp_path / "a"))
    back, back_report = normfold.convert(loaded, to="layernorm")
    # its float64 check allows the stored float32 weights' own rounding (7e-9 here; compress.reverse.input_rounding)
    assert back_report.verification["fp64"]["passed"], back_report.verification["fp64"]
    assert not any(type(m).__module__.startswith("normfold") for m in back.modules())
    got, orig = run_flat(back, inputs)["logits"], run_flat(model, inputs)["logits"]
    exact = run_flat(copy.deepcopy(model).double(), inputs)["logits"]
    assert rel_err(got, exact) <= 4 * rel_err(orig, exact) + 64 * F32_EPS
    _, base, _ = _build("gpt2", "tied", "GPT2Model", torch.float32)
    conv, report = normfold.convert(base, rotate="hadamard")
    loaded = normfold.load(normfold.save(conv, report, tmp_path / "b"))
    with pytest.raises(normfold.NormfoldError, match="explicit / online rotation"):
        normfold.convert(loaded, to="layernorm")
