"""A Pre-RMSNorm checkpoint whose stream has explicit Recenters (the tied table kept original with a Recenter
after the embedding, a non-linear stem, a norm sitting on the stream) is stock-reloadable: stock transformers
loads model.safetensors, every norm a LayerNorm again (γ 1 / β 0 where folded), and LN(x) = LN(x − mean x)
re-centres what the Recenter would have. So the stock model, without any Recenter, computes the original's
outputs; only the hidden states (the raw stream) differ, by a per-token constant, from the original's and from
normfold.load's (which re-attaches the Recenters). Checked per family and head in float64 against the
original, by transformers alone (no normfold module, no hook). Where it does not hold (a head tied to the
centred table, nn.TiedHead, or an added bias) the checkpoint stays marked not stock-reloadable: the last tests
show why.
"""

import fnmatch

import pytest
import torch
from torch import nn

import normfold
from helpers import realistic, rel_err, run_flat
from normfold.adapters import list_adapters
from normfold.conversion import recentre_tied_tables
from normfold.options import ConvertOptions

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()


def build(example, head, dtype=torch.float64):
    torch.manual_seed(0)
    return realistic(example.build(head, dtype))


def _recenter_cases():
    """Every family example and head whose default conversion carries a Recenter (decided on meta: cheap)."""
    cases = []
    for a in list_adapters():
        for ex in a.examples:
            for head in ex.heads:
                if not hasattr(transformers, head):
                    continue
                with torch.device("meta"):
                    model = ex.build(head)
                p = recentre_tied_tables(model, a.plan(model), ConvertOptions())
                if any(st.recenter_after or st.recenter_before for st in p.streams):
                    cases.append((a, ex, head))
    return cases


CASES = _recenter_cases()
IDS = [f"{a.name}-{ex.name}-{head}" for a, ex, head in CASES]


def _tied(model):
    owner = {id(m.weight): n for n, m in model.named_modules() if isinstance(m, nn.Embedding)}
    return [(n, owner[id(m.weight)]) for n, m in model.named_modules()
            if isinstance(m, nn.Linear) and id(m.weight) in owner]


def _centre(t):
    return t - t.mean(-1, keepdim=True)


def _assert_outputs_match(got, ref, centred, tol=1e-9):
    """Every output within tol of the original's; the raw stream (centred outputs) up to a per-token constant."""
    for name in ref:
        if any(fnmatch.fnmatch(name, p) for p in centred):
            assert rel_err(_centre(got[name]), _centre(ref[name])) <= tol, name
        else:
            assert rel_err(got[name], ref[name]) <= tol, name


def test_every_family_with_a_recenter_is_covered():
    names = {a.name for a, _, _ in CASES}
    assert {"gpt2", "gpt_neo", "gpt_neox", "opt", "phi", "gpt_bigcode", "falcon", "bert", "roberta", "distilbert",
            "electra", "whisper", "mbart", "bart", "bloom", "clip", "siglip2"} <= names, names


@pytest.mark.parametrize("adapter,example,head", CASES, ids=IDS)
def test_stock_transformers_reloads_the_recenter_form(adapter, example, head, tmp_path):
    model = build(example, head)
    inputs = adapter.example_inputs(model, torch.Generator().manual_seed(0))
    conv, report = normfold.convert(model, verify=False)
    s = report.structure
    assert s.recenter_after or s.recenter_before
    assert report.stock_reloadable and report.to_dict()["reload"]["stock_transformers"] is True
    assert "Recenter" in report.to_dict()["reload"]["how"]
    out = normfold.save(conv, report, tmp_path / "out")
    assert (out / "model.safetensors").is_file() and not (out / "normfold_model.safetensors").exists()
    stock = getattr(transformers, head).from_pretrained(out, dtype=torch.float64).eval()
    assert not any(type(m).__module__.startswith("normfold") for m in stock.modules())
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in stock.modules())  # no Recenter there
    for h, t in _tied(model):  # the tie is one tensor in the stock model too, and the table the original
        assert stock.get_submodule(h).weight is stock.get_submodule(t).weight
        assert torch.equal(stock.get_submodule(t).weight, model.get_submodule(t).weight)
    ref, got = run_flat(model, inputs), run_flat(stock, inputs)
    centred = report.centered_outputs
    assert set(got) == set(ref)
    _assert_outputs_match(got, ref, centred)
    # normfold.load reads the same file and re-attaches the Recenters: the converted model's outputs exactly
    loaded = normfold.load(out, fast=False)
    want = run_flat(conv, inputs)
    for name, value in run_flat(loaded, inputs).items():
        assert rel_err(value, want[name]) <= 1e-12, name


CAUSAL = [c for c in CASES if c[2].endswith(("ForCausalLM", "LMHeadModel")) and _tied(c[1].build(c[2]))]


