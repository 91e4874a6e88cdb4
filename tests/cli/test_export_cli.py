"""`normfold export DIR --onnx OUT`: a converted checkpoint exported, run in onnxruntime and checked
against PyTorch (and the original with --original); every refusal exits 2 with a message and writes
nothing."""

import json

import pytest
import torch

from helpers import realistic, rel_err
from normfold.cli import main

transformers = pytest.importorskip("transformers")
for _m in ("onnx", "onnxscript", "onnxruntime"):
    pytest.importorskip(_m)
import onnx  # noqa: E402
import onnxruntime as ort  # noqa: E402
from transformers import GPT2Config, GPT2LMHeadModel  # noqa: E402


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    """A tiny GPT-2 (realistic norms, biases and stream offsets) and its `normfold convert` output."""
    root = tmp_path_factory.mktemp("export")
    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=97, n_positions=32, n_embd=32, n_layer=2, n_head=4, bos_token_id=0, eos_token_id=0)
    realistic(GPT2LMHeadModel(cfg).eval()).save_pretrained(root / "src")
    assert main(["convert", str(root / "src"), "--out", str(root / "rms"), "-q"]) == 0
    return root


def _ops(path):
    return [n.op_type for n in onnx.load(str(path)).graph.node]


def test_export_default_opset_has_rmsnormalization_and_matches(dirs, tmp_path, capsys):
    out = tmp_path / "m.onnx"
    assert main(["export", str(dirs / "rms"), "--onnx", str(out), "--original", "-q"]) == 0
    text = capsys.readouterr().out
    assert "PASS" in text and "ONNX converted vs PyTorch original" in text
    assert "RMSNormalization" in _ops(out) and "LayerNormalization" in _ops(tmp_path / "m-original.onnx")
    # the file is a working model on its own, with dynamic batch / sequence: run it at another shape
    sess = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    ids = torch.randint(0, 97, (3, 11))
    got = torch.from_numpy(sess.run(None, {"input_ids": ids.numpy()})[0])
    original = GPT2LMHeadModel.from_pretrained(dirs / "src").eval()
    with torch.no_grad():
        want = original(input_ids=ids).logits
        exact = original.double()(input_ids=ids).logits
    # within 1e-5 of the float32 original, or of twice its own float32 error where that is larger
    base = rel_err(want, exact)
    assert rel_err(got, want) <= max(1e-5, 2 * base) and rel_err(got, exact) <= max(1e-5, 2 * base)


def test_export_json_opset18_optimized(dirs, tmp_path, capsys):
    out = tmp_path / "m18.onnx"
    assert main(["export", str(dirs / "rms"), "--onnx", str(out), "--opset", "18", "--optimize", "--json", "-q"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["passed"] and res["opset"] == 18 and res["optimized"]
    assert res["onnx_vs_pytorch"]["max_rel_error"] <= 1e-5
    assert "RMSNormalization" not in _ops(out)
    assert onnx.load(str(out)).opset_import[0].version >= 18


@pytest.mark.parametrize("opset,message", [("17", "opset 18 or newer"), ("99", "newer than the installed onnx")])
def test_refuses_opsets_that_cannot_express_the_model(dirs, tmp_path, capsys, opset, message):
    out = tmp_path / "m.onnx"
    assert main(["export", str(dirs / "rms"), "--onnx", str(out), "--opset", opset, "-q"]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert list(tmp_path.iterdir()) == []


def test_refusals_write_nothing(dirs, tmp_path, capsys):
    out = tmp_path / "m.onnx"
    out.write_text("keep me")
    assert main(["export", str(dirs / "rms"), "--onnx", str(out), "-q"]) == 2
    assert "--force" in capsys.readouterr().err and out.read_text() == "keep me"
    assert main(["export", str(tmp_path / "missing"), "--onnx", str(tmp_path / "x.onnx"), "-q"]) == 2
    assert main(["export", str(dirs / "rms"), "--onnx", str(tmp_path / "no" / "x.onnx"), "-q"]) == 2
    err = capsys.readouterr().err
    assert "no such directory" in err and "Traceback" not in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.onnx"]


def test_original_needs_a_source(dirs, tmp_path, capsys):
    import normfold

    model = GPT2LMHeadModel.from_pretrained(dirs / "src").eval()
    conv, report = normfold.convert(model, verify=False)
    ckpt = normfold.save(conv, report, tmp_path / "api")  # saved from Python: no source path recorded
    assert main(["export", str(ckpt), "--onnx", str(tmp_path / "m.onnx"), "--original", "-q"]) == 2
    assert "--original MODEL" in capsys.readouterr().err
    assert not (tmp_path / "m.onnx").exists()


def test_missing_onnx_packages_is_a_clear_error(dirs, tmp_path, capsys, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "onnxscript" else real(name, *a))
    assert main(["export", str(dirs / "rms"), "--onnx", str(tmp_path / "m.onnx"), "-q"]) == 2
    assert "normfold[onnx]" in capsys.readouterr().err


def test_export_crmsnorm_checkpoint(dirs, tmp_path, capsys):
    assert main(["convert", str(dirs / "src"), "--to", "crmsnorm", "--out", str(tmp_path / "crms"), "-q"]) == 0
    capsys.readouterr()
    out = tmp_path / "c.onnx"
    assert main(["export", str(tmp_path / "crms"), "--onnx", str(out), "--original", "--json", "-q"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["passed"] and res["onnx_vs_pytorch"]["max_rel_error"] <= 1e-5
    assert res["onnx_vs_original_pytorch"]["top1_agreement"] == 1.0
