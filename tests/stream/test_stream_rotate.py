"""`--rotate` streams (issue 26 item 3): a streamed rotated conversion writes the in-memory rotation's bytes
(`normfold.convert(rotate=...)` + `normfold.save`), whole components or a large table in row blocks, and its
output passes the block-wise verifier, which maps the original's stream by Q; a wrong rotated tensor fails it,
with its block named. Streams the in-memory rotation rotates through explicit hooks (BLOOM, Whisper, CLIP
vision, mBART stems; a final norm no head reads) and `--rotate-online` (online Hadamard ops on the MLP
down-projections' input) stream too, their hooks replayed by the verifier."""

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


def _source(tmp_path, family, head, dtype=torch.float32, example=None):
    example = next(e for e in get_adapter(family).examples if example in (None, e.name))
    src = make_checkpoint(example, head or example.heads[0], tmp_path / "src", dtype=dtype, shard="20KB")
    assert len(weight_files(src)) > 1
    return src


def _both(tmp_path, family, head, kind, dtype=torch.float32, seed=0, example=None, online=False):
    src = _source(tmp_path, family, head, dtype, example)
    model, _ = normfold.io.load_source(src)
    conv, mem_report = normfold.convert(model, verify=False, rotate=kind, rotate_seed=seed, rotate_online=online)
    normfold.save(conv, mem_report, tmp_path / "mem", source_dir=src)
    (tmp_path / "st").mkdir()
    report = stream_convert(src, tmp_path / "st", rotate=kind, rotate_seed=seed, rotate_online=online or None)
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
    monkeypatch.setattr(importlib.import_module("normfold.conversion"), "CENTER_CHUNK_BYTES", 1000)
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


# (family, head, example, kind of explicit hook): the stems recentred explicitly, whose output (or the first
# block's input) the in-memory rotation rotates by x·Q, and the final norms no head reads (·Qᵀ)
EXPLICIT = [("bloom", "BloomForCausalLM", "tied", "stem"),
            ("bloom", "BloomForCausalLM", "untied-eps6-tp2", "stem"),
            ("bloom", "BloomModel", "tied", "stem + final"),
            ("whisper", "WhisperForConditionalGeneration", "d32", "first block's input"),
            ("whisper", "WhisperModel", "d32", "first block's input + final"),
            ("clip", "CLIPVisionModel", "vision", "stem + final"),
            ("mbart", "MBartForConditionalGeneration", "d32-scaled", "stems"),
            ("gpt2", "GPT2Model", "tied", "final"),
            ("siglip", "SiglipVisionModel", "vision-no-head-eps5", "final")]
EXPLICIT_IDS = [f"{h}-{e}" for _, h, e, _ in EXPLICIT]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("family,head,example,hook", EXPLICIT, ids=EXPLICIT_IDS)
def test_explicit_hooks_stream_equal_to_in_memory(tmp_path, family, head, example, hook, kind):
    """The hooks hold no weights; the streamed writer writes the in-memory rotation's tensors (stem unrotated,
    a head-less final norm keeping γ/β), its normfold.json records the same explicit rotations, the same
    single normfold_model.safetensors (not stock-reloadable), and normfold.load runs it as the in-memory model."""
    _, mem_report, report = _both(tmp_path, family, head, kind, seed=3, example=example)
    _assert_same(tmp_path, mem_report, report)
    explicit = report.structure.rotation["explicit"]
    assert explicit and not report.stock_reloadable
    assert [f.name for f in weight_files(tmp_path / "st")] == ["normfold_model.safetensors"]
    assert [f.name for f in weight_files(tmp_path / "mem")] == ["normfold_model.safetensors"]
    assert any(e["transpose"] for e in explicit) == ("final" in hook)
    assert ("normfold.stream" in " ".join(report.notes)) and "normfold.stream" not in " ".join(mem_report.notes)


@pytest.mark.parametrize("family,head,example,hook", EXPLICIT[::2], ids=EXPLICIT_IDS[::2])
def test_explicit_hooks_bfloat16(tmp_path, family, head, example, hook):
    _, mem_report, report = _both(tmp_path, family, head, "hadamard", dtype=torch.bfloat16, example=example)
    _assert_same(tmp_path, mem_report, report)
    assert {v[0] for v in tensors_bytes(tmp_path / "st").values()} == {"BF16"}


