"""The analysis on transformers models built from tiny configs: GPT-2 against its hand-written adapter,
Post-LN BERT, Whisper's GELU stem, and paper 002's Table 7 — one test per row asserting the counts we
measure, and an exact float64 conversion from each derived plan (checked against the original model)."""

import fnmatch
from dataclasses import dataclass
from typing import Callable

import pytest
import torch

import normfold
from helpers import realistic, rel_err, run_flat
from normfold.adapters import find_adapter
from normfold.analysis import analyze, example_inputs, trace

transformers = pytest.importorskip("transformers")

_TRACES: dict = {}


def traced(key, build):
    """(model, inputs, graph), built and traced once per test session (tracing takes seconds)."""
    if key not in _TRACES:
        torch.manual_seed(0)
        model = build()
        inputs = example_inputs(model)
        has_ln = any("LayerNorm" in type(m).__name__ for m in model.modules())
        _TRACES[key] = (model, inputs, trace(model, inputs) if has_ln else None)
    return _TRACES[key]


def hf(config: str, head: str, **kw):
    def build(dtype=torch.float64, perturb=True):
        model = getattr(transformers, head)(getattr(transformers, config)(**kw)).eval().to(dtype)
        return realistic(model) if perturb else model
    return build


def run(key, build, **kw):
    model, inputs, graph = traced(key, build)
    return analyze(model, inputs, graph=graph, **kw)


# ---- GPT-2: the analysis finds exactly the hand-written adapter's plan ---------------------------------

GPT2_HEADS = ["GPT2Model", "GPT2LMHeadModel", "GPT2ForSequenceClassification", "GPT2ForTokenClassification",
              "GPT2ForQuestionAnswering", "GPT2DoubleHeadsModel"]
GPT2 = dict(vocab_size=97, n_positions=32, n_embd=24, n_layer=3, n_head=3, bos_token_id=0, eos_token_id=0,
            pad_token_id=0)


@pytest.mark.parametrize("head", GPT2_HEADS)
def test_gpt2_analysis_equals_the_adapter_plan(head):
    build = hf("GPT2Config", head, **GPT2)
    report = run(f"gpt2-{head}", build)
    model = traced(f"gpt2-{head}", build)[0]
    assert report.total == len(report.foldable) == 2 * GPT2["n_layer"] + 1
    ours, theirs = report.to_plan(), find_adapter(model).plan(model)
    assert [(s.path, s.readers, s.final) for s in ours.streams[0].norms] == \
        [(s.path, s.readers, s.final) for s in theirs.streams[0].norms]
    assert ours.streams[0].writers == theirs.streams[0].writers
    assert ours.kept == [] and ours.stock_reloadable


def test_gpt2_tied_embedding_is_reported_and_plain_mode_finds_nothing():
    report = run("gpt2-GPT2LMHeadModel", hf("GPT2Config", "GPT2LMHeadModel", **GPT2))
    wte = next(w for w in report.writers if w.name == "transformer.wte")
    assert wte.tied_with == ["lm_head.weight"]
    plain = run("gpt2-GPT2LMHeadModel", None, center_embeddings=False)
    assert not plain.foldable
    assert "embeddings are not centred" in plain.norm("transformer.h.0.ln_1").reason


# ---- Post-LN BERT -----------------------------------------------------------------------------------------

BERT = dict(vocab_size=50, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32,
            max_position_embeddings=32)


def test_post_ln_bert_only_the_embedding_norm_folds():
    report = run("bert", hf("BertConfig", "BertModel", **BERT))
    assert [n.name for n in report.foldable] == ["embeddings.LayerNorm"]
    emb = report.norm("embeddings.LayerNorm")
    assert set(emb.writers) == {"embeddings.word_embeddings", "embeddings.position_embeddings",
                                "embeddings.token_type_embeddings"}
    assert not emb.affine_foldable and "add in encoder.layer.0.attention.output" in emb.affine_note
    previous = "embeddings.LayerNorm"
    for i in range(BERT["num_hidden_layers"]):
        for name in (f"encoder.layer.{i}.attention.output.LayerNorm", f"encoder.layer.{i}.output.LayerNorm"):
            want = f"input includes the affine output of {previous} (γ⊙n+β is not zero-mean)"
            assert report.norm(name).reason == want
            previous = name


