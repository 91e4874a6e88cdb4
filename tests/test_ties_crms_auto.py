"""`--auto --to crmsnorm` keeps a tied table as the original tensor (issue 24, item 1), as the adapter path does
(tests/test_ties_crms.py): the entry point of the summed embeddings is read from the plan the analysis derives
(`compress.crmsnorm.derived_tie_entries`: the first Pre-LN block, or the embedding norms of a Post-LN model), not
from the adapter's TIE_ENTRY. References: the original model in float64, and the adapter path's edits.
"""

import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import normfold
from helpers import realistic, rel_err, run_flat
from normfold.adapters import ConversionPlan, NormSite, StreamPlan, get_adapter
from normfold.analysis.autoplan import modality_inputs
from normfold.compress import TiedCompressedHead

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()
sys.path.insert(0, str(Path(__file__).resolve().parent / "analysis"))
from auto_families import FAMILIES  # noqa: E402
from test_ties_crms import assert_generate_unchanged  # noqa: E402

ADAPTER_CASES = [("gpt2", "tied", "GPT2LMHeadModel"), ("opt", "pre-ln", "OPTForCausalLM"),
                 ("whisper", "d32", "WhisperForConditionalGeneration"), ("bart", "d32", "BartForConditionalGeneration"),
                 ("bert", "base", "BertForMaskedLM")]
GENERATES = {"gpt2", "opt", "bart"}


def build(family, example, head):
    torch.manual_seed(0)
    ex = next(e for e in get_adapter(family).examples if e.name == example)
    return realistic(ex.build(head, torch.float64))


def params(model):
    return sum(p.numel() for p in model.parameters())


def check_kept(model, conv, report, inputs, tmp_path, generate, reload_tol=1e-12):
    """The table one tensor, equal to the original, shared with the stock head; outputs exact; fewer parameters;
    save → normfold.load the same outputs; greedy generate() unchanged."""
    table = model.get_input_embeddings().weight
    assert report.verification["passed"] and report.keeps_tie
    assert report.structure.compression["tied_heads"] == []
    assert not any(isinstance(m, TiedCompressedHead) for m in conv.modules())
    head = conv.get_output_embeddings()
    assert type(head) is nn.Linear and head.weight is conv.get_input_embeddings().weight
    assert torch.equal(head.weight, table)
    assert params(conv) <= params(model)
    ref, got = run_flat(model, inputs), run_flat(conv, inputs)
    logits = [n for n in ref if "logits" in n]
    assert logits
    for name in logits:
        assert rel_err(got[name], ref[name]) <= 1e-12, name
    loaded = normfold.load(normfold.save(conv, report, tmp_path / "out"))
    assert loaded.get_output_embeddings().weight is loaded.get_input_embeddings().weight
    for name, value in run_flat(loaded, inputs).items():
        assert rel_err(value, got[name]) <= reload_tol, name
    if generate:
        assert_generate_unchanged(model, conv, loaded)


@pytest.mark.parametrize("family,example,head", ADAPTER_CASES)
def test_auto_plan_keeps_the_tie_as_the_adapter_does(family, example, head, tmp_path):
    model = build(family, example, head)
    conv, report = normfold.convert(model, to="crmsnorm", auto=True)
    assert report.adapter == "analysis"
    check_kept(model, conv, report, get_adapter(family).example_inputs(model, torch.Generator().manual_seed(0)),
               tmp_path, family in GENERATES)
    # the adapter's TIE_ENTRY entries (Whisper's adapter also compresses the encoder after its Recenter stem,
    # which the derived plan does not: docs/families.md) and, where those agree, the same parameter count
    conv_a, report_a = normfold.convert(model, to="crmsnorm")
    auto, adapter = (r.structure.compression["compress_before"] for r in (report, report_a))
    assert auto and set(auto) <= set(adapter)
    if auto == adapter:
        assert params(conv) == params(conv_a)


@pytest.mark.parametrize("key,entry", [("mpt", "transformer.blocks.0"), ("codegen", "transformer.h.0"),
                                       ("stablelm", "model.layers.0"), ("persimmon", "model.layers.0")])
