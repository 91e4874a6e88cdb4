"""Every target streams (issue 26): `--to crmsnorm` (d-1 and `--pad`) and `--to rmsnorm` on multi-shard
checkpoints of several families write the same bytes as `normfold.convert` + `normfold.save`, tensor by tensor
and file by file, and 16-bit sources stay in their dtype."""

from __future__ import annotations

import importlib

import pytest
import torch

import normfold
from normfold.adapters import get_adapter
from normfold.stream import stream_convert

from _compare import header_and_data, make_checkpoint, tensors_bytes, weight_files

FAMILIES = [("gpt2", "GPT2LMHeadModel"), ("gpt_neox", "GPTNeoXForCausalLM"), ("opt", "OPTForCausalLM"),
            ("bloom", "BloomForCausalLM"), ("vit", None)]
TARGETS = [{"to": "rmsnorm"}, {"to": "crmsnorm"}, {"to": "crmsnorm", "pad": True},
           {"to": "crmsnorm", "fold_final": True, "allow_new_bias": True}]


def _both(tmp_path, family, head, dtype=torch.float32, **kw):
    example = get_adapter(family).examples[0]
    src = make_checkpoint(example, head or example.heads[0], tmp_path / "src", dtype=dtype, shard="20KB")
    assert len(weight_files(src)) > 1  # a sharded source
    model, _ = normfold.io.load_source(src)
    conv, mem_report = normfold.convert(model, verify=False, **kw)
    normfold.save(conv, mem_report, tmp_path / "mem", source_dir=src)
    (tmp_path / "st").mkdir()
    report = stream_convert(src, tmp_path / "st", **kw)
    return mem_report, report


def _assert_same_files(a, b):
    """Every tensor bit for bit (names, dtypes, shapes, bytes); a stock-reloadable streamed output keeps the
    source's shards where normfold.save writes one file, otherwise the files themselves are identical."""
    assert tensors_bytes(a) == tensors_bytes(b)
    fa, fb = weight_files(a), weight_files(b)
    if len(fb) == 1:
        assert [f.name for f in fa] == [f.name for f in fb]
        (hx, dx), (hy, dy) = header_and_data(fa[0]), header_and_data(fb[0])
        assert hx == hy and dx == dy
    assert (a / "config.json").read_text() == (b / "config.json").read_text()


@pytest.mark.parametrize("kw", TARGETS, ids=lambda k: "-".join(f"{v}" for v in k.values()))
@pytest.mark.parametrize("family,head", FAMILIES)
def test_streamed_targets_equal_in_memory(tmp_path, family, head, kw):
    mem_report, report = _both(tmp_path, family, head, **kw)
    _assert_same_files(tmp_path / "mem", tmp_path / "st")
    a, b = mem_report.to_dict(), report.to_dict()
    for key in ("structure", "edits", "stock_reloadable", "layernorms", "size", "centered_outputs", "dtype"):
        assert a[key] == b[key], key


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kw", TARGETS[1:3], ids=["crmsnorm", "crmsnorm-pad"])
def test_streamed_crmsnorm_keeps_16bit(tmp_path, dtype, kw):
    _both(tmp_path, "gpt2", "GPT2LMHeadModel", dtype=dtype, **kw)
    _assert_same_files(tmp_path / "mem", tmp_path / "st")
    want = {torch.bfloat16: "BF16", torch.float16: "F16"}[dtype]
    assert {v[0] for v in tensors_bytes(tmp_path / "st").values()} == {want}