def test_fresh_bert_with_unit_gamma_and_zero_beta_is_foldable():
    """The analysis reads the actual γ/β: at initialization (γ = 1, β = 0) Post-LN outputs ARE zero-mean."""
    build = hf("BertConfig", "BertModel", **BERT)
    model = build(perturb=False)
    graph = trace(model, example_inputs(model))
    report = analyze(model, graph=graph)
    assert len(report.foldable) == 5
    n = report.norm("encoder.layer.1.output.LayerNorm")
    assert n.assumes == ["encoder.layer.1.attention.output.LayerNorm"] and "current values" in n.reason
    assert any("exact for these weights only" in note for note in report.to_plan().notes)
    # structural: value-independent verdicts (what a training-time reparametrization needs)
    structural = analyze(model, graph=graph, structural=True)
    assert [n.name for n in structural.foldable] == ["embeddings.LayerNorm"]
    assert "not for every value" in structural.norm("encoder.layer.0.attention.output.LayerNorm").reason
    with torch.no_grad():
        model.embeddings.LayerNorm.bias[0] = 0.5
    report = analyze(model)
    # only the norm reading that output breaks; its own output (γ = 1, β = 0) is zero-mean again
    assert [n.name for n in report.norms if not n.foldable] == ["encoder.layer.0.attention.output.LayerNorm"]
    assert "affine output of embeddings.LayerNorm" in report.norm("encoder.layer.0.attention.output.LayerNorm").reason


# ---- Whisper: a conv + GELU stem ----------------------------------------------------------------------------

WHISPER = dict(vocab_size=50, d_model=16, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
               decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32, num_mel_bins=8,
               max_source_positions=8, max_target_positions=16, pad_token_id=0, bos_token_id=1, eos_token_id=2,
               decoder_start_token_id=1)


def test_whisper_stem_blocks_the_encoder_and_the_decoder_folds():
    report = run("whisper", hf("WhisperConfig", "WhisperModel", **WHISPER))
    for n in report.norms:
        if n.name.startswith("encoder."):
            assert n.reason == "input includes the output of gelu after encoder.conv2 (not zero-mean)"
        else:
            assert n.foldable, n.reason
    assert "decoder.embed_positions.weight" in report.norm("decoder.layer_norm").writers


# ---- paper 002, Table 7 ---------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Row:
    """One model of Table 7: the paper's (total, foldable, foldable with centred embedding) for the
    checkpoint size it used, and ours as a function of the layer count L (tiny config, realistic γ/β):
    (LayerNorms, foldable with tables left alone, foldable with centring, foldable allowing a Recenter)."""

    family: str
    paper: tuple[int, int, int]
    paper_layers: int
    ours: Callable[[int], tuple[int, int, int, int]]
    build: Callable | None = None
    layers: int = 2
    # norm modules that are not LayerNorm (nothing to fold): {path of one such module: how many modules of its
    # class}. Named by where they sit, not by class name: a transformers release may rename a class (5.25
    # renamed Mamba2's gated norm MambaRMSNormGated -> Mamba2RMSNormGated).
    other_norms: dict | None = None


def _2l1(L):
    return 2 * L + 1


