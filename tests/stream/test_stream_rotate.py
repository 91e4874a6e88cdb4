"""`--rotate` streams (issue 26 item 3): a streamed rotated conversion writes the in-memory rotation's bytes
(`normfold.convert(rotate=...)` + `normfold.save`), whole components or a large table in row blocks, and its
output passes the block-wise verifier, which maps the original's stream by Q; a wrong rotated tensor fails it,
with its block named. Streams the in-memory rotation rotates through explicit hooks are refused."""

from __future__ import annotations

import pytest
import torch

import normfold
from normfold.adapters import get_adapter
from normfold.stream import stream_convert
from normfold.stream.source import StreamUnsupportedError

from _compare import make_checkpoint, tensors_bytes, weight_files

FAMILIES = [("gpt2", "GPT2LMHeadModel"), ("opt", "OPTForCausalLM"), ("gpt_neox", "GPTNeoXForCausalLM")]
KINDS = ["hadamard", "orthogonal"]


def _source(tmp_path, family, head, dtype=torch.float32):
    example = get_adapter(family).examples[0]
    src = make_checkpoint(example, head or example.heads[0], tmp_path / "src", dtype=dtype, shard="20KB")
    assert len(weight_files(src)) > 1
    return src


def _both(tmp_path, family, head, kind, dtype=torch.float32, seed=0):
    src = _source(tmp_path, family, head, dtype)
    model, _ = normfold.io.load_source(src)
    conv, mem_report = normfold.convert(model, verify=False, rotate=kind, rotate_seed=seed)
    normfold.save(conv, mem_report, tmp_path / "mem", source_dir=src)
    (tmp_path / "st").mkdir()
    report = stream_convert(src, tmp_path / "st", rotate=kind, rotate_seed=seed)
    return src, mem_report, report


def _assert_same(tmp_path, mem_report, report):
    a, b = tensors_bytes(tmp_path / "mem"), tensors_bytes(tmp_path / "st")
    assert sorted(a) == sorted(b)
    assert [k for k in a if a[k] != b[k]] == []
    x, y = mem_report.to_dict(), report.to_dict()
    for key in ("structure", "edits", "stock_reloadable", "layernorms", "size", "centered_outputs", "dtype"):
        assert x[key] == y[key], key


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("family,head", FAMILIES + [("vit", None)])
def test_streamed_rotation_equals_in_memory(tmp_path, family, head, kind):
    _, mem_report, report = _both(tmp_path, family, head, kind, seed=3)
    _assert_same(tmp_path, mem_report, report)
    assert report.structure.rotation["kind"] == kind and report.structure.rotation["seed"] == 3


@pytest.mark.parametrize("family,head", FAMILIES[:2])
def test_row_blocks_equal_in_memory(tmp_path, monkeypatch, family, head):
    """Tiny blocks: every row-separable component (tables, heads) runs block by block, each block multiplied
    by Q as the in-memory rotation's blocks are; same bytes (fails if a block is written over other rows).
    At GPT-2-XL widths MKL rounds a row differently with other row counts, which is why the blocks are shared."""
    import importlib

    from normfold.algebra import rotation as algebra_rotation
    from normfold.stream import rotation as stream_rotation

    monkeypatch.setattr(stream_rotation, "BLOCK_ABOVE", 0)
    monkeypatch.setattr(algebra_rotation, "ROW_BLOCK_BYTES", 1000)
    monkeypatch.setattr(importlib.import_module("normfold.convert"), "CENTER_CHUNK_BYTES", 1000)
    blocked = []
    real = stream_rotation.RotatingComputer._by_blocks

    def spy(self, comp, keys, tensors, big, saved):
        out = real(self, comp, keys, tensors, big, saved)
        if out is not None:
            blocked.append(big)
        return out

    monkeypatch.setattr(stream_rotation.RotatingComputer, "_by_blocks", spy)
    _, mem_report, report = _both(tmp_path, family, head, "hadamard")
    assert len(blocked) >= 2  # the embedding table and the untied head at least
    _assert_same(tmp_path, mem_report, report)


def test_bfloat16_rotation_stays_bf16(tmp_path):
    _, mem_report, report = _both(tmp_path, "gpt2", "GPT2LMHeadModel", "orthogonal", dtype=torch.bfloat16)
    _assert_same(tmp_path, mem_report, report)
    assert {v[0] for v in tensors_bytes(tmp_path / "st").values()} == {"BF16"}


def test_explicit_rotations_and_online_are_refused(tmp_path):
    src = _source(tmp_path, "bloom", "BloomForCausalLM")
    (tmp_path / "out").mkdir()
    with pytest.raises(StreamUnsupportedError, match="explicit"):
        stream_convert(src, tmp_path / "out", rotate="hadamard")
    with pytest.raises(StreamUnsupportedError, match="rotate-online"):
        stream_convert(src, tmp_path / "out", rotate="hadamard", options=normfold.ConvertOptions(rotate_online=True))
    assert not any((tmp_path / "out").iterdir())