def test_model_without_adapter_keeps_the_tie(key, entry, tmp_path):
    """Families without an adapter (MPT is tied by default; CodeGen, StableLM, Persimmon with
    tie_word_embeddings=True): the plan the analysis derives is the only one; the entry is the first block."""
    import dataclasses

    fam = next(f for f in FAMILIES if f.key == key)
    model = realistic(dataclasses.replace(fam, kwargs=dict(fam.kwargs, tie_word_embeddings=True)).build())
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    conv, report = normfold.convert(model, to="crmsnorm")
    assert report.adapter == "analysis"
    assert report.structure.compression["compress_before"] == [entry]
    # CodeGen's --to crmsnorm reload differs from the in-memory model by ~2e-11 with or without a tie (untied
    # config: 1.9e-11 on main as well): not this form's doing, so only that comparison is looser there
    check_kept(model, conv, report, modality_inputs(model), tmp_path, True, 1e-10 if key == "codegen" else 1e-12)


def test_no_entry_in_the_plan_keeps_the_untied_form_and_says_why():
    """A stream whose shape the plan does not pin down (two Pre-LN block lists in one derived stream, a Recenter)
    gets no entry; the conversion then keeps today's untied form with a note naming the reason."""
    from normfold.compress.crmsnorm import derived_tie_entries

    two = StreamPlan("analysis", writers=["enc.embed", "enc.layers.0.out", "dec.embed", "dec.layers.0.out"],
                     norms=[NormSite("enc.layers.0.ln"), NormSite("dec.layers.0.ln")])
    entries, why = derived_tie_entries(ConversionPlan(adapter="analysis", streams=[two]), two)
    assert entries is None and "outside the blocks comes after the first block" in why
    one = StreamPlan("analysis", writers=["m.embed", "m.h.0.out", "m.h.1.out"],
                     norms=[NormSite("m.h.0.ln"), NormSite("m.h.1.ln"), NormSite("m.ln_f", final=True)])
    assert derived_tie_entries(ConversionPlan(adapter="analysis", streams=[one]), one) == (["m.h.0"], "")
    rec = ConversionPlan(adapter="analysis", streams=[one, StreamPlan("recenter", recenter_after=["m.embed"])])
    entries, why = derived_tie_entries(rec, one)
    assert entries is None and "Recenter" in why
    post = StreamPlan("analysis", writers=["m.emb.tok", "m.emb.pos"], norms=[NormSite("m.emb.ln", final=True)])
    assert derived_tie_entries(ConversionPlan(adapter="analysis", streams=[post]), post) == (["m.emb.ln"], "")


def test_plan_without_entry_unties_exactly_with_a_note():
    """A derived OPT plan whose writer order no longer shows the embeddings summed ahead of the first block: no
    entry is read from it, so --to crmsnorm keeps today's form (exact; here the TiedCompressedHead over the
    compressed table, elsewhere untied or refused) and the report says why the original table was not kept."""
    import dataclasses

    from normfold.analysis.autoplan import derive_adapter

    model = build("opt", "pre-ln", "OPTForCausalLM")
    adapter, _ = derive_adapter(model)
    plan = adapter.plan(model)
    st = plan.streams[0]
    blocks = [w for w in st.writers if ".layers." in w]
    plan.streams = [dataclasses.replace(st, writers=blocks[:1] + [w for w in st.writers if w not in blocks[:1]])]
    conv, report = normfold.convert(model, to="crmsnorm", adapter=dataclasses.replace(adapter, plan=lambda m: plan))
    assert report.verification["passed"] and report.verification["fp64"]["max_rel_error"] <= 1e-12
    assert not report.keeps_tie and report.structure.compression["compress_before"] == []
    # today's form where no entry is known: the head tied to the compressed (centred, d−1) table
    assert isinstance(conv.get_output_embeddings(), TiedCompressedHead)
    assert conv.get_input_embeddings().weight.shape[-1] == model.config.hidden_size - 1
    assert any("tie not kept by --to crmsnorm" in n and "more than one token stream" in n for n in report.notes)