TABLE7 = [
    Row("GPT-2", (25, 0, 25), 12, lambda L: (_2l1(L), 0, _2l1(L), _2l1(L)),
        hf("GPT2Config", "GPT2LMHeadModel", **dict(GPT2, n_layer=2))),
    Row("BERT", (25, 24, 25), 12, lambda L: (_2l1(L), 0, 1, 1), hf("BertConfig", "BertModel", **BERT)),
    Row("ViT", (25, 0, 25), 12, lambda L: (_2l1(L), 0, _2l1(L), _2l1(L)),
        hf("ViTConfig", "ViTForImageClassification", image_size=16, patch_size=8, num_channels=3, hidden_size=16,
           num_hidden_layers=2, num_attention_heads=2, intermediate_size=32)),
    Row("Phi", (25, 0, 25), 24, lambda L: (L + 1, 0, L + 1, L + 1),
        hf("PhiConfig", "PhiForCausalLM", vocab_size=50, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
           intermediate_size=32, max_position_embeddings=32)),
    Row("Phi3", (0, 0, 0), 32, lambda L: (0, 0, 0, 0),
        hf("Phi3Config", "Phi3ForCausalLM", vocab_size=50, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
           num_key_value_heads=2, intermediate_size=32, max_position_embeddings=32, pad_token_id=0),
        other_norms={"model.norm": 5}),
    Row("Qwen2", (0, 0, 0), 24, lambda L: (0, 0, 0, 0),
        hf("Qwen2Config", "Qwen2ForCausalLM", vocab_size=50, hidden_size=16, num_hidden_layers=2,
           num_attention_heads=2, num_key_value_heads=2, intermediate_size=32), other_norms={"model.norm": 5}),
    Row("T5", (32, 0, 32), 6, lambda L: (0, 0, 0, 0),
        hf("T5Config", "T5Model", vocab_size=50, d_model=16, d_kv=8, d_ff=32, num_layers=2, num_decoder_layers=2,
           num_heads=2, decoder_start_token_id=0), other_norms={"encoder.final_layer_norm": 12}),
    Row("OPT", (25, 0, 1), 12, lambda L: (_2l1(L), 0, _2l1(L), _2l1(L)),
        hf("OPTConfig", "OPTForCausalLM", vocab_size=50, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
           ffn_dim=32, max_position_embeddings=32, word_embed_proj_dim=16)),
    Row("BLOOM", (6, 5, 6), 2, lambda L: (2 * L + 2, 0, 1, 2 * L + 2),
        hf("BloomConfig", "BloomForCausalLM", vocab_size=50, hidden_size=16, n_layer=2, n_head=2)),
    Row("Mamba2", (0, 0, 0), 24, lambda L: (0, 0, 0, 0),
        hf("Mamba2Config", "Mamba2ForCausalLM", vocab_size=50, hidden_size=16, num_hidden_layers=2, num_heads=4,
           head_dim=8, state_size=8, n_groups=1, expand=2),
        other_norms={"backbone.norm_f": 3, "backbone.layers.0.mixer.norm": 2}),
    Row("LLaMA", (0, 0, 0), 32, lambda L: (0, 0, 0, 0),
        hf("LlamaConfig", "LlamaForCausalLM", vocab_size=50, hidden_size=16, num_hidden_layers=2,
           num_attention_heads=2, num_key_value_heads=2, intermediate_size=32), other_norms={"model.norm": 5}),
]


def counts(row: Row) -> tuple[int, int, int, int]:
    reports = [run(row.family, row.build, **kw) for kw in
               (dict(center_embeddings=False), dict(), dict(recenter=True))]
    return (reports[1].total,) + tuple(len(r.foldable) for r in reports)


@pytest.mark.parametrize("row", TABLE7, ids=[r.family for r in TABLE7])
def test_table7_row(row):
    assert counts(row) == row.ours(row.layers)
    # the formula at the paper's depth gives the paper's LayerNorm total, except T5 (its norms are RMSNorms)
    if row.family != "T5":
        assert row.ours(row.paper_layers)[0] == row.paper[0]
    if row.other_norms is not None:
        model = traced(row.family, row.build)[0]
        expected = {type(model.get_submodule(path)).__name__: n for path, n in row.other_norms.items()}
        assert run(row.family, row.build).other_norms == expected