@pytest.mark.parametrize("adapter,example,head", CAUSAL, ids=[f"{a.name}-{ex.name}-{h}" for a, ex, h in CAUSAL])
def test_stock_reloaded_tied_model_generates_the_original_tokens(adapter, example, head, tmp_path):
    model = build(example, head)
    conv, report = normfold.convert(model, verify=False)
    stock = getattr(transformers, head).from_pretrained(normfold.save(conv, report, tmp_path / "out"),
                                                        dtype=torch.float64).eval()
    prompt = torch.randint(3, model.config.vocab_size, (2, 5), generator=torch.Generator().manual_seed(1))
    kw = dict(max_new_tokens=8, do_sample=False, pad_token_id=0, attention_mask=torch.ones_like(prompt))
    with torch.no_grad():
        assert torch.equal(stock.generate(prompt, **kw), model.generate(prompt, **kw))


def test_streamed_recenter_form_is_stock_reloadable(tmp_path):
    """normfold.stream makes the same decision and writes the same stock file."""
    from normfold.cli import main

    a = next(x for x in list_adapters() if x.name == "gpt2")
    model = build(a.examples[0], "GPT2LMHeadModel", torch.float32)
    model.save_pretrained(tmp_path / "src")
    for mode in ("always", "never"):
        assert main(["convert", str(tmp_path / "src"), "--out", str(tmp_path / mode), "--stream", mode, "-q"]) == 0
    files = [(tmp_path / mode / "model.safetensors").read_bytes() for mode in ("always", "never")]
    assert files[0] == files[1]
    stock = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "always").eval()
    assert stock.lm_head.weight is stock.transformer.wte.weight
    ids = torch.randint(0, model.config.vocab_size, (2, 6), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        exact = model.double()(ids).logits
        base = rel_err(model.float()(ids).logits, exact)
        assert rel_err(stock(ids).logits, exact) <= 4 * base + 64 * torch.finfo(torch.float32).eps


# ---- the analysis' plan (--auto): its Recenters are stock-safe for the same reason ----------------------------

# (family, example, head): the analysis puts a Recenter after a kept tie's table (GPT-2, OPT, Whisper, BERT), after
# a norm on the stream (BLOOM's word_embeddings_layernorm, CLIP's pre_layrnorm, mBART's layernorm_embedding), or both
AUTO = [("gpt2", "tied", "GPT2LMHeadModel"), ("opt", "pre-ln", "OPTForCausalLM"), ("bloom", "tied", "BloomModel"),
        ("bloom", "tied", "BloomForCausalLM"), ("bloom", "untied-eps6-tp2", "BloomForCausalLM"),
        ("clip", "vision", "CLIPVisionModel"), ("whisper", "d32", "WhisperForConditionalGeneration"),
        ("mbart", "d32-scaled", "MBartForConditionalGeneration"), ("bert", "base", "BertForMaskedLM")]


@pytest.mark.parametrize("family,example,head", AUTO, ids=["-".join(c) for c in AUTO])
def test_auto_plan_with_recenters_is_stock_reloadable(family, example, head, tmp_path):
    """`normfold.convert(model, auto=True)` (`normfold convert --auto`): the plan derived from the graph, with its
    Recenters, is stock-reloadable like the adapter's: stock transformers loads model.safetensors with no
    normfold module or hook and computes the original's outputs (the raw stream up to a per-token constant), a
    kept tie one tensor holding the original table; normfold.load re-attaches the Recenters."""
    adapter = next(a for a in list_adapters() if a.name == family)
    model = build(next(e for e in adapter.examples if e.name == example), head)
    inputs = adapter.example_inputs(model, torch.Generator().manual_seed(0))
    conv, report = normfold.convert(model, auto=True, inputs=inputs)
    assert report.adapter == "analysis" and report.verification["passed"]
    s = report.structure
    assert s.recenter_after or s.recenter_before
    assert report.stock_reloadable and report.to_dict()["reload"]["stock_transformers"] is True
    out = normfold.save(conv, report, tmp_path / "out")
    assert (out / "model.safetensors").is_file() and not (out / "normfold_model.safetensors").exists()
    stock = getattr(transformers, head).from_pretrained(out, dtype=torch.float64).eval()
    assert not any(type(m).__module__.startswith("normfold") for m in stock.modules())
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in stock.modules())
    for h, t in _tied(model):
        assert stock.get_submodule(h).weight is stock.get_submodule(t).weight
        assert torch.equal(stock.get_submodule(t).weight, model.get_submodule(t).weight)
    ref, got = run_flat(model, inputs), run_flat(stock, inputs)
    assert set(got) == set(ref)
    _assert_outputs_match(got, ref, report.centered_outputs)
    loaded = normfold.load(out, fast=False)
    want = run_flat(conv, inputs)
    for name, value in run_flat(loaded, inputs).items():
        assert rel_err(value, want[name]) <= 1e-12, name