# a block's MLP writer and its stream axis
BLOCK_KEYS = {"gpt2": ("transformer.h.1", "transformer.h.1.mlp.c_proj.weight", 1),
              "opt": ("model.decoder.layers.1", "model.decoder.layers.1.fc2.weight", 0),
              "gpt_neox": ("gpt_neox.layers.1", "gpt_neox.layers.1.mlp.dense_4h_to_h.weight", 0)}


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("family,head", FAMILIES)
def test_streamed_rotation_passes_blockwise_and_a_wrong_tensor_fails(tmp_path, family, head, kind):
    """The block-wise verifier maps the original's stream by Q (structure.rotation: kind + seed): the streamed
    rotated output passes, every block and head within the float64 tolerance; the same output with one block's
    writer rotated twice (t·Q·Q, a rotation applied again) fails, and that block is the one named."""
    from normfold.algebra import rotate_axis
    from normfold.rotate import rotation_of
    from normfold.stream.blockverify import verify_blockwise

    from test_blockverify import _rewrite

    src = _source(tmp_path, family, head)
    (tmp_path / "st").mkdir()
    report = stream_convert(src, tmp_path / "st", rotate=kind, rotate_seed=1)
    good = verify_blockwise(src, tmp_path / "st")
    assert good["passed"], good["fp64"]
    assert good["fp64"]["max_rel_error"] < good["fp64"]["tolerance"]
    assert all(b["passed"] for b in good["fp64"]["blocks"]) and good["fp64"]["heads"]
    if kind == "hadamard":  # the mapping by Q is what passes it: without it every block fails
        import pytest as _pt

        with _pt.MonkeyPatch.context() as mp:
            mp.setattr("normfold.stream.blockverify._rotation", lambda report, centered: ({}, None))
            unmapped = verify_blockwise(src, tmp_path / "st")
        assert not unmapped["passed"] and unmapped["blockwise"]["failed_blocks"]
    bad_block, key, axis = BLOCK_KEYS[family]
    (q,) = rotation_of(report.structure.rotation).values()
    _rewrite(tmp_path / "st", key, lambda t: rotate_axis(t, q, axis, center=True))
    bad = verify_blockwise(src, tmp_path / "st")
    assert not bad["passed"] and not bad["fp64"]["passed"]
    assert bad["blockwise"]["failed_blocks"] == [bad_block]


@pytest.mark.parametrize("verify_in_memory", [True, False], ids=["verified-in-memory", "verified-blockwise"])
def test_cli_streams_rotation_verified_and_equal_to_never(tmp_path, capsys, monkeypatch, verify_in_memory):
    """`normfold convert SRC --rotate hadamard` streams by default (auto) and with always; verified in memory
    (small sources) or block by block, passing; the same tensors as `--stream never`."""
    import json

    from normfold.cli import convert_stream as stream_cli
    from normfold.cli import main

    if not verify_in_memory:
        monkeypatch.setattr(stream_cli, "VERIFY_IN_MEMORY_BYTES", 0)
    src = _source(tmp_path, "gpt2", "GPT2LMHeadModel")
    for mode, out in (("auto", "auto"), ("always", "always"), ("never", "never")):
        assert main(["convert", str(src), "--out", str(tmp_path / out), "--stream", mode, "-q", "--json",
                     "--rotate", "hadamard", "--rotate-seed", "2"]) == 0
        report = json.loads(capsys.readouterr().out)
        v = report["verification"]
        assert v["passed"] is True and v["fp64"]["passed"] is True
        assert ("normfold.stream" in " ".join(report["notes"])) == (mode != "never")
        assert ("blockwise" in v) == (mode != "never" and not verify_in_memory)
        assert report["structure"]["rotation"]["seed"] == 2
    assert tensors_bytes(tmp_path / "auto") == tensors_bytes(tmp_path / "never") == tensors_bytes(tmp_path / "always")


def test_cli_explicit_rotation_refused_with_always_and_in_memory_with_auto(tmp_path, capsys):
    import json

    from normfold.cli import main

    src = _source(tmp_path, "bloom", "BloomForCausalLM")
    code = main(["convert", str(src), "--out", str(tmp_path / "o"), "--stream", "always", "-q", "--rotate", "hadamard"])
    err = capsys.readouterr().err
    assert code == 2 and "explicit" in err and "Traceback" not in err and err.strip().count("\n") == 0
    assert not (tmp_path / "o").exists()
    assert main(["convert", str(src), "--out", str(tmp_path / "m"), "-q", "--json", "--rotate", "hadamard"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert "normfold.stream" not in " ".join(report["notes"]) and report["verification"]["passed"] is True
    assert report["structure"]["rotation"]["explicit"]


def test_normfold_verify_blockwise_on_a_rotated_checkpoint_equals_in_memory(tmp_path, capsys):
    """`normfold verify ORIGINAL ROTATED --blockwise` (the mapping by Q) reports the float64 error that the
    in-memory check (`--no-blockwise`, rotate.unrotate_outputs) reports, and both pass."""
    import json

    from normfold.cli import main

    src = _source(tmp_path, "opt", "OPTForCausalLM")
    assert main(["convert", str(src), "--out", str(tmp_path / "o"), "-q", "--rotate", "orthogonal"]) == 0
    capsys.readouterr()
    got = {}
    for flag in ("--blockwise", "--no-blockwise"):
        assert main(["verify", str(src), str(tmp_path / "o"), flag, "--json"]) == 0
        d = json.loads(capsys.readouterr().out)
        got[flag] = d.get("verification", d)
    assert "blockwise" in got["--blockwise"] and "blockwise" not in got["--no-blockwise"]
    assert got["--blockwise"]["passed"] and got["--no-blockwise"]["passed"]
    assert got["--blockwise"]["fp64"]["max_rel_error"] == pytest.approx(got["--no-blockwise"]["fp64"]["max_rel_error"],
                                                                        rel=1e-6)
