"""`normfold convert CONVERTED --to layernorm --out DIR` (Pre-RMSNorm or Pre-CRMSNorm, d-1 or padded) streams by
default (issue 26 item 3) and verifies what it
wrote: in memory up to VERIFY_IN_MEMORY_BYTES, above it block by block with the roles swapped (the streamed
LayerNorm output as ORIGINAL, the normfold source as CONVERTED). The bytes are the in-memory path's; what does not
stream converts in memory with --stream auto and is refused (exit 2, one paragraph, nothing written) with always."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import normfold
from normfold.adapters import get_adapter
from normfold.cli import main
from normfold.stream import stream_convert

from _compare import make_checkpoint, tensors_bytes

FAMILIES = [("gpt2", "GPT2LMHeadModel"), ("opt", "OPTForCausalLM"), ("vit", None)]


def _rms(tmp_path, family, head, dtype=torch.float32, **kw):
    example = get_adapter(family).examples[0]
    src = make_checkpoint(example, head or example.heads[0], tmp_path / "src", dtype=dtype, shard="20KB")
    out = tmp_path / "rms"
    out.mkdir()
    stream_convert(src, out, **{"to": "rmsnorm", **kw})
    return src, out


def _convert(args, capsys) -> tuple[int, dict | None]:
    code = main(["convert", *args, "-q", "--json"])
    out = capsys.readouterr().out
    return code, (json.loads(out) if out.strip() else None)


def _streamed(report: dict) -> bool:
    return "normfold.stream" in " ".join(report["notes"])


@pytest.mark.parametrize("fwd", [{}, {"to": "crmsnorm"}, {"to": "crmsnorm", "pad": True}],
                         ids=["from-rmsnorm", "from-crmsnorm", "from-crmsnorm-pad"])
@pytest.mark.parametrize("blockwise", [False, True], ids=["in-memory-verify", "blockwise-verify"])
@pytest.mark.parametrize("family,head", FAMILIES)
def test_cli_streams_the_way_back_and_verifies(tmp_path, capsys, monkeypatch, family, head, blockwise, fwd):
    from normfold.cli import convert_stream as stream_cli

    if blockwise:
        monkeypatch.setattr(stream_cli, "VERIFY_IN_MEMORY_BYTES", 0)
    src, rms = _rms(tmp_path, family, head, **fwd)
    code, report = _convert([str(rms), "--to", "layernorm", "--out", str(tmp_path / "st")], capsys)
    assert code == 0 and _streamed(report)
    v = report["verification"]
    assert v["passed"] is True and v["fp64"]["passed"] is True
    assert ("blockwise" in v) == blockwise and ("roles" in v) == blockwise
    if blockwise:
        assert v["blockwise"]["failed_blocks"] == [] and v["blockwise"]["blocks"] > 0
    assert json.loads((tmp_path / "st" / "normfold.json").read_text())["verification"]["passed"] is True
    code, mem = _convert([str(rms), "--to", "layernorm", "--out", str(tmp_path / "mem"), "--stream", "never"], capsys)
    assert code == 0 and not _streamed(mem)
    assert tensors_bytes(tmp_path / "st") == tensors_bytes(tmp_path / "mem")
    assert (tmp_path / "st" / "config.json").read_text() == (tmp_path / "mem" / "config.json").read_text()
    # float64: the streamed LayerNorm model computes the original's outputs
    original, _ = normfold.io.load_source(src)
    back, _ = normfold.io.load_source(tmp_path / "st")
    original, back = original.double().eval(), back.double().eval()
    inputs = get_adapter(family).example_inputs(original, torch.Generator().manual_seed(0))
    inputs = {k: v.double() if v.is_floating_point() else v for k, v in inputs.items()}
    with torch.no_grad():
        a, b = original(**inputs), back(**inputs)
    a = a.logits if getattr(a, "logits", None) is not None else a.last_hidden_state
    b = b.logits if getattr(b, "logits", None) is not None else b.last_hidden_state
    assert float((a - b).abs().max() / a.abs().max()) <= 1e-5  # float32 weights rounded once each way


@pytest.mark.parametrize("dtype", [torch.bfloat16])
def test_cli_streamed_way_back_16bit_blockwise(tmp_path, capsys, monkeypatch, dtype):
    from normfold.cli import convert_stream as stream_cli

    monkeypatch.setattr(stream_cli, "VERIFY_IN_MEMORY_BYTES", 0)
    _, rms = _rms(tmp_path, "gpt2", "GPT2LMHeadModel", dtype=dtype)
    code, report = _convert([str(rms), "--to", "layernorm", "--out", str(tmp_path / "st")], capsys)
    assert code == 0 and _streamed(report) and report["verification"]["passed"] is True
    assert report["dtype"] == "bfloat16"


def test_cli_way_back_catches_a_wrong_tensor(tmp_path, capsys, monkeypatch):
    """A streamed way back that wrote one wrong tensor fails block-wise verification (the block is named) and
    nothing is written."""
    from safetensors.torch import load_file, save_file

    from normfold.cli import convert_stream as stream_cli

    real = stream_cli.stream_reverse

    def corrupting(source_dir, out_dir, **kw):
        report = real(source_dir, out_dir, **kw)
        for f in sorted(Path(out_dir).glob("*.safetensors")):
            state = load_file(f)
            name = next((k for k in state if k.endswith("h.1.mlp.c_proj.weight")), None)
            if name is not None:
                state[name] = state[name] * 1.01  # (a constant added would only move the stream's mean, which
                # every LayerNorm removes: an equivalent model, rightly passed)
                save_file(state, f, metadata={"format": "pt"})
                return report
        raise AssertionError("no tensor to corrupt")

    monkeypatch.setattr(stream_cli, "VERIFY_IN_MEMORY_BYTES", 0)
    monkeypatch.setattr(stream_cli, "stream_reverse", corrupting)
    _, rms = _rms(tmp_path, "gpt2", "GPT2LMHeadModel")
    code = main(["convert", str(rms), "--to", "layernorm", "--out", str(tmp_path / "st"), "-q"])
    captured = capsys.readouterr()
    assert code == 1, captured.err
    assert "verification failed" in captured.err and "transformer.h.1" in captured.err
    assert not (tmp_path / "st").exists()


@pytest.mark.parametrize("what,extra", [
    ("--to rmsnorm", ["--to", "rmsnorm"]),
    ("option", ["--fold-final"]),
])
def test_what_does_not_stream_back(tmp_path, capsys, what, extra):
    """--stream always refuses (exit 2, one paragraph naming why, nothing written); auto converts in memory."""
    kw = {"to": "crmsnorm"} if what == "--to rmsnorm" else {}  # Pre-CRMSNorm -> Pre-RMSNorm: in memory
    _, conv = _rms(tmp_path, "gpt2", "GPT2LMHeadModel", **kw)
    to = extra if "--to" in extra else ["--to", "layernorm", *extra]
    before = sorted(p.name for p in tmp_path.iterdir())
    code = main(["convert", str(conv), *to, "--out", str(tmp_path / "o"), "--stream", "always", "-q"])
    err = capsys.readouterr().err
    assert code == 2 and "--stream always cannot stream" in err and "Traceback" not in err
    assert err.strip().count("\n") == 0  # one paragraph
    assert sorted(p.name for p in tmp_path.iterdir()) == before
    code, report = _convert([str(conv), *to, "--out", str(tmp_path / "m")], capsys)
    assert code == 0 and not _streamed(report)


def test_added_bias_above_the_threshold_is_refused_by_name(tmp_path, capsys, monkeypatch):
    """A source with biases the conversion added loads back with normfold.load only; the block-wise verifier
    reads the way back as a stock checkpoint, so above the in-memory threshold it does not stream."""
    from normfold.cli import convert_stream as stream_cli

    _, rms = _rms(tmp_path, "opt", "OPTForCausalLM", allow_new_bias=True, fold_final=True)
    if not json.loads((rms / "normfold.json").read_text())["structure"].get("added_bias"):
        pytest.skip("this source gained no bias")
    monkeypatch.setattr(stream_cli, "VERIFY_IN_MEMORY_BYTES", 0)
    code = main(["convert", str(rms), "--to", "layernorm", "--out", str(tmp_path / "o"), "--stream", "always", "-q"])
    err = capsys.readouterr().err
    assert code == 2 and "added" in err and not (tmp_path / "o").exists()