def test_streamed_explicit_rotation_loads_like_in_memory(tmp_path):
    """normfold.load replays the streamed checkpoint's hooks: the same outputs, bit for bit, as the saved in-memory
    conversion, and the original's logits within float32 rounding."""
    src, _, _ = _both(tmp_path, "bloom", "BloomForCausalLM", "hadamard", example="tied")
    _assert_loads_like_in_memory(tmp_path, src)


def _assert_loads_like_in_memory(tmp_path, src):
    """normfold.load of the streamed and the in-memory checkpoints: the same logits bit for bit, the original's
    within float32 rounding."""
    from normfold.adapters import example_inputs

    a, b = normfold.load(tmp_path / "mem"), normfold.load(tmp_path / "st")
    original, _ = normfold.io.load_source(src)
    inputs = example_inputs(original, torch.Generator().manual_seed(0), seq=16)
    with torch.no_grad():
        x, y, o = a(**inputs).logits, b(**inputs).logits, original(**inputs).logits
    assert torch.equal(x, y)
    assert float((y - o).abs().max() / o.abs().max()) < 1e-5


# (family, head, example): --rotate-online, weights rotated through (GPT-2's Conv1D, OPT, GPT-NeoX) and with
# explicit hooks (BLOOM's stem, Whisper's first encoder block, ...)
ONLINE = [("gpt2", "GPT2LMHeadModel", None), ("opt", "OPTForCausalLM", None), ("gpt_neox", "GPTNeoXForCausalLM", None),
          ("bloom", "BloomForCausalLM", "tied"), ("whisper", "WhisperForConditionalGeneration", "d32"),
          ("vit", "ViTForImageClassification", None)]
ONLINE_IDS = [f"{h}" for _, h, _ in ONLINE]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("family,head,example", ONLINE, ids=ONLINE_IDS)
def test_rotate_online_streams_equal_to_in_memory(tmp_path, family, head, example, kind):
    """Each down-projection, rotated by Q along its stream axis, is multiplied by H/√n along its input axis in the
    same float64 values before the one rounding, as rotate.add_online_hadamard does: the same bytes; the same
    structure.rotation["online"] record (normfold.load replays the ops), one normfold_model.safetensors."""
    _, mem_report, report = _both(tmp_path, family, head, kind, seed=3, example=example, online=True)
    _assert_same(tmp_path, mem_report, report)
    assert report.structure.rotation["online"] and not report.stock_reloadable
    assert [f.name for f in weight_files(tmp_path / "st")] == ["normfold_model.safetensors"]


@pytest.mark.parametrize("family,head,example", ONLINE[::3], ids=ONLINE_IDS[::3])
def test_rotate_online_bfloat16(tmp_path, family, head, example):
    _, mem_report, report = _both(tmp_path, family, head, "orthogonal", dtype=torch.bfloat16, example=example,
                                  online=True)
    _assert_same(tmp_path, mem_report, report)
    assert {v[0] for v in tensors_bytes(tmp_path / "st").values()} == {"BF16"}


def test_rotate_online_row_blocks_equal_in_memory(tmp_path, monkeypatch):
    """Tiny row blocks: the down-projections (H mixes what are rows of GPT-2's Conv1D weight) are never split,
    the rest runs block by block; same bytes."""
    import importlib

    from normfold.algebra import rotation as algebra_rotation
    from normfold.stream import rotation as stream_rotation

    monkeypatch.setattr(stream_rotation, "BLOCK_ABOVE", 0)
    monkeypatch.setattr(algebra_rotation, "ROW_BLOCK_BYTES", 1000)
    monkeypatch.setattr(importlib.import_module("normfold.conversion"), "CENTER_CHUNK_BYTES", 1000)
    _, mem_report, report = _both(tmp_path, "gpt2", "GPT2LMHeadModel", "hadamard", example="untied-inv-idx",
                                  online=True)
    _assert_same(tmp_path, mem_report, report)


