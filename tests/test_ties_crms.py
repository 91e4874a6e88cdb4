"""A tied embedding/head kept in the original by `--to crmsnorm` (GPT-2, GPT-Neo, GPT-BigCode, OPT, GPT-NeoX, Phi,
Falcon, the Whisper decoder, BART, mBART, BERT, RoBERTa, DistilBERT, ELECTRA: `compress.crmsnorm.TIE_ENTRY`).

The d−1 stream needs a compression point after the summed embeddings: the stream is recentred and compressed
on the input of the first block (`structure.compression.compress_before`), so wte (shared with the stock
lm_head) and wpe stay the original d-wide tensors, the final norm returns the d-wide γ⊙n + β and the logits
are the original GEMM: no TiedCompressedHead, no row-mean vector. References: the original model in float64.
"""

import pytest
import torch
from torch import nn

import normfold
from helpers import realistic, rel_err, run_flat
from normfold.adapters import get_adapter
from normfold.compress import TiedCompressedHead
from normfold.compress.crmsnorm import TIE_ENTRY

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

# (family, example, head): every tied example of a registered family
CASES = [("gpt2", "tied", "GPT2LMHeadModel"), ("gpt2", "tied", "GPT2DoubleHeadsModel"),
         ("gpt_neo", "global-local-tied", "GPTNeoForCausalLM"), ("gpt_bigcode", "mqa-tied", "GPTBigCodeForCausalLM")]


def build(family="gpt2", example="tied", head="GPT2LMHeadModel", dtype=torch.float64):
    torch.manual_seed(0)
    ex = next(e for e in get_adapter(family).examples if e.name == example)
    return realistic(ex.build(head, dtype))


def inputs_for(model, family="gpt2"):
    return get_adapter(family).example_inputs(model, torch.Generator().manual_seed(0))


# the families whose models name their parts otherwise: checked through get_input/output_embeddings
GENERIC = [("opt", "pre-ln", "OPTForCausalLM"), ("gpt_neox", "sequential-no-bias-eps6", "GPTNeoXForCausalLM"),
           ("phi", "qk-layernorm-eps6", "PhiForCausalLM"), ("falcon", "new-arch-ln-attn-mlp", "FalconForCausalLM"),
           ("falcon", "new-arch-one-ln-bias-eps6", "FalconForCausalLM"),
           ("falcon", "sequential-alibi-bias-rw-style", "FalconForCausalLM")]


def assert_generate_unchanged(model, *others):
    """Greedy generate() gives the original's tokens for every converted / reloaded model."""
    prompt = torch.randint(1, model.config.vocab_size, (2, 5), generator=torch.Generator().manual_seed(1))
    kw = dict(max_new_tokens=8, do_sample=False, pad_token_id=0, attention_mask=torch.ones_like(prompt))
    with torch.no_grad():
        ref = model.generate(prompt, **kw)
        for other in others:
            assert torch.equal(other.generate(prompt, **kw), ref)


def test_registered_families():
    assert {f for f, _, _ in CASES + GENERIC + ENCODER_DECODER + EMBED_NORM} == set(TIE_ENTRY)
    entries = [e for v in TIE_ENTRY.values() for e in (v.values() if isinstance(v, dict) else [v])]
    assert all(e.endswith((".0", "layernorm_embedding", "embeddings.LayerNorm")) for e in entries)


@pytest.mark.parametrize("family,example,head", GENERIC)
def test_other_families_keep_the_original_table(family, example, head, tmp_path):
    """OPT, GPT-NeoX, Phi, Falcon: the same form through each family's entry block (TIE_ENTRY): the stock head
    shares the unchanged table, logits exact in float64, fewer parameters, save → load and greedy generate()
    unchanged."""
    model = build(family, example, head)
    table = model.get_input_embeddings().weight
    assert model.get_output_embeddings().weight is table  # the example is tied
    conv, report = normfold.convert(model, to="crmsnorm")
    assert report.verification["passed"] and report.verification["fp64"]["max_rel_error"] <= 1e-9
    comp = report.structure.compression
    assert len(comp["compress_before"]) == 1 and comp["compress_before"][0].endswith(TIE_ENTRY[family])
    assert comp["tied_heads"] == [] and comp["streams"][0]["width_after"] == model.config.hidden_size - 1
    head_w = conv.get_output_embeddings().weight
    assert type(conv.get_output_embeddings()) is nn.Linear and head_w is conv.get_input_embeddings().weight
    assert torch.equal(head_w, table)
    assert not any(isinstance(m, TiedCompressedHead) for m in conv.modules())
    inputs = inputs_for(model, family)
    ref, got = run_flat(model, inputs), run_flat(conv, inputs)
    for name in ref:
        if "logits" in name:
            assert rel_err(got[name], ref[name]) <= 1e-9, name
    assert sum(p.numel() for p in conv.parameters()) <= sum(p.numel() for p in model.parameters())
    loaded = normfold.load(normfold.save(conv, report, tmp_path / "out"))
    assert loaded.get_output_embeddings().weight is loaded.get_input_embeddings().weight
    want = run_flat(conv, inputs)
    for name, value in run_flat(loaded, inputs).items():
        assert rel_err(value, want[name]) <= 1e-12, name
    assert_generate_unchanged(model, conv, loaded)