def _centred(name, patterns):
    return any(fnmatch.fnmatchcase(name, p) for p in patterns)


WHISPER_ROW = Row("Whisper", (0, 0, 0), 0, lambda L: (0, 0, 0, 0), hf("WhisperConfig", "WhisperModel", **WHISPER))
CONVERTIBLE = [(r, False) for r in TABLE7 if r.ours(r.layers)[2] > 0] + [(WHISPER_ROW, False)] + \
    [(r, True) for r in TABLE7 if r.ours(r.layers)[3] > r.ours(r.layers)[2]]


@pytest.mark.parametrize("row,recenter", CONVERTIBLE,
                         ids=[r.family + ("-recenter" if rc else "") for r, rc in CONVERTIBLE])
def test_table7_plan_converts_exactly(row, recenter, tmp_path):
    """Every norm the analysis calls foldable really converts: float64 outputs match the original."""
    model, inputs, graph = traced(row.family, row.build)
    report = analyze(model, inputs, graph=graph, recenter=recenter)
    assert any(n.recenter for n in report.foldable) == recenter
    conv, crep = normfold.convert(model, adapter=report.to_adapter(), verify=False)
    assert len(crep.structure.norms) == len([n for n in report.foldable if n.module])
    # the analysis' own Recenters (a shift there reaches norms and stream outputs only) and a kept tie's Recenter
    # after the table both leave the plan stock-reloadable (stock LayerNorms re-centre: checked below)
    assert crep.stock_reloadable == (not crep.structure.tied_heads)
    run_inputs = {k: v for k, v in inputs.items() if k not in ("use_cache", "output_hidden_states")}
    ref, outs = run_flat(model, run_inputs), [run_flat(conv, run_inputs)]
    if crep.stock_reloadable and crep.structure.recenter_after:
        import transformers

        outs.append(run_flat(getattr(transformers, type(model).__name__).from_pretrained(
            normfold.save(conv, crep, tmp_path / "out"), dtype=torch.float64).eval(), run_inputs))
    patterns = crep.centered_outputs
    for got in outs:
        assert ref and set(ref) == set(got)
        for name in ref:
            a, b = got[name].double(), ref[name].double()
            if _centred(name, patterns):
                a, b = a - a.mean(-1, keepdim=True), b - b.mean(-1, keepdim=True)
            assert rel_err(a, b) <= 1e-9, (name, rel_err(a, b))


@pytest.mark.parametrize("family,paper_plain,paper_centred", [("BERT", lambda L: 2 * L, lambda L: 2 * L + 1),
                                                              ("BLOOM", lambda L: 2 * L + 1, lambda L: 2 * L + 2)])
def test_papers_algorithm1_reproduces_its_counts_and_its_plan_is_wrong(monkeypatch, family, paper_plain,
                                                                       paper_centred):
    """Treating every LayerNorm output as centred (paper 002, Algorithm 1) gives exactly Table 7's BERT
    (24/25 at 12 layers) and BLOOM (5/6 at 2 layers) counts — and converting with that plan changes the
    model's outputs by tens of percent."""
    from normfold.analysis.propagate import Propagation
    from normfold.analysis.rules import ZeroMean

    row = next(r for r in TABLE7 if r.family == family)
    model, inputs, graph = traced(row.family, row.build)
    monkeypatch.setattr(Propagation, "_norm_output", lambda self, node: ZeroMean(-1))
    plain = analyze(model, inputs, graph=graph, center_embeddings=False)
    centred = analyze(model, inputs, graph=graph)
    assert len(plain.foldable) == paper_plain(row.layers) and len(centred.foldable) == paper_centred(row.layers)
    conv, crep = normfold.convert(model, adapter=centred.to_adapter())
    assert crep.verification["fp64"]["max_rel_error"] > 0.1 and not crep.verification["passed"]