def test_streamed_rotate_online_loads_like_in_memory(tmp_path):
    src, _, _ = _both(tmp_path, "gpt2", "GPT2LMHeadModel", "hadamard", online=True)
    _assert_loads_like_in_memory(tmp_path, src)


def test_rotate_online_without_rotate_is_refused(tmp_path):
    src = _source(tmp_path, "bloom", "BloomForCausalLM")
    (tmp_path / "out").mkdir()
    with pytest.raises(StreamUnsupportedError, match="--rotate-online needs --rotate"):
        stream_convert(src, tmp_path / "out", options=normfold.ConvertOptions(rotate_online=True))
    assert not any((tmp_path / "out").iterdir())


# per ONLINE entry: a block and its down-projection (checkpoint key, input axis)
ONLINE_BLOCKS = {"GPT2LMHeadModel": ("transformer.h.1", "transformer.h.1.mlp.c_proj.weight", 0),
                 "OPTForCausalLM": ("model.decoder.layers.0", "model.decoder.layers.0.fc2.weight", 1),
                 "GPTNeoXForCausalLM": ("gpt_neox.layers.1", "gpt_neox.layers.1.mlp.dense_4h_to_h.weight", 1),
                 "BloomForCausalLM": ("transformer.h.0", "transformer.h.0.mlp.dense_4h_to_h.weight", 1),
                 "WhisperForConditionalGeneration": ("model.decoder.layers.1", "model.decoder.layers.1.fc2.weight", 1),
                 "ViTForImageClassification": ("vit.layers.1", "vit.layers.1.mlp.fc2.weight", 1)}


@pytest.mark.parametrize("family,head,example", ONLINE, ids=ONLINE_IDS)
def test_rotate_online_passes_blockwise_and_a_wrong_tensor_fails(tmp_path, family, head, example):
    """The verifier's skeleton replays the online Hadamard ops (they act inside a block: its stream input and
    output need no mapping of their own): the streamed output passes; one down-projection multiplied by H/√n
    once more along its input axis (its online rotation applied twice) fails, and its block alone is named."""
    from normfold.algebra import rotate_axis
    from normfold.ops.hadamard import hadamard_matrix
    from normfold.stream.blockverify import verify_blockwise

    from test_blockverify import _rewrite

    src = _source(tmp_path, family, head, example=example)
    (tmp_path / "st").mkdir()
    stream_convert(src, tmp_path / "st", rotate="hadamard", rotate_seed=1, rotate_online=True)
    good = verify_blockwise(src, tmp_path / "st")
    assert good["passed"] and good["working"]["passed"], good["fp64"]
    assert all(b["passed"] for b in good["fp64"]["blocks"] + good["fp64"]["embeddings"] + good["fp64"]["heads"])
    bad_block, key, axis = ONLINE_BLOCKS[head]
    assert bad_block in [b["name"] for b in good["fp64"]["blocks"]]

    def again(t):
        n = t.shape[axis]
        return rotate_axis(t, hadamard_matrix(n) / n ** 0.5, axis)

    _rewrite(tmp_path / "st", key, again)
    bad = verify_blockwise(src, tmp_path / "st")
    assert not bad["passed"] and not bad["fp64"]["passed"]
    assert bad["blockwise"]["failed_blocks"] == [bad_block]


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


CLI_SOURCES = {"gpt2": ("gpt2", "GPT2LMHeadModel", None, []), "bloom-stem": ("bloom", "BloomForCausalLM", "tied", []),
               "whisper-first-block": ("whisper", "WhisperForConditionalGeneration", "d32", []),
               "clip-vision-stem-final": ("clip", "CLIPVisionModel", "vision", []),
               "gpt2-online": ("gpt2", "GPT2LMHeadModel", None, ["--rotate-online"]),
               "bloom-stem-online": ("bloom", "BloomForCausalLM", "tied", ["--rotate-online"])}


