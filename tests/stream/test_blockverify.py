"""Block-wise verification in bounded memory (normfold.stream.blockverify).

References: the in-memory `verify.compare_models` on the same checkpoints (same inputs), the
original model itself, and a weight-liveness count taken outside the verifier's own bookkeeping."""

from __future__ import annotations

import json
import math
import shutil
import weakref

import pytest
import torch

import normfold
from helpers import realistic
from normfold import io
from normfold.adapters import get_adapter
from normfold.errors import CheckpointError, NormfoldError
from normfold.stream import blockverify
from normfold.stream.blockverify import verify_blockwise
from normfold.verify import compare_models

transformers = pytest.importorskip("transformers")
from safetensors.torch import load_file, save_file  # noqa: E402


def reshard(directory, max_bytes: int = 24_000) -> None:
    """Rewrite a single-file checkpoint as shards + index (what large checkpoints look like)."""
    for name in ("model.safetensors", "normfold_model.safetensors"):
        f = directory / name
        if not f.is_file():
            continue
        state = load_file(str(f))
        shards, cur, size = [], {}, 0
        for k in sorted(state):
            nb = state[k].numel() * state[k].element_size()
            if cur and size + nb > max_bytes:
                shards.append(cur)
                cur, size = {}, 0
            cur[k], size = state[k], size + nb
        shards.append(cur)
        stem = name[: -len(".safetensors")]
        weight_map = {}
        for i, shard in enumerate(shards, 1):
            fname = f"{stem}-{i:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, str(directory / fname), metadata={"format": "pt"})
            weight_map.update({k: fname for k in shard})
        (directory / f"{name}.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
        f.unlink()
        assert len(shards) > 1


def make(tmp_path, family: str, to: str = "rmsnorm", dtype=None, head=None, **variant_options):
    """(original dir saved sharded, converted dir, converted dir resharded, in-memory result)."""
    ex = get_adapter(family).examples[0]
    torch.manual_seed(0)
    model = realistic(ex.build(head))
    if dtype is not None:
        model = model.to(dtype)
    orig = tmp_path / "orig"
    model.save_pretrained(orig, max_shard_size="20KB")
    pad = variant_options.pop("pad", None)
    conv, report = normfold.convert(model, to=to, verify=False, pad=pad, variant_options=variant_options or None)
    out = normfold.save(conv, report, tmp_path / "conv")
    sharded = tmp_path / "conv-sharded"
    shutil.copytree(out, sharded)
    reshard(sharded)
    return orig, out, sharded


def in_memory(orig, conv):
    o, _ = io.load_source(orig)
    c = io.load(conv)
    inputs = blockverify._example_inputs(o, 0)
    centered = tuple(c.normfold_report.centered_outputs) or None
    kw = {"centered": centered} if centered else {}
    return compare_models(o, c, inputs, **kw).to_dict()


FAMILIES = [("gpt2", "GPT2LMHeadModel"), ("gpt_neox", "GPTNeoXForCausalLM"), ("opt", "OPTForCausalLM"),
            ("bloom", "BloomForCausalLM"), ("whisper", "WhisperForConditionalGeneration"),
            ("vit", "ViTForImageClassification")]


@pytest.mark.parametrize("family,head", FAMILIES)
def test_blockwise_agrees_with_in_memory(tmp_path, family, head):
    orig, conv, sharded = make(tmp_path, family, head=head)
    ref = in_memory(orig, conv)
    got = verify_blockwise(orig, sharded)
    assert ref["passed"] and got["passed"], (ref, got["blockwise"])
    # same outputs compared, errors of the same order (here: the same computation, so equal)
    assert [o["name"] for o in got["fp64"]["outputs"]] == [o["name"] for o in ref["fp64"]["outputs"]]
    for key in ("max_rel_error",):
        a, b = got["fp64"][key], ref["fp64"][key]
        assert b / 10 <= a <= b * 10, (a, b)
        a, b = got[key], ref[key]
        assert b / 10 <= a <= b * 10, (a, b)
    assert got["top1_agreement"] == ref["top1_agreement"]
    assert math.isclose(got["baseline"]["max_rel_error"], ref["baseline"]["max_rel_error"], rel_tol=0.1)
    # every block, run on the original's hidden states, matches the original's block in float64
    # (float32 stored weights: a few ulp of float32, far below the 1024-ulp tolerance)
    assert got["fp64"]["blocks"] and all(b["max_rel"] < 1e-6 for b in got["fp64"]["blocks"]), got["fp64"]["blocks"]
    assert all(h["max_rel"] < 1e-6 for h in got["fp64"]["heads"] + got["fp64"]["embeddings"])
    assert got["blockwise"]["failed_blocks"] == []


def _rewrite(directory, key: str, edit) -> None:
    """Replace tensor `key` of a saved checkpoint by `edit(tensor)`."""
    for f in directory.glob("*.safetensors"):
        state = load_file(str(f))
        if key in state:
            state[key] = edit(state[key].clone())
            save_file(state, str(f), metadata={"format": "pt"})
            return
    raise AssertionError(f"{key} not found")


def _perturb(directory, key: str, delta: float) -> None:
    def add(t):
        t.view(-1)[3] += delta
        return t

    _rewrite(directory, key, add)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_corrupted_block_fails_and_is_named(tmp_path, dtype):
    orig, conv, sharded = make(tmp_path, "gpt2", dtype=dtype, head="GPT2LMHeadModel")
    bad = "transformer.h.1" if dtype == torch.float64 else "transformer.h.0"
    _perturb(sharded, f"{bad}.mlp.c_proj.weight", 1e-3)
    got = verify_blockwise(orig, sharded)
    assert not got["passed"] and not got["fp64"]["passed"]
    assert got["blockwise"]["failed_blocks"] == [bad]
    rows = {b["name"]: b for b in got["fp64"]["blocks"]}
    assert not rows[bad]["passed"] and all(r["passed"] for n, r in rows.items() if n != bad)
    # the in-memory verification of the same corrupted weights fails too
    broken = tmp_path / "conv-bad"
    shutil.copytree(conv, broken)
    _perturb(broken, f"{bad}.mlp.c_proj.weight", 1e-3)
    assert not in_memory(orig, broken)["passed"]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16bit_tolerance_passes_a_right_conversion_and_fails_a_wrong_one(tmp_path, dtype):
    """1024 ulp of bfloat16 is 8.0 relative: a tolerance nothing fails. The stored-weights tolerance
    for 16-bit dtypes is 8 ulp, so a correct conversion passes and a wrong writer fails."""
    from normfold.verify import stored_weights_tolerance

    assert stored_weights_tolerance(dtype) < 0.1
    orig, conv, sharded = make(tmp_path, "gpt2", dtype=dtype, head="GPT2LMHeadModel")
    good = verify_blockwise(orig, sharded)
    assert good["passed"], good["fp64"]
    assert good["fp64"]["max_rel_error"] < good["fp64"]["tolerance"] == stored_weights_tolerance(dtype)
    # a writer off by a factor (what a γ folded twice would do); tiny random blocks write little into
    # the stream, so smaller mistakes (one unfolded γ: 0.019, 2.4 ulp) hide in bfloat16 rounding
    _rewrite(sharded, "transformer.h.0.mlp.c_proj.weight", lambda t: t * 3)
    bad = verify_blockwise(orig, sharded)
    assert not bad["fp64"]["passed"] and "transformer.h.0" in bad["blockwise"]["failed_blocks"], bad["fp64"]


def test_weights_held_at_once_are_one_unit(tmp_path, monkeypatch):
    """Count materialized weights from outside the verifier's ledger: every parameter tensor the
    loader creates is tracked until it is garbage (weakref), so a leak would show up here."""
    ex = get_adapter("gpt2").examples[0]
    cfg = dict(ex.kwargs, n_layer=6)
    torch.manual_seed(0)
    model = realistic(transformers.GPT2LMHeadModel(transformers.GPT2Config(**cfg)).eval())
    model.save_pretrained(tmp_path / "orig", max_shard_size="20KB")
    conv, report = normfold.convert(model, verify=False)
    normfold.save(conv, report, tmp_path / "conv")

    live = {"now": 0, "peak": 0}
    load = blockverify.Streamer.load

    def tracked(self, path):
        n = load(self, path)
        for full in self.unit_slots(path):
            module, pname, _, _ = self.slots[full]
            t = module._parameters[pname]
            nb = t.numel() * t.element_size()
            live["now"] += nb
            weakref.finalize(t, lambda nb=nb: live.__setitem__("now", live["now"] - nb))
        live["peak"] = max(live["peak"], live["now"])
        return n

    monkeypatch.setattr(blockverify.Streamer, "load", tracked)
    got = verify_blockwise(tmp_path / "orig", tmp_path / "conv")
    assert got["passed"]
    # independent sizes, from the in-memory model, in float64
    per_block = sum(p.numel() for p in model.transformer.h[0].parameters()) * 8
    wte = model.transformer.wte.weight.numel() * 8
    total = sum(p.numel() for p in model.parameters()) * 8
    largest_unit = max(per_block, wte)
    assert live["peak"] <= largest_unit, (live["peak"], largest_unit)
    assert live["peak"] >= per_block  # each block was materialized whole
    assert live["peak"] < total / 3
    assert got["blockwise"]["peak_weight_bytes"] == live["peak"]
    assert live["now"] == 0  # nothing left materialized


def test_crmsnorm_checkpoint_verifies(tmp_path):
    orig, conv, sharded = make(tmp_path, "gpt2", to="crmsnorm", head="GPT2LMHeadModel")
    ref = in_memory(orig, conv)
    got = verify_blockwise(orig, sharded)
    assert ref["passed"] and got["passed"]
    assert got["fp64"]["max_rel_error"] <= 10 * ref["fp64"]["max_rel_error"]
    assert all(b["max_rel"] < 1e-6 for b in got["fp64"]["blocks"])
    _perturb(sharded, "transformer.h.1.attn.c_proj.weight", 1e-2)
    bad = verify_blockwise(orig, sharded)
    assert not bad["passed"] and bad["blockwise"]["failed_blocks"] == ["transformer.h.1"]


def test_refusals_are_clear(tmp_path):
    orig, conv, _ = make(tmp_path, "gpt2", head="GPT2LMHeadModel")
    pickled = tmp_path / "pickled"
    shutil.copytree(orig, pickled)
    for f in list(pickled.glob("*.safetensors*")):
        f.unlink()
    torch.save({}, pickled / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match="safetensors only"):
        verify_blockwise(pickled, conv)
    # shapes that disagree with the config
    wrong = tmp_path / "wrong"
    shutil.copytree(conv, wrong)
    cfg = json.loads((wrong / "config.json").read_text())
    cfg["n_inner"] = 4 * cfg["n_embd"] + 8
    (wrong / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="shape"):
        verify_blockwise(orig, wrong)
    # NaN in the original: a clear error, not a report full of inf
    nan = tmp_path / "nan"
    shutil.copytree(orig, nan)
    _perturb(nan, "transformer.h.0.mlp.c_fc.weight", float("nan"))
    with pytest.raises(NormfoldError, match="not finite"):
        verify_blockwise(nan, conv)


def test_cli_blockwise(tmp_path, capsys):
    from normfold.cli import main

    orig, conv, sharded = make(tmp_path, "gpt2", head="GPT2LMHeadModel")
    assert main(["verify", str(orig), str(sharded), "--blockwise", "--json", "-q"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["passed"] and result["blockwise"]["blocks"] == 2
    _perturb(sharded, "transformer.h.1.mlp.c_proj.weight", 1e-2)
    assert main(["verify", str(orig), str(sharded), "--blockwise", "-q"]) == 1
    out = capsys.readouterr().out
    assert "blocks beyond tolerance: transformer.h.1" in out and "FAIL" in out


def test_cli_blockwise_progress_lines_carry_one_time_left(tmp_path, capsys, monkeypatch):
    """`normfold verify --blockwise` prints its passes with the time left of the whole verification (the
    same weighted estimate as `normfold convert`'s lines), not per-pass lines without one."""
    from normfold.cli import main
    from normfold.stream.progress import Work

    monkeypatch.setattr(Work, "MIN_SECONDS", 0.0)  # a tiny model: estimate from the first line on
    orig, conv, sharded = make(tmp_path, "gpt2", head="GPT2LMHeadModel")
    assert main(["verify", str(orig), str(sharded), "--blockwise"]) == 0
    lines = [ln for ln in capsys.readouterr().err.splitlines() if "converted in" in ln or "original in" in ln]
    assert len(lines) == 5
    assert all(" s left" in ln for ln in lines[1:]), lines  # the first pass starts before any work is done


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_checkpoint_agrees_with_in_memory(tmp_path, dtype):
    """bf16 / fp16 checkpoints: the working-dtype check runs in that dtype, like the in-memory one."""
    orig, conv, sharded = make(tmp_path, "gpt_neox", dtype=dtype, head="GPTNeoXForCausalLM")
    ref, got = in_memory(orig, conv), verify_blockwise(orig, sharded)
    assert got["dtype"] == ref["dtype"] == str(dtype).replace("torch.", "")
    assert ref["passed"] and got["passed"]
    assert math.isclose(got["max_rel_error"], ref["max_rel_error"], rel_tol=0.1)
    assert math.isclose(got["fp64"]["max_rel_error"], ref["fp64"]["max_rel_error"], rel_tol=0.1)
    assert math.isclose(got["baseline"]["max_rel_error"], ref["baseline"]["max_rel_error"], rel_tol=0.1)
    assert all(w["ok"] for w in got["working"]["blocks"])


def test_cli_chooses_blockwise_above_threshold(tmp_path, capsys, monkeypatch):
    from normfold.cli import main, verify_cmd

    orig, conv, _ = make(tmp_path, "gpt2", head="GPT2LMHeadModel")
    assert main(["verify", str(orig), str(conv), "--json", "-q"]) == 0
    assert "blockwise" not in json.loads(capsys.readouterr().out)  # small: in memory
    monkeypatch.setattr(verify_cmd, "BLOCKWISE_THRESHOLD", 1000)
    assert main(["verify", str(orig), str(conv), "--json", "-q"]) == 0
    assert "blockwise" in json.loads(capsys.readouterr().out)
    assert main(["verify", str(orig), str(conv), "--json", "-q", "--no-blockwise"]) == 0
    assert "blockwise" not in json.loads(capsys.readouterr().out)


def test_reused_buffers_and_embedding_rows_change_nothing(tmp_path, monkeypatch):
    """Issue 26: a pass refills the previous block's freed buffers (BufferPool) and reads only the looked-up rows
    of an embedding table; the result is the same dict, value for value, as with neither, and the buffers are
    really reused."""
    orig, conv, _ = make(tmp_path, "gpt2", head="GPT2LMHeadModel")
    reused = []
    take = blockverify.BufferPool.take

    def counted(self, shape, dtype):
        t = take(self, shape, dtype)
        reused.append(t is not None)
        return t

    monkeypatch.setattr(blockverify.BufferPool, "take", counted)
    fast = verify_blockwise(orig, conv)
    assert fast["passed"] and any(reused)
    monkeypatch.setattr(blockverify.BufferPool, "give", lambda self, t: None)
    from normfold.stream import passes

    monkeypatch.setattr(passes, "_lookup_rows", lambda mod, args, kwargs: None)
    plain = verify_blockwise(orig, conv)
    assert fast == plain


@pytest.mark.parametrize("kw", [{}, {"untie": True}, {"to": "crmsnorm"}],
                         ids=["tied-head", "linear-head", "crmsnorm-tied-head"])
def test_large_head_runs_in_row_chunks_in_float64(tmp_path, monkeypatch, kw):
    """A head whose matrix is larger than a block (the vocabulary × width table) runs over row chunks in every
    pass over a float32 checkpoint (float64 and float32), both the original's nn.Linear and the converted one (tied to the table, or
    untied nn.Linear, or Pre-CRMSNorm's head tied to the d−1 table): no float64 copy of the whole table, and the
    same verdict and errors (to the float64 summation blocking) as the whole-table run, against the in-memory
    verification."""
    ex = get_adapter("gpt2").examples[0]
    torch.manual_seed(0)
    model = realistic(transformers.GPT2LMHeadModel(transformers.GPT2Config(**dict(ex.kwargs, vocab_size=3001))).eval())
    model.save_pretrained(tmp_path / "orig", max_shard_size="40KB")
    conv, report = normfold.convert(model, verify=False, **kw)
    normfold.save(conv, report, tmp_path / "conv")
    from normfold.stream.streamer import Streamer

    calls, run_rows = [], Streamer.run_rows

    def small_chunks(self, path, slot, forward, args, kwargs, chunk_bytes=1 << 24):
        calls.append((path, self.dtype))
        return run_rows(self, path, slot, forward, args, kwargs, chunk_bytes=24 * 8 * 200)  # 200 rows

    monkeypatch.setattr(Streamer, "run_rows", small_chunks)
    chunked = verify_blockwise(tmp_path / "orig", tmp_path / "conv")
    assert {p for p, _ in calls} == {"lm_head"} and {d for _, d in calls} == {torch.float64, torch.float32}
    # the three float64 passes (original, converted, converted heads only: 16 chunks each) and the two float32
    # ones (the stored table, larger than a float32 block, read in chunks too)
    assert [d for _, d in calls].count(torch.float64) == 3 and len(calls) == 5
    monkeypatch.setattr(Streamer, "row_chunked", lambda self, path, module: None)
    whole = verify_blockwise(tmp_path / "orig", tmp_path / "conv")
    ref = in_memory(tmp_path / "orig", tmp_path / "conv")
    assert chunked["passed"] and whole["passed"] and ref["passed"]
    assert chunked["top1_agreement"] == whole["top1_agreement"] == ref["top1_agreement"]
    assert chunked["blockwise"]["peak_weight_bytes"] < whole["blockwise"]["peak_weight_bytes"]
    for a, b in zip(chunked["fp64"]["outputs"], whole["fp64"]["outputs"]):
        assert a["name"] == b["name"] and abs(a["max_rel"] - b["max_rel"]) <= 1e-13, (a, b)
    assert chunked["working"] == whole["working"]  # each output column its own dot product: the same bits here


def test_one_thread_passes_and_comparisons_give_the_same_numbers(tmp_path, monkeypatch, capsys):
    """NORMFOLD_VERIFY_THREADS=1 (the passes) and the one-thread comparisons change no reported number and
    still name a corrupted block; torch's thread setting is restored; NORMFOLD_VERIFY_TIMES prints each pass."""
    orig, conv, sharded = make(tmp_path, "gpt2", head="GPT2LMHeadModel")
    threads = torch.get_num_threads()
    default = verify_blockwise(orig, sharded)
    monkeypatch.setenv("NORMFOLD_VERIFY_THREADS", "1")
    monkeypatch.setenv("NORMFOLD_VERIFY_TIMES", "1")
    one = verify_blockwise(orig, sharded)
    assert torch.get_num_threads() == threads
    assert one == default and one["passed"]
    err = capsys.readouterr().err
    assert err.count("verify pass") == 6 and "comparisons" in err
    _perturb(sharded, "transformer.h.1.mlp.c_proj.weight", 1e-3)
    bad = verify_blockwise(orig, sharded)
    assert not bad["passed"] and bad["blockwise"]["failed_blocks"] == ["transformer.h.1"]
    monkeypatch.setenv("NORMFOLD_VERIFY_THREADS", "two")
    with pytest.raises(NormfoldError, match="NORMFOLD_VERIFY_THREADS"):
        verify_blockwise(orig, sharded)


@pytest.mark.parametrize("family,head", [("gpt2", "GPT2LMHeadModel"), ("whisper", "WhisperForConditionalGeneration")])
def test_progress_counts_every_unit_of_every_pass(tmp_path, family, head):
    """The command's time-left estimate (stream.progress): each pass's planned elements are exactly those its
    units free, so the verification's share ends at 1 and each pass line is printed with its estimate."""
    from normfold.stream.progress import PassProgress, Reporter, Work

    orig, conv, sharded = make(tmp_path, family, head=head)
    work = Work({"verify": 1.0})
    seen = []
    real_done = PassProgress.done

    def done(self, elements):
        real_done(self, elements)
        seen.append((self.k, self.seen, self.total))

    PassProgress.done = done
    try:
        lines = []
        got = verify_blockwise(orig, sharded, progress=Reporter(lines.append, work))
    finally:
        PassProgress.done = real_done
    assert got["passed"]
    assert abs(work.done() - 1.0) < 1e-12
    ends = {}
    for k, s, total in seen:
        ends[k] = (s, total)
    assert sorted(ends) == [0, 1, 2, 3, 4] and all(s == total for s, total in ends.values())
    assert len(lines) >= 5