# ---- where a stock load would not compute the original: kept not stock-reloadable, and why -------------------

def _gpt2():
    a = next(x for x in list_adapters() if x.name == "gpt2")
    model = build(a.examples[0], "GPT2LMHeadModel")
    return model, a.example_inputs(model, torch.Generator().manual_seed(0))


def _forced_stock_logits(conv, report, path):
    """What stock transformers would compute from these weights written in the stock layout anyway."""
    report.stock_reloadable = True
    out = normfold.save(conv, report, path)
    return out, transformers.GPT2LMHeadModel.from_pretrained(out, dtype=torch.float64).eval()


def test_tied_head_on_the_centred_table_is_not_stock_reloadable(tmp_path):
    """fold_final: the final norm's γ goes into a tied head, so the table is centred and the head (nn.TiedHead)
    adds (Σh)·μ, the row means centring took out. Stock transformers has no such term: the stock head on the
    centred table computes other logits. So the checkpoint stays normfold.load-only."""
    model, inputs = _gpt2()
    conv, report = normfold.convert(model, verify=False, fold_final=True)
    assert report.structure.tied_heads and not report.stock_reloadable
    assert "normfold.load only" in report.to_dict()["reload"]["how"]
    _, stock = _forced_stock_logits(conv, report, tmp_path / "forced")
    ref = run_flat(model, inputs)["logits"]
    assert rel_err(run_flat(stock, inputs)["logits"], ref) > 1e-3
    assert rel_err(run_flat(conv, inputs)["logits"], ref) <= 1e-9


def test_added_bias_is_not_stock_reloadable(tmp_path):
    """allow_new_bias: the bias-less head takes the final norm's β into a bias it grows; the stock GPT-2 head
    has none and drops it on load (other logits). The checkpoint stays normfold.load-only."""
    model, inputs = _gpt2()
    conv, report = normfold.convert(model, verify=False, fold_final=True, allow_new_bias=True, untie=True)
    assert report.structure.added_bias == ["lm_head"] and not report.stock_reloadable
    _, stock = _forced_stock_logits(conv, report, tmp_path / "forced")
    ref = run_flat(model, inputs)["logits"]
    assert rel_err(run_flat(stock, inputs)["logits"], ref) > 1e-3
    assert rel_err(run_flat(conv, inputs)["logits"], ref) <= 1e-9


@pytest.mark.parametrize("family,head", [("gpt2", "GPT2LMHeadModel"), ("whisper", "WhisperForConditionalGeneration")])
def test_keep_affine_recenter_form_is_stock_reloadable_too(family, head, tmp_path):
    """--keep-affine: every RMSNorm keeps γ/β, saved as the LayerNorm's own; LN(x)·γ + β = RMSNorm(Cx)·γ + β."""
    a = next(x for x in list_adapters() if x.name == family)
    model = build(a.examples[0], head)
    inputs = a.example_inputs(model, torch.Generator().manual_seed(0))
    conv, report = normfold.convert(model, verify=False, keep_affine=True)
    assert report.stock_reloadable and (report.structure.recenter_after or report.structure.recenter_before)
    stock = getattr(transformers, head).from_pretrained(normfold.save(conv, report, tmp_path / "out"),
                                                        dtype=torch.float64).eval()
    ref, got = run_flat(model, inputs), run_flat(stock, inputs)
    _assert_outputs_match(got, ref, report.centered_outputs)


@pytest.mark.parametrize("family,head", [("gpt2", "GPT2LMHeadModel"), ("whisper", "WhisperForConditionalGeneration"),
                                         ("bloom", "BloomForCausalLM"), ("mbart", "MBartForConditionalGeneration"),
                                         ("bart", "BartForConditionalGeneration")])
def test_pre_crmsnorm_back_to_rmsnorm_is_stock_reloadable(family, head, tmp_path):
    """--to rmsnorm from a Pre-CRMSNorm model: its compression points become Recenters again, which a stock
    load does without, so that checkpoint is stock-reloadable like a direct conversion (mBART's kept tie: the
    d-wide Recenter on its embedding norm's input stays one, beside the one its compress op becomes)."""
    a = next(x for x in list_adapters() if x.name == family)
    model = build(a.examples[0], head)
    inputs = a.example_inputs(model, torch.Generator().manual_seed(0))
    crms, _ = normfold.convert(model, to="crmsnorm", verify=False)
    rms, report = normfold.convert(crms, to="rmsnorm")
    assert report.verification["passed"] and report.stock_reloadable
    assert report.structure.recenter_after or report.structure.recenter_before
    out = normfold.save(rms, report, tmp_path / "out")
    stock = getattr(transformers, head).from_pretrained(out, dtype=torch.float64).eval()
    ref, got = run_flat(model, inputs), run_flat(stock, inputs)
    _assert_outputs_match(got, ref, report.centered_outputs)