def test_opt_350m_style_post_ln_folds_nothing():
    report = run("opt-post", hf("OPTConfig", "OPTForCausalLM", vocab_size=50, hidden_size=16, num_hidden_layers=2,
                                num_attention_heads=2, ffn_dim=32, max_position_embeddings=32, word_embed_proj_dim=8,
                                do_layer_norm_before=False))
    assert report.total == 4 and not report.foldable
    first = report.norm("model.decoder.layers.0.self_attn_layer_norm").reason
    assert "model.decoder.project_in (linear), which cannot be centred: its output also reaches linear in " \
           "model.decoder.layers.0.self_attn.q_proj" in first


# ---- more families, no adapter needed: each exercises a different mechanism -----------------------------

MORE = {
    # local attention windows
    "gpt_neo": ((5, 5), hf("GPTNeoConfig", "GPTNeoForCausalLM", vocab_size=50, hidden_size=16, num_layers=2, num_heads=2,
                           attention_types=[[["global", "local"], 1]], max_position_embeddings=32, window_size=4)),
    # parallel attention + MLP reading one norm
    "gptj": ((3, 3), hf("GPTJConfig", "GPTJForCausalLM", vocab_size=50, n_embd=16, n_layer=2, n_head=2, rotary_dim=4,
                        n_positions=32)),
    # x @ W.T written by hand (FalconLinear), in-place residual adds
    "falcon": ((5, 5), hf("FalconConfig", "FalconForCausalLM", vocab_size=50, hidden_size=16, num_hidden_layers=2,
                          num_attention_heads=2, new_decoder_architecture=True, num_kv_heads=2)),
    # Post-LN encoder-decoder, dead code reading the embeddings (`inputs_embeds[:, :, -1]`)
    "bart": ((2, 7), hf("BartConfig", "BartModel", vocab_size=50, d_model=16, encoder_layers=1, decoder_layers=1,
                        encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32,
                        max_position_embeddings=32)),
    # pre_layrnorm on the stream: 1 fold with weights only, all with one Recenter
    "clip_vision": ((1, 6), hf("CLIPVisionConfig", "CLIPVisionModel", hidden_size=16, intermediate_size=32,
                               num_hidden_layers=2, num_attention_heads=2, image_size=16, patch_size=8)),
    "clip_vision+recenter": ((6, 6), None),
    # pretraining_tp: output projections as sums of F.linear over weight slices, from a zeros_like
    "bloom_tp2+recenter": ((6, 6), hf("BloomConfig", "BloomForCausalLM", vocab_size=50, hidden_size=16, n_layer=2,
                                      n_head=2, pretraining_tp=2, slow_but_exact=True)),
}


@pytest.mark.parametrize("name", list(MORE))
def test_more_families_convert_exactly(name):
    (foldable, total), build = MORE[name]
    family, _, recenter = name.partition("+")
    model, inputs, graph = traced(family, build or MORE[family][1])
    if family == "bloom_tp2":  # the output projections really run as F.linear on weight slices
        sliced = [n for n in graph.nodes if n.op == "linear" and n.arg(1).op == "slice"]
        assert len(sliced) == 2 * 2 * 2  # 2 layers x (attention, MLP) x pretraining_tp
        assert not any(n.op == "linear" and n.module.endswith((".dense", ".dense_4h_to_h")) for n in graph.nodes)
    report = analyze(model, inputs, graph=graph, recenter=bool(recenter))
    assert (len(report.foldable), report.total) == (foldable, total)
    conv, crep = normfold.convert(model, adapter=report.to_adapter(), verify=False)
    run_inputs = {k: v for k, v in inputs.items() if k not in ("use_cache", "output_hidden_states")}
    ref, got = run_flat(model, run_inputs), run_flat(conv, run_inputs)
    for out in ref:
        a, b = got[out].double(), ref[out].double()
        if _centred(out, crep.centered_outputs):
            a, b = a - a.mean(-1, keepdim=True), b - b.mean(-1, keepdim=True)
        assert rel_err(a, b) <= 1e-9, (out, rel_err(a, b))