@pytest.mark.parametrize("family,example,head", CASES)
def test_tied_table_stays_original_and_logits_exact(family, example, head):
    model = build(family, example, head)
    conv, report = normfold.convert(model, to="crmsnorm")
    assert report.verification["passed"] and report.verification["fp64"]["max_rel_error"] <= 1e-9
    comp = report.structure.compression
    assert comp["compress_before"] == ["transformer.h.0"] and comp["tied_heads"] == []
    assert comp["widen_after"] == comp["narrow_before"] == [] and comp["compress_after"] == []
    t = conv.transformer
    assert type(conv.lm_head) is nn.Linear and conv.lm_head.weight is t.wte.weight  # one tensor, the stock head
    assert torch.equal(t.wte.weight, model.transformer.wte.weight)  # the original tables, d-wide
    assert torch.equal(t.wpe.weight, model.transformer.wpe.weight)
    assert not any(isinstance(m, TiedCompressedHead) for m in conv.modules())
    assert comp["shapes"] and all(n.startswith("transformer.h.") for n in comp["shapes"])  # the d−1 blocks
    assert comp["streams"][0]["width_after"] == model.config.hidden_size - 1
    ref, got = run_flat(model, inputs_for(model, family)), run_flat(conv, inputs_for(model, family))
    for name in ref:
        if "logits" in name:
            assert rel_err(got[name], ref[name]) <= 1e-9, name
    before = sum(p.numel() for p in model.parameters())
    after = sum(p.numel() for p in conv.parameters())
    assert after <= before and report.size["parameters"]["after"] == after
    assert report.keeps_tie and any("compressed to d−1 on the input of transformer.h.0" in n for n in report.notes)
    assert "original d-wide table" in report.to_dict()["reload"]["how"]


@pytest.mark.parametrize("family,example,head", [c for c in CASES if c[2] != "GPT2DoubleHeadsModel"])
def test_save_load_and_generate_unchanged(family, example, head, tmp_path):
    model = build(family, example, head)
    conv, report = normfold.convert(model, to="crmsnorm", verify=False)
    loaded = normfold.load(normfold.save(conv, report, tmp_path / "out"))
    assert type(loaded.lm_head) is nn.Linear and loaded.lm_head.weight is loaded.transformer.wte.weight
    assert sum(p.numel() for p in loaded.parameters()) == sum(p.numel() for p in conv.parameters())
    inputs = inputs_for(model, family)
    want = run_flat(conv, inputs)
    for name, value in run_flat(loaded, inputs).items():
        assert rel_err(value, want[name]) <= 1e-12, name
    assert_generate_unchanged(model, conv, loaded)


def test_padded_form_keeps_the_compressed_table_tie():
    """--pad keeps every shape d-wide: the older TiedCompressedHead form stays (no entry point needed)."""
    model = build()
    conv, report = normfold.convert(model, to="crmsnorm", pad=True)
    assert report.verification["passed"]
    assert [x["head"] for x in report.structure.compression["tied_heads"]] == ["lm_head"]
    assert isinstance(conv.lm_head, TiedCompressedHead)