@pytest.mark.parametrize("case", list(CLI_SOURCES))
@pytest.mark.parametrize("verify_in_memory", [True, False], ids=["verified-in-memory", "verified-blockwise"])
def test_cli_streams_rotation_verified_and_equal_to_never(tmp_path, capsys, monkeypatch, verify_in_memory, case):
    """`normfold convert SRC --rotate hadamard` streams by default (auto) and with always, explicit hooks and
    --rotate-online included; verified in memory (small sources) or block by block, passing; the same tensors as
    `--stream never`."""
    import json

    from normfold.cli import convert_stream as stream_cli
    from normfold.cli import main

    if not verify_in_memory:
        monkeypatch.setattr(stream_cli, "VERIFY_IN_MEMORY_BYTES", 0)
    family, head, example, extra = CLI_SOURCES[case]
    src = _source(tmp_path, family, head, example=example)
    for mode, out in (("auto", "auto"), ("always", "always"), ("never", "never")):
        assert main(["convert", str(src), "--out", str(tmp_path / out), "--stream", mode, "-q", "--json",
                     "--rotate", "hadamard", "--rotate-seed", "2", *extra]) == 0
        report = json.loads(capsys.readouterr().out)
        v = report["verification"]
        assert v["passed"] is True and v["fp64"]["passed"] is True
        assert ("normfold.stream" in " ".join(report["notes"])) == (mode != "never")
        assert ("blockwise" in v) == (mode != "never" and not verify_in_memory)
        assert report["structure"]["rotation"]["seed"] == 2
        assert bool(report["structure"]["rotation"].get("explicit")) == (family != "gpt2")
        assert bool(report["structure"]["rotation"].get("online")) == bool(extra)
    assert tensors_bytes(tmp_path / "auto") == tensors_bytes(tmp_path / "never") == tensors_bytes(tmp_path / "always")


def test_cli_rotate_online_without_rotate_exits_2_in_every_mode(tmp_path, capsys):
    """--rotate-online alone: always and auto exit 2 with one paragraph naming it, and write nothing."""
    from normfold.cli import main

    src = _source(tmp_path, "gpt2", "GPT2LMHeadModel")
    for mode in ("always", "auto"):
        code = main(["convert", str(src), "--out", str(tmp_path / mode), "--stream", mode, "-q", "--rotate-online"])
        err = capsys.readouterr().err
        assert code == 2 and "--rotate-online needs --rotate" in err and "Traceback" not in err
        assert err.strip().count("\n") == 0
        assert not (tmp_path / mode).exists()


@pytest.mark.parametrize("family,head,example", [("opt", "OPTForCausalLM", None), ("bloom", "BloomForCausalLM", "tied"),
                                                  ("mbart", "MBartForConditionalGeneration", "d32-scaled")])
def test_normfold_verify_blockwise_on_a_rotated_checkpoint_equals_in_memory(tmp_path, capsys, family, head, example):
    """`normfold verify ORIGINAL ROTATED --blockwise` (the mapping by Q, explicit hooks replayed) reports the
    float64 error that the in-memory check (`--no-blockwise`, rotate.unrotate_outputs) reports, and both pass."""
    import json

    from normfold.cli import main

    src = _source(tmp_path, family, head, example=example)
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


# per EXPLICIT entry: a block and one of its writers (checkpoint key, stream axis)
EXPLICIT_BLOCKS = {"BloomForCausalLM": ("transformer.h.1", "transformer.h.1.mlp.dense_4h_to_h.weight", 0),
                   "BloomModel": ("h.1", "h.1.mlp.dense_4h_to_h.weight", 0),
                   # the block whose input its own explicit hook rotates: the verifier maps the original's stream
                   # onto it unrotated (blockverify._raw_input_blocks)
                   "WhisperForConditionalGeneration": ("model.encoder.layers.0", "model.encoder.layers.0.fc2.weight", 0),
                   "WhisperModel": ("decoder.layers.1", "decoder.layers.1.fc2.weight", 0),
                   "CLIPVisionModel": ("encoder.layers.1", "encoder.layers.1.mlp.fc2.weight", 0),
                   "MBartForConditionalGeneration": ("model.decoder.layers.1", "model.decoder.layers.1.fc2.weight", 0),
                   "GPT2Model": ("h.1", "h.1.mlp.c_proj.weight", 1),
                   "SiglipVisionModel": ("encoder.layers.1", "encoder.layers.1.mlp.fc2.weight", 0)}


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("family,head,example,hook", [e for e in EXPLICIT if e[2] != "untied-eps6-tp2"],
                         ids=[i for i, e in zip(EXPLICIT_IDS, EXPLICIT) if e[2] != "untied-eps6-tp2"])
