"""Read-ahead in block-wise verification (normfold.stream.readahead, issue 26 "disk speed"): the next block's
stored tensors read on a background thread while the current block computes.

References: the same verification with read-ahead off (the whole result dict, value for value), the in-memory
check's verdict, and the exception a failing read raises without read-ahead."""

from __future__ import annotations

import errno
import threading

import pytest
import torch

from normfold.errors import CheckpointError, NormfoldError
from normfold.stream import readahead, safetensors_io
from normfold.stream.blockverify import verify_blockwise
from normfold.stream.reader import CheckpointReader
from test_blockverify import _perturb, in_memory, make

pytest.importorskip("transformers")


def _threads_left() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("normfold-readahead")]


@pytest.mark.parametrize("family,head,dtype,to", [
    ("gpt2", "GPT2LMHeadModel", None, "rmsnorm"),
    ("gpt2", "GPT2LMHeadModel", torch.bfloat16, "rmsnorm"),
    ("gpt_neox", "GPTNeoXForCausalLM", torch.bfloat16, "rmsnorm"),
    ("opt", "OPTForCausalLM", None, "crmsnorm"),
    ("whisper", "WhisperForConditionalGeneration", None, "rmsnorm"),  # two stacks: no read-ahead across them
], ids=["gpt2-f32", "gpt2-bf16", "neox-bf16", "opt-crmsnorm-f32", "whisper-f32"])
def test_readahead_changes_no_number(tmp_path, monkeypatch, family, head, dtype, to):
    orig, conv, sharded = make(tmp_path, family, to=to, dtype=dtype, head=head)
    readers = []  # (thread name) of every tensor read
    get = CheckpointReader.get

    def recorded(self, name, out=None):
        readers.append(threading.current_thread().name)
        return get(self, name, out=out)

    monkeypatch.setattr(CheckpointReader, "get", recorded)
    taken, take = [], readahead.ReadAhead.take

    def counted(self, path):
        got = take(self, path)
        taken.append(got is not None)
        return got

    monkeypatch.setattr(readahead.ReadAhead, "take", counted)
    on = verify_blockwise(orig, sharded, readahead=True)
    on_threads, readers[:] = list(readers), []
    used = sum(taken)
    off = verify_blockwise(orig, sharded, readahead=False)
    assert on == off  # every number, every verdict, the ledger's peak and load count
    assert on["passed"] and in_memory(orig, conv)["passed"] == on["passed"]
    # really read ahead, on the background thread, in every pass that loads the blocks (4 of 5), once per block
    # after each stack's first
    stacks = {b.rpartition(".")[0] for b in (x["name"] for x in on["fp64"]["blocks"])}
    assert used == 4 * (on["blockwise"]["blocks"] - len(stacks)) > 0
    assert any(n.startswith("normfold-readahead") for n in on_threads)
    assert not any(n.startswith("normfold-readahead") for n in readers)
    assert _threads_left() == []


def test_readahead_still_names_a_wrong_block(tmp_path):
    orig, conv, sharded = make(tmp_path, "gpt2", head="GPT2LMHeadModel")
    _perturb(sharded, "transformer.h.1.mlp.c_proj.weight", 1e-3)
    on, off = verify_blockwise(orig, sharded, readahead=True), verify_blockwise(orig, sharded, readahead=False)
    assert on == off and not on["passed"] and on["blockwise"]["failed_blocks"] == ["transformer.h.1"]


@pytest.mark.parametrize("dtype", [None, torch.bfloat16])
def test_a_read_failing_on_the_readahead_thread_raises_as_without_it(tmp_path, monkeypatch, dtype):
    """An I/O error reading a block's tensor on the background thread surfaces as the CheckpointError a read on
    the main thread raises (same message), when that block is loaded, and no read-ahead thread is left."""
    orig, conv, sharded = make(tmp_path, "gpt2", dtype=dtype, head="GPT2LMHeadModel")
    key = "transformer.h.1.mlp.c_fc.weight"
    entry = CheckpointReader(sharded)._info(key)
    failed_on = _fail_read_at(monkeypatch, entry.file, entry.start)
    errors = _errors_on_and_off(orig, sharded)
    assert errors[True] == errors[False] and "Input/output error" in errors[True] and entry.file.name in errors[True]
    assert failed_on[0] == "MainThread" and failed_on[1].startswith("normfold-readahead"), failed_on