def test_streamed_crmsnorm_loads_and_computes_the_same(tmp_path):
    """The streamed Pre-CRMSNorm checkpoint loads with normfold.load and computes the in-memory model's logits."""
    _both(tmp_path, "gpt2", "GPT2LMHeadModel", to="crmsnorm", fold_final=True)
    mem, st = normfold.load(tmp_path / "mem"), normfold.load(tmp_path / "st")
    ids = torch.randint(0, 50, (2, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(mem(input_ids=ids).logits, st(input_ids=ids).logits)


@pytest.mark.parametrize("kw", [{"to": "rmsnorm"}, {"to": "crmsnorm"}], ids=["rmsnorm-sharded", "crmsnorm-one-file"])
def test_pipelined_writes_record_each_files_sha256(tmp_path, monkeypatch, kw):
    """The writer thread writes every file front to back: the SHA-256 recorded while writing (issue 29) is the
    file's own, computed here with hashlib over the bytes on disk; tiny queues force the overlap's waits."""
    import hashlib

    from normfold.stream import writer as stream_writer

    monkeypatch.setattr(stream_writer, "WRITE_QUEUE_BYTES", 1024)
    _, report = _both(tmp_path, "gpt2", "GPT2LMHeadModel", **kw)
    files = weight_files(tmp_path / "st")
    assert sorted(report.weight_files) == sorted(f.name for f in files)
    for f in files:
        rec = report.weight_files[f.name]
        assert rec["sha256"] == hashlib.sha256(f.read_bytes()).hexdigest() and rec["bytes"] == f.stat().st_size


@pytest.mark.parametrize("kw", TARGETS, ids=lambda k: "-".join(f"{v}" for v in k.values()))
def test_row_chunked_tables_and_tied_heads_equal_in_memory(tmp_path, monkeypatch, kw):
    """Tiny chunks: every last-axis writer (embeddings, Conv1D) is centred, and a kept tied head's row means and
    shift computed, chunk by chunk in float64; the bytes are still the in-memory conversion's."""
    from normfold.stream import compute as stream_compute

    monkeypatch.setattr(stream_compute, "CHUNK_BYTES", 1024)
    _both(tmp_path, "gpt2", "GPT2LMHeadModel", **kw)
    _assert_same_files(tmp_path / "mem", tmp_path / "st")


@pytest.mark.parametrize("to", ["rmsnorm", "crmsnorm"])
def test_streamed_model_without_its_pooler(tmp_path, to):
    """transformers records `ViTModel(config, add_pooling_layer=False)` only in which tensors exist: the
    streamed conversion and the block-wise verifier build the model the weights imply (io.init_kwargs),
    give the in-memory bytes, and verify."""
    import transformers

    from normfold.stream.blockverify import verify_blockwise

    torch.manual_seed(0)
    cfg = transformers.ViTConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                                 image_size=32, patch_size=8)
    model = transformers.ViTModel(cfg, add_pooling_layer=False).eval()
    model.save_pretrained(tmp_path / "src")
    conv, mem_report = normfold.convert(model, to=to, verify=False)
    normfold.save(conv, mem_report, tmp_path / "mem", source_dir=tmp_path / "src")
    (tmp_path / "st").mkdir()
    stream_convert(tmp_path / "src", tmp_path / "st", to=to)
    _assert_same_files(tmp_path / "mem", tmp_path / "st")
    result = verify_blockwise(tmp_path / "src", tmp_path / "st")
    assert result["passed"], result
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        got = normfold.load(tmp_path / "st")(pixel_values=x).last_hidden_state
        want = model(pixel_values=x).last_hidden_state
    assert float((got - want).abs().max() / want.abs().max()) <= 1e-5


@pytest.mark.parametrize("kw", TARGETS[1:], ids=lambda k: "-".join(f"{v}" for v in k.values()))
def test_crmsnorm_tables_compacted_in_place_and_results_in_slabs_equal_in_memory(tmp_path, monkeypatch, kw):
    """Pre-CRMSNorm in reused memory (issue 26): with tiny slabs and chunks, every table and large writer counts as
    'large', so the d−1 table is compacted within its own read buffer in many row chunks, the tied head's means
    read chunk by chunk, and the other d−1 results land in recycled slabs; the bytes are still the in-memory
    conversion's."""
    from normfold.stream import compute as stream_compute
    from normfold.stream import safetensors_io as st

    calls = []
    compact = stream_compute.Computer._drop_last_in_place

    def counted(self, name, value, out):
        t = compact(self, name, value, out)
        calls.append((name, t is not None))
        return t

    init = st.Slabs.__init__
    monkeypatch.setattr(st.Slabs, "__init__", lambda self, budget, largest=None: init(self, budget, largest=2048))
    monkeypatch.setattr(stream_compute, "CHUNK_BYTES", 1024)
    monkeypatch.setattr(stream_compute.Computer, "_drop_last_in_place", counted)
    # GPT-2's tie now keeps the original table (compress.crmsnorm.TIE_ENTRY); without the entry the table is
    # compressed (TiedCompressedHead), the path these chunks exercise, as in every other family
    monkeypatch.setattr(importlib.import_module("normfold.compress.crmsnorm"), "TIE_ENTRY", {})
    _both(tmp_path, "gpt2", "GPT2LMHeadModel", **kw)
    _assert_same_files(tmp_path / "mem", tmp_path / "st")
    if not kw.get("pad"):
        assert ("transformer.wte.weight", True) in calls