def test_explicit_hooks_pass_blockwise_and_a_wrong_tensor_fails(tmp_path, family, head, example, hook, kind):
    """The verifier's skeleton replays the explicit hooks (Q rebuilt in float64 from kind + seed): the streamed
    output passes, every block and head within the float64 tolerance, in float64 and in float32; one block's
    writer rotated twice fails, and that block alone is named."""
    from normfold.algebra import rotate_axis
    from normfold.rotate import rotation_of
    from normfold.stream.blockverify import verify_blockwise

    from test_blockverify import _rewrite

    src = _source(tmp_path, family, head, example=example)
    (tmp_path / "st").mkdir()
    report = stream_convert(src, tmp_path / "st", rotate=kind, rotate_seed=1)
    good = verify_blockwise(src, tmp_path / "st")
    assert good["passed"] and good["working"]["passed"], good["fp64"]
    assert good["fp64"]["max_rel_error"] < good["fp64"]["tolerance"]
    assert all(b["passed"] for b in good["fp64"]["blocks"] + good["fp64"]["embeddings"] + good["fp64"]["heads"])
    assert good["fp64"]["embeddings"]  # the stream into each stack, after the stem's hook
    bad_block, key, axis = EXPLICIT_BLOCKS[head]
    assert bad_block in [b["name"] for b in good["fp64"]["blocks"]]
    (q,) = rotation_of(report.structure.rotation).values()
    _rewrite(tmp_path / "st", key, lambda t: rotate_axis(t, q, axis, center=True))
    bad = verify_blockwise(src, tmp_path / "st")
    assert not bad["passed"] and not bad["fp64"]["passed"]
    failed = bad["blockwise"]["failed_blocks"]
    # a decoder's blocks read the encoder's output (cross-attention) from the converted model's own run, so a
    # wrong encoder block fails them too; within its own stack the wrong block is the only one named
    stack = bad_block.rpartition(".")[0]
    assert failed[0] == bad_block and [b for b in failed if b.rpartition(".")[0] == stack] == [bad_block]
    if "encoder" in stack:
        assert all(".decoder." in f".{b}" for b in failed[1:])
    else:
        assert failed == [bad_block]


def test_first_block_rotating_its_own_input_is_mapped_unrotated(tmp_path, monkeypatch):
    """Whisper's encoder: the explicit x·Q is a pre-hook of encoder.layers.0, so that block receives the
    original basis. Mapped by Q as the other blocks are, the reference would be rotated twice and that block
    (alone) would fail: the mapping without Q is what passes it."""
    from normfold.stream import blockverify

    src = _source(tmp_path, "whisper", "WhisperForConditionalGeneration", example="d32")
    (tmp_path / "st").mkdir()
    stream_convert(src, tmp_path / "st", rotate="hadamard")
    assert blockverify.verify_blockwise(src, tmp_path / "st")["passed"]
    monkeypatch.setattr(blockverify, "_raw_input_blocks", lambda report: frozenset())
    got = blockverify.verify_blockwise(src, tmp_path / "st")
    assert got["blockwise"]["failed_blocks"] == ["model.encoder.layers.0"]


def test_a_wrong_stem_fails_before_the_first_block(tmp_path):
    """BLOOM's stem is not rotated (its LayerNorm keeps γ/β, the hook rotates its output): a perturbed stem γ
    fails the stream entering the first block, while every block, run on the original's mapped stream, passes."""
    from normfold.stream.blockverify import verify_blockwise

    from test_blockverify import _perturb

    src = _source(tmp_path, "bloom", "BloomForCausalLM", example="tied")
    (tmp_path / "st").mkdir()
    stream_convert(src, tmp_path / "st", rotate="orthogonal")
    _perturb(tmp_path / "st", "transformer.word_embeddings_layernorm.weight", 0.05)
    bad = verify_blockwise(src, tmp_path / "st")
    assert not bad["passed"] and bad["blockwise"]["failed_blocks"] == []
    (emb,) = bad["fp64"]["embeddings"]
    assert emb["name"] == "stream into transformer.h.0" and not emb["passed"]


