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
    ("option", ["--fold-final"]),
])
def test_what_does_not_stream_back(tmp_path, capsys, what, extra):
    """--stream always refuses (exit 2, one paragraph naming why, nothing written); auto converts in memory."""
    _, conv = _rms(tmp_path, "gpt2", "GPT2LMHeadModel")
    to = extra if "--to" in extra else ["--to", "layernorm", *extra]
    before = sorted(p.name for p in tmp_path.iterdir())
    code = main(["convert", str(conv), *to, "--out", str(tmp_path / "o"), "--stream", "always", "-q"])
    err = capsys.readouterr().err
    assert code == 2 and "--stream always cannot stream" in err and "Traceback" not in err
    assert err.strip().count("\n") == 0  # one paragraph
    assert sorted(p.name for p in tmp_path.iterdir()) == before
    code, report = _convert([str(conv), *to, "--out", str(tmp_path / "m")], capsys)
    assert code == 0 and not _streamed(report)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_added_bias_above_the_threshold_streams_block_by_block(tmp_path, capsys, monkeypatch, dtype):
    """A source with biases the conversion added loads back with normfold.load only; above the in-memory threshold
    the block-wise verifier replays the way back's own normfold.json structure (its added biases) on ORIGINAL, so
    it streams with --stream auto (the default) and always, verified block by block, the in-memory path's bytes."""
    from normfold.cli import convert_stream as stream_cli

    _, rms = _rms(tmp_path, "opt", "OPTForCausalLM", dtype=dtype, allow_new_bias=True, fold_final=True)
    if not json.loads((rms / "normfold.json").read_text())["structure"].get("added_bias"):
        pytest.skip("this source gained no bias")
    monkeypatch.setattr(stream_cli, "VERIFY_IN_MEMORY_BYTES", 0)
    code, report = _convert([str(rms), "--to", "layernorm", "--out", str(tmp_path / "o"), "--stream", "auto"], capsys)
    assert code == 0 and _streamed(report) and report["verification"]["passed"] is True
    assert "blockwise" in report["verification"] and report["stock_reloadable"] is False
    code, mem = _convert([str(rms), "--to", "layernorm", "--out", str(tmp_path / "mem"), "--stream", "never"], capsys)
    assert code == 0 and not _streamed(mem)
    assert tensors_bytes(tmp_path / "o") == tensors_bytes(tmp_path / "mem")


def _tied_scale_rms(tmp_path, dtype=torch.float32, allow_new_bias=False):
    """A Pre-RMSNorm GPT-2 whose head stays tied to the centred table and holds the final norm's γ (the final
    norm's β zeroed in the source, so --fold-final adds no bias; with allow_new_bias the β stays and is added)."""
    from normfold.adapters.base import get

    example = get_adapter("gpt2").examples[0]
    src = make_checkpoint(example, "GPT2LMHeadModel", tmp_path / "src", dtype=dtype, shard="20KB")
    model, _ = normfold.io.load_source(src)
    if not allow_new_bias:
        with torch.no_grad():
            for stream in get_adapter("gpt2").plan(model).streams:
                for site in stream.norms:
                    if site.final:
                        get(model, site.path).bias.zero_()
    conv, report = normfold.convert(model, to="rmsnorm", verify=False, fold_final=True, allow_new_bias=allow_new_bias)
    out = tmp_path / "rms"
    normfold.save(conv, report, out, source_dir=src)
    (tie,) = report.structure.tied_heads
    assert tie["scale"] and ("lm_head" in report.structure.added_bias) == allow_new_bias
    return src, out


def _new_way_back_source(tmp_path, family, head, case, dtype=torch.float32):
    """(normfold checkpoint, --to) for each way back this file tests beyond the plain ones."""
    if case.startswith("tied-bias"):  # an added bias on the tied head: verified block by block above the threshold
        return _tied_scale_rms(tmp_path, dtype, allow_new_bias=True)[1], "layernorm"
    if case.startswith("tied"):
        return _tied_scale_rms(tmp_path, dtype)[1], "layernorm"
    if case.startswith("rotated"):
        kind = case.split("-")[1]
        return _rms(tmp_path, family, head, dtype=dtype, rotate=kind, rotate_seed=3)[1], "layernorm"
    return _rms(tmp_path, family, head, dtype=dtype, to="crmsnorm", pad="pad" in case)[1], "rmsnorm"


