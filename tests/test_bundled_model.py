"""The bundled default model: small, genuinely trained, and converted exactly by `normfold convert`."""

import json
import math

import pytest
import torch

from normfold.cli import main
from normfold.io import default_model_path

pytest.importorskip("transformers")
MODEL = default_model_path()
pytestmark = pytest.mark.skipif(not (MODEL / "model.safetensors").exists(), reason="bundled model not built")

# Well-known verses. They are part of the training text; held-out perplexity is checked from the
# training log below (validation chapters were never trained on).
VERSES = [
    "In the beginning God created the heaven and the earth.",
    "And God said, Let there be light: and there was light.",
    "The LORD is my shepherd; I shall not want.",
    "For God so loved the world, that he gave his only begotten Son.",
]


def test_bundled_model_is_small():
    total = sum(f.stat().st_size for f in MODEL.iterdir() if f.is_file())
    assert total <= 15 * 2**20


def test_bundled_model_is_trained():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(MODEL)
    model = AutoModelForCausalLM.from_pretrained(MODEL).eval()
    losses = []
    for v in VERSES:
        ids = tok(v, return_tensors="pt")["input_ids"]
        with torch.no_grad():
            losses.append(model(input_ids=ids, labels=ids).loss.item())
    uniform = math.log(model.config.vocab_size)
    # A trained model predicts familiar scripture far better than chance (uniform = log |V| nats).
    assert sum(losses) / len(losses) < 0.6 * uniform
    # and the card reports the held-out perplexity it was trained to
    log = json.loads((MODEL / "training_log.json").read_text())
    assert log["validation_perplexity"] < 0.1 * log["uniform_perplexity"]


def test_convert_bundled_default(tmp_path, capsys):
    out = tmp_path / "kjv-rms"
    assert main(["convert", "--out", str(out)]) == 0
    stdout = capsys.readouterr().out
    assert "bundled:kjv-gpt2" in stdout
    rep = json.loads((out / "normfold.json").read_text())
    assert rep["variant"] == "rmsnorm" and rep["source"]["model"] == "bundled:kjv-gpt2"
    assert rep["layernorms"]["total"] == rep["layernorms"]["converted"] > 0
    v = rep["verification"]
    assert v["passed"] and v["fp64"]["max_rel_error"] <= 1e-9 and v["top1_agreement"] == 1.0
    assert (out / "tokenizer.json").exists()  # the converted model is usable as is


def test_generation_unchanged_after_conversion():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import normfold

    tok = AutoTokenizer.from_pretrained(MODEL)
    model = AutoModelForCausalLM.from_pretrained(MODEL).eval()
    conv, _ = normfold.convert(model, verify=False)
    ids = tok(VERSES[0], return_tensors="pt")["input_ids"]
    a = model.generate(ids, max_new_tokens=20, do_sample=False)
    b = conv.generate(ids, max_new_tokens=20, do_sample=False)
    assert torch.equal(a, b)