def _large_head(tmp_path, monkeypatch, dtype=None):
    """A GPT-2 whose tied head (3001 × width) is larger than a block: it runs over row chunks in every pass, here
    200 rows each (15 chunks: the last one 201 rows), so its chunks are read ahead too."""
    import normfold
    import transformers
    from helpers import realistic
    from normfold.adapters import get_adapter
    from normfold.stream.streamer import Streamer

    ex = get_adapter("gpt2").examples[0]
    torch.manual_seed(0)
    model = realistic(transformers.GPT2LMHeadModel(transformers.GPT2Config(**dict(ex.kwargs, vocab_size=3001))).eval())
    if dtype is not None:
        model = model.to(dtype)
    model.save_pretrained(tmp_path / "orig", max_shard_size="40KB")
    conv, report = normfold.convert(model, verify=False)
    normfold.save(conv, report, tmp_path / "conv")
    run_rows = Streamer.run_rows

    def small_chunks(self, path, slot, forward, args, kwargs, chunk_bytes=1 << 24):
        return run_rows(self, path, slot, forward, args, kwargs,
                        chunk_bytes=self.reader.info(self.keymap["transformer.wte.weight"])[0][1]
                        * torch.tensor([], dtype=self.dtype).element_size() * 200)

    monkeypatch.setattr(Streamer, "run_rows", small_chunks)
    return tmp_path / "orig", tmp_path / "conv"


@pytest.mark.parametrize("dtype", [None, torch.bfloat16])
def test_head_row_chunks_read_ahead_change_no_number(tmp_path, monkeypatch, dtype):
    orig, conv = _large_head(tmp_path, monkeypatch, dtype)
    chunks, rows_reader = [], readahead._Rows._read

    def counted(self, a, b, out):
        chunks.append((a, b, threading.current_thread().name))
        return rows_reader(self, a, b, out)

    monkeypatch.setattr(readahead._Rows, "_read", counted)
    on = verify_blockwise(orig, conv, readahead=True)
    assert len(chunks) == 5 * 15 and all(n.startswith("normfold-readahead") for *_, n in chunks)
    assert sorted({(a, b) for a, b, _ in chunks})[-1][1] == 3001
    off = verify_blockwise(orig, conv, readahead=False)
    assert on == off and on["passed"]
    assert _threads_left() == []


def test_a_head_chunk_failing_on_the_readahead_thread_raises_as_without_it(tmp_path, monkeypatch):
    orig, conv = _large_head(tmp_path, monkeypatch)
    entry = CheckpointReader(conv)._info("transformer.wte.weight")
    row = entry.nbytes // 3001
    failed_on = _fail_read_at(monkeypatch, entry.file, entry.start + 1000 * row)  # the 6th chunk (rows 1000..1199)
    errors = _errors_on_and_off(orig, conv)
    assert errors[True] == errors[False] and "Input/output error" in errors[True]
    assert failed_on[0] == "MainThread" and failed_on[1].startswith("normfold-readahead"), failed_on


def test_switch(tmp_path, monkeypatch):
    orig, _, sharded = make(tmp_path, "gpt2", head="GPT2LMHeadModel")
    started = []
    start = readahead.ReadAhead.start
    monkeypatch.setattr(readahead.ReadAhead, "start", lambda self, *a: started.append(a[0]) or start(self, *a))
    monkeypatch.setenv("NORMFOLD_VERIFY_READAHEAD", "0")
    off = verify_blockwise(orig, sharded)
    assert started == []
    monkeypatch.delenv("NORMFOLD_VERIFY_READAHEAD")
    assert verify_blockwise(orig, sharded) == off and started
    monkeypatch.setenv("NORMFOLD_VERIFY_READAHEAD", "yes")
    with pytest.raises(NormfoldError, match="NORMFOLD_VERIFY_READAHEAD"):
        verify_blockwise(orig, sharded)


def _fail_read_at(monkeypatch, file, start) -> list[str]:
    """Make the read of `file` at byte `start` fail with EIO; returns the names of the threads it failed on."""
    failed_on = []
    read_into = safetensors_io.read_into

    def failing(path, at, out, direct=False):
        if path == file and at == start:
            failed_on.append(threading.current_thread().name)
            raise OSError(errno.EIO, "Input/output error")
        return read_into(path, at, out, direct=direct)

    monkeypatch.setattr(safetensors_io, "read_into", failing)
    return failed_on


def _errors_on_and_off(orig, conv) -> dict[bool, str]:
    """verify_blockwise's CheckpointError message with read-ahead off and on; no thread left after either."""
    errors = {}
    for on in (False, True):
        with pytest.raises(CheckpointError) as exc:
            verify_blockwise(orig, conv, readahead=on)
        errors[on] = str(exc.value)
        assert _threads_left() == []
    return errors