@pytest.mark.parametrize("blockwise", [False, True], ids=["in-memory-verify", "blockwise-verify"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("family,head,case", [
    *[(f, h, c) for f, h in [("gpt2", "GPT2LMHeadModel"), ("opt", "OPTForCausalLM"), ("whisper", None),
                             ("bloom", "BloomForCausalLM")]
      for c in ("crmsnorm-to-rmsnorm", "crmsnorm-pad-to-rmsnorm")],
    ("gpt2", "GPT2LMHeadModel", "tied-scale-to-layernorm"),  # (OPT's: tests/stream/test_stream_reverse.py)
    ("gpt2", "GPT2LMHeadModel", "rotated-hadamard-to-layernorm"),
    ("opt", "OPTForCausalLM", "rotated-orthogonal-to-layernorm"),
    ("vit", None, "rotated-hadamard-to-layernorm"),
])
def test_cli_new_ways_back_stream_verify_and_match_every_mode(tmp_path, capsys, monkeypatch, family, head, case,
                                                             dtype, blockwise):
    """Pre-CRMSNorm --to rmsnorm and a tied head holding a folded γ --to layernorm stream by default and verify
    (in memory, or block by block above the threshold); --stream always / auto / never write the same bytes."""
    from normfold.cli import convert_stream as stream_cli

    if blockwise:
        monkeypatch.setattr(stream_cli, "VERIFY_IN_MEMORY_BYTES", 0)
    conv, to = _new_way_back_source(tmp_path, family, head, case, dtype)
    got = {}
    for mode in ("always", "auto", "never"):
        out = tmp_path / f"out-{mode}"
        code, report = _convert([str(conv), "--to", to, "--out", str(out), "--stream", mode], capsys)
        assert code == 0 and _streamed(report) == (mode != "never"), mode
        v = report["verification"]
        assert v["passed"] is True and v["fp64"]["passed"] is True
        if mode != "never":
            assert ("blockwise" in v) == blockwise
            if blockwise:
                assert v["blockwise"]["failed_blocks"] == [] and v["blockwise"]["blocks"] > 0
        assert report["variant"] == to
        got[mode] = tensors_bytes(out)
        assert (out / "config.json").read_text() == (tmp_path / "out-always" / "config.json").read_text()
    assert got["always"] == got["auto"] == got["never"]
    assert {v[0] for v in got["always"].values()} == {"F32" if dtype == torch.float32 else "BF16"}


@pytest.mark.parametrize("blockwise", [False, True], ids=["in-memory-verify", "blockwise-verify"])
@pytest.mark.parametrize("case,target", [("crmsnorm-to-rmsnorm", "h.1.mlp.c_proj.weight"),
                                         ("tied-scale-to-layernorm", "lm_head.weight"),
                                         ("tied-bias-to-layernorm", "lm_head.bias"),
                                         ("rotated-hadamard-to-layernorm", "h.1.mlp.c_proj.weight")])
def test_cli_new_ways_back_catch_a_wrong_tensor(tmp_path, capsys, monkeypatch, case, target, blockwise):
    """A streamed way back that wrote one wrong tensor (a restored writer of the decompression, the untied head
    (E' + μ1ᵀ)·diag γ, a rotated weight) fails verification, in memory and block by block, and nothing is
    written."""
    from safetensors.torch import load_file, save_file

    from normfold.cli import convert_stream as stream_cli

    real = stream_cli.stream_reverse

    def corrupting(source_dir, out_dir, **kw):
        report = real(source_dir, out_dir, **kw)
        for f in sorted(Path(out_dir).glob("*.safetensors")):
            state = load_file(f)
            name = next((k for k in state if k.endswith(target)), None)
            if name is not None:
                state[name] = state[name] * 1.01
                save_file(state, f, metadata={"format": "pt"})
                return report
        raise AssertionError("no tensor to corrupt")

    if blockwise:
        monkeypatch.setattr(stream_cli, "VERIFY_IN_MEMORY_BYTES", 0)
    monkeypatch.setattr(stream_cli, "stream_reverse", corrupting)
    conv, to = _new_way_back_source(tmp_path, "gpt2", "GPT2LMHeadModel", case)
    code = main(["convert", str(conv), "--to", to, "--out", str(tmp_path / "st"), "-q"])
    captured = capsys.readouterr()
    assert code == 1, captured.err
    assert "verification failed" in captured.err
    assert not (tmp_path / "st").exists()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tied_head_with_an_added_bias_streams_above_the_threshold(tmp_path, capsys, monkeypatch, dtype):
    """A tied head holding γ and an added bias streams back at any size: in memory below the threshold, block by
    block above it (the output's normfold.json structure replayed on ORIGINAL), with the in-memory bytes."""
    from normfold.cli import convert_stream as stream_cli

    _, conv = _tied_scale_rms(tmp_path, dtype=dtype, allow_new_bias=True)
    code, report = _convert([str(conv), "--to", "layernorm", "--out", str(tmp_path / "st")], capsys)
    assert code == 0 and _streamed(report) and report["verification"]["passed"] is True
    assert report["stock_reloadable"] is False
    monkeypatch.setattr(stream_cli, "VERIFY_IN_MEMORY_BYTES", 0)
    code, big = _convert([str(conv), "--to", "layernorm", "--out", str(tmp_path / "o"), "--stream", "always"], capsys)
    assert code == 0 and _streamed(big) and big["verification"]["passed"] is True and "blockwise" in big["verification"]
    code, mem = _convert([str(conv), "--to", "layernorm", "--out", str(tmp_path / "mem"), "--stream", "never"], capsys)
    assert code == 0 and not _streamed(mem)
    assert tensors_bytes(tmp_path / "st") == tensors_bytes(tmp_path / "mem") == tensors_bytes(tmp_path / "o")


@pytest.mark.parametrize("stream", ["always", "auto"])
def test_explicitly_rotated_checkpoint_is_refused_back(tmp_path, capsys, stream):
    """A stream rotated with explicit x·Q ops (BLOOM's stem) does not convert back (the reverse conversions drop
    such ops, in memory too): exit 2, one paragraph, nothing written, with --stream always and auto alike."""
    example = get_adapter("bloom").examples[0]
    src = make_checkpoint(example, "BloomForCausalLM", tmp_path / "src", shard="20KB")
    model, _ = normfold.io.load_source(src)
    conv, report = normfold.convert(model, rotate="hadamard", verify=False)
    assert report.structure.rotation.get("explicit")
    normfold.save(conv, report, tmp_path / "rot", source_dir=src)
    before = sorted(p.name for p in tmp_path.iterdir())
    code = main(["convert", str(tmp_path / "rot"), "--to", "layernorm", "--out", str(tmp_path / "o"),
                 "--stream", stream, "-q"])
    err = capsys.readouterr().err
    assert code == 2 and "explicit / online rotation" in err and "Traceback" not in err
    assert err.strip().count("\n") == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == before


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("to", ["rmsnorm", "layernorm"])
def test_crms_with_an_added_bias_streams_back_block_by_block(tmp_path, capsys, monkeypatch, dtype, to):
    """A Pre-CRMSNorm GPT-2 whose head gained a bias (--fold-final --allow-new-bias) streams back --to rmsnorm and
    --to layernorm above the in-memory threshold with --stream auto: verified block by block (the output's
    normfold.json structure replayed on ORIGINAL), the in-memory path's bytes."""
    from normfold.cli import convert_stream as stream_cli

    _, crms = _rms(tmp_path, "gpt2", "GPT2LMHeadModel", dtype=dtype, to="crmsnorm", fold_final=True,
                   allow_new_bias=True)
    assert json.loads((crms / "normfold.json").read_text())["structure"]["added_bias"]
    monkeypatch.setattr(stream_cli, "VERIFY_IN_MEMORY_BYTES", 0)
    code, report = _convert([str(crms), "--to", to, "--out", str(tmp_path / "o")], capsys)
    assert code == 0 and _streamed(report) and report["verification"]["passed"] is True
    assert "blockwise" in report["verification"]
    code, mem = _convert([str(crms), "--to", to, "--out", str(tmp_path / "mem"), "--stream", "never"], capsys)
    assert code == 0 and not _streamed(mem)
    assert tensors_bytes(tmp_path / "o") == tensors_bytes(tmp_path / "mem")