def test_streamed_equals_in_memory_and_back_to_layernorm(tmp_path):
    from normfold.stream import stream_convert
    from stream._compare import make_checkpoint, tensors_bytes

    src = make_checkpoint(get_adapter("gpt2").examples[0], "GPT2LMHeadModel", tmp_path / "src", shard="8KB")
    model, _ = normfold.io.load_source(src)
    conv, rep = normfold.convert(model, to="crmsnorm", verify=False)
    normfold.save(conv, rep, tmp_path / "mem", source_dir=src)
    (tmp_path / "st").mkdir()
    srep = stream_convert(src, tmp_path / "st", to="crmsnorm")
    assert srep.structure.compression["compress_before"] == ["transformer.h.0"]
    assert tensors_bytes(tmp_path / "mem") == tensors_bytes(tmp_path / "st")
    written = tensors_bytes(tmp_path / "st")
    assert written["transformer.wte.weight"] == tensors_bytes(src)["transformer.wte.weight"]
    assert not any(n.startswith("lm_head.") for n in written)
    # back to the stock architecture: the tie and the original tables, plain transformers reloads it
    back, brep = normfold.convert(normfold.load(tmp_path / "st"), to="layernorm")
    assert brep.verification["passed"] and brep.stock_reloadable
    stock = transformers.GPT2LMHeadModel.from_pretrained(normfold.save(back, brep, tmp_path / "ln")).eval()
    assert stock.lm_head.weight is stock.transformer.wte.weight
    ids = torch.randint(0, model.config.vocab_size, (2, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        exact = model.double()(ids).logits
        base = rel_err(model.float()(ids).logits, exact)
        assert rel_err(stock(ids).logits, exact) <= 4 * base + 64 * torch.finfo(torch.float32).eps


# ---- encoder-decoders and the Post-LN encoders: one entry per stream the shared table feeds -----------------

# the Whisper decoder (its first block), BART / mBART (each stream's layernorm_embedding: BART's Post-LN stream
# ends there; mBART's is compressed after it, so its input gets a d-wide Recenter), every head of the example
ENCODER_DECODER = [("whisper", "d32", "WhisperForConditionalGeneration")] + [
    (f, ex, cls + h) for f, ex, cls in (("bart", "d32", "Bart"), ("mbart", "d32-scaled", "MBart"))
    for h in ("Model", "ForConditionalGeneration", "ForSequenceClassification", "ForQuestionAnswering", "ForCausalLM")]
# Post-LN encoders: the embedding norm ends the compressed stream, the MLM head reads a LayerNorm of its own
EMBED_NORM = [("bert", "base", "BertForMaskedLM"), ("bert", "base", "BertForPreTraining"),
              ("roberta", "base", "RobertaForMaskedLM"), ("roberta", "causal-2types", "RobertaForCausalLM"),
              ("roberta", "xlm-roberta", "XLMRobertaForMaskedLM"), ("distilbert", "base", "DistilBertForMaskedLM"),
              ("electra", "projected", "ElectraForMaskedLM"), ("electra", "square-causal", "ElectraForCausalLM")]


def tied_names(model):
    """Every parameter name sharing the input embedding table."""
    table = model.get_input_embeddings().weight
    return [n for n, p in model.named_parameters(remove_duplicate=False) if p is table]


def float_inputs(model, family):
    inputs = inputs_for(model, family)
    dtype = next(model.parameters()).dtype
    return {k: v.to(dtype) if v.is_floating_point() else v for k, v in inputs.items()}


def assert_same_outputs(got_model, want, inputs, tol):
    got = run_flat(got_model, inputs)
    for name, value in want.items():
        if "hidden_states" not in name:  # stream outputs are returned recentred / compressed
            assert rel_err(got[name], value) <= tol, name


def assert_seq2seq_generate_unchanged(model, inputs, *others):
    """Greedy generate() of an encoder-decoder: the original's tokens for every converted / reloaded model."""
    kw = dict(max_new_tokens=6, do_sample=False, decoder_start_token_id=1, pad_token_id=0, eos_token_id=None)
    main = {k: v for k, v in inputs.items() if not k.startswith("decoder_")}
    with torch.no_grad():
        ref = model.generate(**main, **kw)
        for other in others:
            assert torch.equal(other.generate(**main, **kw), ref)


@pytest.mark.parametrize("family,example,head", ENCODER_DECODER + EMBED_NORM)
def test_shared_table_stays_original_in_every_stream(family, example, head, tmp_path):
    """The table the encoder, the decoder and the head share stays one tensor, the original: logits (every
    non-stream output) exact in float64, no more parameters than the original, save → load the same, greedy
    generate() unchanged. Without an entry per stream (TIE_ENTRY) the Whisper head was a TiedCompressedHead and
    BART / mBART / the BERT family untied the table (a compressed copy per stream beside the head's original)."""
    model = build(family, example, head)
    names, table = tied_names(model), model.get_input_embeddings().weight
    assert len(names) >= 2  # the example is tied
    conv, report = normfold.convert(model, to="crmsnorm")
    assert report.verification["passed"] and report.verification["fp64"]["max_rel_error"] <= 1e-9
    comp = report.structure.compression
    assert comp["tied_heads"] == [] and not any(isinstance(m, TiedCompressedHead) for m in conv.modules())
    params = dict(conv.named_parameters(remove_duplicate=False))
    assert len({id(params[n]) for n in names}) == 1 and torch.equal(params[names[0]], table)  # one, the original
    if model.get_output_embeddings() is not None:
        assert type(conv.get_output_embeddings()) is nn.Linear
        assert conv.get_output_embeddings().weight is conv.get_input_embeddings().weight
    assert all(s["width_after"] == s["width_before"] - 1 for s in comp["streams"])
    inputs = float_inputs(model, family)
    want = {k: v for k, v in run_flat(model, inputs).items() if "hidden_states" not in k}
    assert want
    assert_same_outputs(conv, want, inputs, 1e-12)
    assert sum(p.numel() for p in conv.parameters()) <= sum(p.numel() for p in model.parameters())
    assert report.keeps_tie
    loaded = normfold.load(normfold.save(conv, report, tmp_path / "out"))
    lparams = dict(loaded.named_parameters(remove_duplicate=False))
    assert len({id(lparams[n]) for n in names}) == 1 and torch.equal(lparams[names[0]], table)
    assert_same_outputs(loaded, want, inputs, 1e-12)
    if head.endswith("ForConditionalGeneration"):
        assert_seq2seq_generate_unchanged(model, inputs, conv, loaded)
    elif head.endswith("ForCausalLM"):
        assert_generate_unchanged(model, conv, loaded)


def test_mbart_embedding_norm_keeps_a_d_wide_recenter_on_its_input():
    """mBART: the stream is compressed after layernorm_embedding (its γ⊙n + β is not zero-mean); with the
    table kept, that norm's input is the uncentred embedding sum, so a d-wide Recenter sits before it, and the
    norm itself stays a d-wide RMSNorm (both checked on the module, the outputs by the test above)."""
    from normfold.nn import RMSNorm
    from normfold.nn.hooks import has_input_recenter

    model = build("mbart", "d32-scaled", "MBartForConditionalGeneration")
    conv, report = normfold.convert(model, to="crmsnorm", verify=False)
    comp, structure = report.structure.compression, report.structure
    norms = ["model.encoder.layernorm_embedding", "model.decoder.layernorm_embedding"]
    assert comp["compress_after"] == norms and comp["compress_before"] == []
    assert structure.recenter_before == norms
    for path in norms:
        norm = conv.get_submodule(path)
        assert type(norm) is RMSNorm and norm.normalized_shape[0] == model.config.d_model
        assert has_input_recenter(norm)
    # the centred-writer form is not needed: the position tables are not edited either
    for path in ("model.encoder.embed_positions.weight", "model.decoder.embed_positions.weight"):
        assert torch.equal(conv.get_parameter(path), model.get_parameter(path))


STREAMED = [("whisper", "d32", "WhisperForConditionalGeneration"), ("bart", "d32", "BartForConditionalGeneration"),
            ("mbart", "d32-scaled", "MBartForConditionalGeneration"), ("bart", "d32", "BartModel"),
            ("bert", "base", "BertForMaskedLM"), ("distilbert", "base", "DistilBertForMaskedLM")]


@pytest.mark.parametrize("family,example,head", STREAMED)
def test_streamed_equals_in_memory_and_back_to_stock_tied(family, example, head, tmp_path):
    """The streamed conversion writes the in-memory bytes (the shared table once, unchanged), and --to layernorm
    of the streamed result is the stock tied model again: plain transformers reloads it, tie and outputs."""
    from normfold.stream import stream_convert
    from stream._compare import make_checkpoint, tensors_bytes

    ex = next(e for e in get_adapter(family).examples if e.name == example)
    src = make_checkpoint(ex, head, tmp_path / "src", shard="8KB")
    model, _ = normfold.io.load_source(src)
    conv, rep = normfold.convert(model, to="crmsnorm", verify=False)
    normfold.save(conv, rep, tmp_path / "mem", source_dir=src)
    (tmp_path / "st").mkdir()
    srep = stream_convert(src, tmp_path / "st", to="crmsnorm")
    assert srep.structure.compression["tied_heads"] == []
    assert srep.structure.compression["compress_before"] == rep.structure.compression["compress_before"]
    written, original = tensors_bytes(tmp_path / "st"), tensors_bytes(src)
    assert tensors_bytes(tmp_path / "mem") == written
    names = tied_names(model)
    kept = [n for n in names if n in written]
    assert len(kept) == 1 and written[kept[0]] == original[kept[0]]  # stored once, the source's bytes
    back, brep = normfold.convert(normfold.load(tmp_path / "st"), to="layernorm")
    assert brep.verification["passed"] and brep.stock_reloadable
    stock = getattr(transformers, head).from_pretrained(normfold.save(back, brep, tmp_path / "ln")).eval()
    sparams = dict(stock.named_parameters(remove_duplicate=False))
    assert len({id(sparams[n]) for n in names}) == 1
    assert sum(p.numel() for p in stock.parameters()) == sum(p.numel() for p in model.parameters())
    inputs = float_inputs(model, family)
    exact = run_flat(model.double(), {k: v.double() if v.is_floating_point() else v for k, v in inputs.items()})
    base, got = run_flat(model.float(), inputs), run_flat(stock, inputs)
    for name, value in exact.items():
        if "hidden_states" not in name:
            assert rel_err(got[name], value) <= 4 * rel_err(base[name], value) + 64 * torch.finfo(torch.float32).eps