# ---- --rotate-attention online: the Hadamard before each attention output projection ----------------------------

def _both_attention(tmp_path, family, head, online, attention="online"):
    src = _source(tmp_path, family, head)
    model, _ = normfold.io.load_source(src)
    conv, mem_report = normfold.convert(model, verify=False, rotate="hadamard", rotate_seed=2, rotate_online=online,
                                        rotate_attention=attention)
    normfold.save(conv, mem_report, tmp_path / "mem", source_dir=src)
    (tmp_path / "st").mkdir()
    opts = normfold.ConvertOptions(rotate="hadamard", rotate_seed=2, rotate_online=online,
                                   rotate_attention=attention)
    report = stream_convert(src, tmp_path / "st", options=opts)
    return src, mem_report, report


@pytest.mark.parametrize("online", [False, True])
@pytest.mark.parametrize("family,head", FAMILIES)
def test_rotate_attention_online_streams_equal_to_in_memory(tmp_path, family, head, online):
    """Each attention output projection, rotated by Q along its output axis, is multiplied by H/√d along its input
    axis in the same float64 values before the one rounding: the in-memory bytes, the same record."""
    src, mem_report, report = _both_attention(tmp_path, family, head, online)
    _assert_same(tmp_path, mem_report, report)
    assert report.structure.rotation["online"] == mem_report.structure.rotation["online"] != []
    assert not report.stock_reloadable
    if family == "gpt2":
        _assert_loads_like_in_memory(tmp_path, src)


@pytest.mark.parametrize("attention", ["vo", "both", "qk", "all"])
def test_rotate_attention_vo_does_not_stream(tmp_path, attention):
    src = _source(tmp_path, "gpt2", "GPT2LMHeadModel")
    opts = normfold.ConvertOptions(rotate="hadamard", rotate_attention=attention)
    (tmp_path / "out").mkdir()
    with pytest.raises(StreamUnsupportedError, match="in-memory"):
        stream_convert(src, tmp_path / "out", options=opts)
    assert not any((tmp_path / "out").iterdir())


@pytest.mark.parametrize("verify_in_memory", [True, False])
def test_cli_streams_rotate_attention_online_verified(tmp_path, capsys, monkeypatch, verify_in_memory):
    """`--stream always --rotate-attention online`: streamed, verified in memory or block by block (the online ops
    replayed), passing; the in-memory bytes; `vo` still exits 2 with nothing written."""
    import json

    from normfold.cli import convert_stream as stream_cli
    from normfold.cli import main

    if not verify_in_memory:
        monkeypatch.setattr(stream_cli, "VERIFY_IN_MEMORY_BYTES", 0)
    src = _source(tmp_path, "gpt2", "GPT2LMHeadModel")
    for mode in ("always", "never"):
        assert main(["convert", str(src), "--rotate", "hadamard", "--rotate-attention", "online", "--stream", mode,
                     "--out", str(tmp_path / mode), "-q", "--json"]) == 0
        report = json.loads(capsys.readouterr().out)
        v = report["verification"]
        assert v["passed"] is True and v["fp64"]["passed"] is True
        assert ("blockwise" in v) == (mode == "always" and not verify_in_memory)
        assert report["structure"]["rotation"]["online"]
    a, b = tensors_bytes(tmp_path / "never"), tensors_bytes(tmp_path / "always")
    assert sorted(a) == sorted(b) and [k for k in a if a[k] != b[k]] == []
    for attention in ("vo", "qk"):
        code = main(["convert", str(src), "--rotate", "hadamard", "--rotate-attention", attention, "--stream",
                     "always", "--out", str(tmp_path / attention), "-q"])
        err = capsys.readouterr().err
        assert code == 2 and f"--rotate-attention {attention}" in err and "Traceback" not in err
        assert not (tmp_path / attention).exists()
    # --stream auto takes the in-memory conversion for them instead of refusing
    assert main(["convert", str(src), "--rotate", "hadamard", "--rotate-attention", "qk", "--stream", "auto",
                 "--out", str(tmp_path / "qk-auto"), "-q", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["verification"]["passed"] is True and report["structure"]["rotation"]["query_key"]
