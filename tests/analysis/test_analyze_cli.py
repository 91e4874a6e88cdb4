"""`normfold analyze` from the command line: table and JSON output, progress on stderr, exit codes and
every error path (message checked, no traceback)."""

import json

import pytest
import torch

from helpers import realistic
from normfold import io
from normfold.cli import main

transformers = pytest.importorskip("transformers")
from transformers import BertConfig, BertForMaskedLM, GPT2Config, GPT2LMHeadModel, GPT2Model  # noqa: E402


@pytest.fixture(scope="module")
def gpt2_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("models") / "tiny-gpt2"
    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=97, n_positions=16, n_embd=24, n_layer=2, n_head=3, bos_token_id=0, eos_token_id=0)
    realistic(GPT2LMHeadModel(cfg).eval()).save_pretrained(d)
    return d


@pytest.fixture(scope="module")
def bert_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("models") / "tiny-bert"
    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32,
                     max_position_embeddings=32)
    realistic(BertForMaskedLM(cfg).eval()).save_pretrained(d)
    return d


def run_cli(args, capsys):
    code = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out, err


def assert_clean_error(code, err, pattern):
    assert code == 2
    assert pattern in err, err
    assert "Traceback" not in err and "def forward" not in err


def test_table_output(gpt2_dir, capsys):
    code, out, err = run_cli(["analyze", gpt2_dir], capsys)
    assert code == 0, err
    assert "5 of 5 foldable" in out
    row = next(line for line in out.splitlines() if line.strip().startswith("transformer.h.1.ln_2"))
    assert row.split()[1:3] == ["yes", "mlp.c_fc"]  # readers shown relative to the norm's block
    assert "transformer.wte shares its weight with lm_head.weight" in out
    assert "normfold convert" in out  # GPT-2 has an adapter: the next step is the converter
    assert "[1/3] loading" in err and "[2/3] tracing" in err and "[3/3] propagating" in err


def test_json_output(gpt2_dir, capsys):
    code, out, _ = run_cli(["analyze", gpt2_dir, "--json", "-q"], capsys)
    assert code == 0
    rep = json.loads(out)
    assert rep["layernorms"] == {"total": 5, "foldable": 5}
    assert rep["source"]["model"] == str(gpt2_dir)
    ln1 = next(n for n in rep["norms"] if n["name"] == "transformer.h.0.ln_1")
    assert ln1["foldable"] and ln1["readers"] == ["transformer.h.0.attn.c_attn"]
    assert ln1["writers"] == ["transformer.wte", "transformer.wpe"]
    ln_f = next(n for n in rep["norms"] if n["name"] == "transformer.ln_f")
    assert ln_f["final"] and ln_f["readers"] == ["lm_head"]


def test_no_center_embeddings_flag(gpt2_dir, capsys):
    code, out, _ = run_cli(["analyze", gpt2_dir, "--json", "-q", "--no-center-embeddings"], capsys)
    assert code == 0 and json.loads(out)["layernorms"] == {"total": 5, "foldable": 0}


def test_post_ln_reasons(bert_dir, capsys):
    code, out, _ = run_cli(["analyze", bert_dir, "--json", "-q"], capsys)
    assert code == 0
    rep = json.loads(out)
    verdicts = {n["name"]: n["foldable"] for n in rep["norms"]}
    assert verdicts.pop("bert.embeddings.LayerNorm") and not any(verdicts.values())
    reasons = {n["name"]: n["reason"] for n in rep["norms"]}
    assert reasons["bert.encoder.layer.0.attention.output.LayerNorm"] == \
        "input includes the affine output of bert.embeddings.LayerNorm (γ⊙n+β is not zero-mean)"
    assert reasons["cls.predictions.transform.LayerNorm"] == \
        "input includes the output of gelu after cls.predictions.transform.dense (not zero-mean)"
    code, out, _ = run_cli(["analyze", bert_dir, "-q"], capsys)  # the table shows the reasons too
    assert "1 of 6 foldable" in out and "affine output of bert.embeddings.LayerNorm" in out


def test_missing_model_path(tmp_path, capsys):
    code, _, err = run_cli(["analyze", tmp_path / "does-not-exist"], capsys)
    assert_clean_error(code, err, "no such directory")


def test_directory_without_config(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    code, _, err = run_cli(["analyze", tmp_path / "empty"], capsys)
    assert_clean_error(code, err, "no config.json")


def test_a_file_is_not_a_model(tmp_path, capsys):
    f = tmp_path / "weights.bin"
    f.write_bytes(b"\0" * 16)
    code, _, err = run_cli(["analyze", f], capsys)
    assert_clean_error(code, err, "is a file")


def test_untraceable_model(gpt2_dir, capsys, monkeypatch):
    stock = GPT2Model.forward

    def forward(self, input_ids=None, **kwargs):
        if input_ids.sum() > 0:  # data-dependent Python control flow: no trace can capture it
            input_ids = input_ids.flip(-1)
        return stock(self, input_ids=input_ids, **kwargs)

    monkeypatch.setattr(GPT2Model, "forward", forward)
    code, out, err = run_cli(["analyze", gpt2_dir], capsys)
    assert_clean_error(code, err, "could not trace GPT2LMHeadModel")
    assert "control flow" in err and "adapter" in err and out == ""


def test_help_teaches_the_rules(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["analyze", "--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    for phrase in ("FOLDABLE", "writers", "dropout in eval mode", "affine output of", "--json", "exit codes"):
        assert phrase in out, phrase


def test_listed_in_the_top_level_help(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    assert "analyze" in capsys.readouterr().out


@pytest.mark.skipif(not io.default_model_path().exists(), reason="the bundled model is not built in this checkout")
def test_bundled_default_model(capsys):
    code, out, err = run_cli(["analyze", "--json", "-q"], capsys)
    assert code == 0, err
    rep = json.loads(out)
    assert rep["layernorms"]["foldable"] == rep["layernorms"]["total"] > 0
