"""Verification in bounded memory: `normfold.verify`'s checks, run block by block.

The in-memory check (`verify.compare_models`) holds the original, the converted model and float64
copies of both. Here neither model is ever materialized: both are built with their parameters on the
meta device (the converted one with normfold's recorded structure replayed), and a unit's weights —
one transformer block, or one module outside the block stacks (embeddings, final norm, head) — are
read from the memory-mapped safetensors just before the unit runs and dropped right after it.

Passes (each reads every weight once, holding one unit at a time):

1. original, float64: captures every block's stream input and output, and the exact model outputs;
2. converted, float64: runs end to end (the report's `fp64.outputs`) and, inside each block's
   hook, runs that block once more on the ORIGINAL's stream input mapped to the converted stream
   (the original's centred part with the converted model's own per-token mean; the first d−1
   coordinates for a Pre-CRMSNorm stream): `fp64.blocks`, so a wrong block is named even when
   later blocks would hide or spread its error;
3. converted, float64, with every block replaced by the original's (mapped) output: the part after
   the last block (final norm, heads) checked on its own: `fp64.heads`;
4. and 5. original and converted in their own dtype: end to end (`working`, `baseline`, as in the
   in-memory check) and per block on the float64 stream inputs (`working.blocks`, informative).

Same tolerances as `verify.compare_models`; the result dict has its keys plus `fp64.blocks`,
`fp64.embeddings`, `fp64.heads`, `working.blocks` and `blockwise` (what was held in memory).

The parts: `reader` (tensors from safetensors files), `skeleton` (models without weights, their units and
checkpoint names), `streamer` (a unit's weights loaded and dropped), `memory` (ledger, buffer pool), `passes`
(the hooks of one forward, the stream mapping); this module runs the passes and compares.
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from ..errors import CheckpointError, NormfoldError
from ..verify import (CENTERED_OUTPUTS, ULP_FLOOR, WORKING_FACTOR, TensorDiff, dtype_eps, worst_of, describe_inputs, FinalNorms,
                      diff_outputs, explain_failures, run_model, stored_weights_tolerance, top1_agreement, skip_names,
                      skipped_outputs)
from .memory import BufferPool, Ledger
from .passes import Pass, block_diff, stream_in, to_stream
from .progress import PassProgress
from .reader import CheckpointReader
from .readahead import enabled as readahead_enabled
from .skeleton import build_skeleton, checkpoint_keys, find_units
from .streamer import Streamer

# the parts, re-exported under their old names here
__all__ = ["verify_blockwise", "CheckpointReader", "Streamer", "BufferPool", "Ledger", "build_skeleton",
           "checkpoint_keys", "find_units", "to_stream"]



FP64 = torch.float64



def verify_blockwise(original_dir: str | os.PathLike, converted_dir: str | os.PathLike, *, inputs: dict | None = None,
                     seed: int = 0, centered=None, progress: Callable[[str], None] | None = None,
                     fp64_tol: float | None = None, skip=(), same_basis: bool = False, fold_final: bool = False,
                     direct_reads: bool = False, readahead: bool | None = None) -> dict:
    """`normfold verify ORIGINAL CONVERTED`'s checks in bounded memory; returns the same dict as
    `verify.compare_models(...).to_dict()` plus per-block results (see the module docstring).

    `original_dir` / `converted_dir`: local model directories with safetensors weights (one file or
    an index); the converted one may carry `normfold.json`, whose structure is replayed. `inputs`:
    forward kwargs (default: the adapter's example inputs for `seed`). `progress(message)` is called
    as each pass starts. `fp64_tol` defaults to compare_models' (`verify.stored_weights_tolerance` of
    the stored dtype). `skip`: outputs left out of every comparison, as in `verify.diff_outputs` (the final
    norm's output, by name). `fold_final`: CONVERTED was made with `--fold-final`: the outputs equal to a folded
    final norm's (γ in the heads, `verify.FinalNorms.folded`) are found by value and skipped, the rest compared. A
    rotated CONVERTED needs none: the final-norm outputs lacking γ/β are found by value and skipped, the exact
    ones compared (`verify.FinalNorms`), and the result lists what was skipped and why under "skipped".
    `same_basis`: ORIGINAL's stream is already in CONVERTED's rotated basis (a rotated checkpoint's streamed way
    back, checked with the roles swapped: its weights keep the rotation), so a recorded rotation maps nothing.
    `direct_reads`: CONVERTED's weights read past the page cache (O_DIRECT; a streamed conversion's output, which
    its writer wrote that way, is not cached: see safetensors_io.read_into).
    `readahead`: while a block computes, the next block's stored tensors are read on a background thread
    (`stream.readahead`; the same bytes, so the same result); default NORMFOLD_VERIFY_READAHEAD (on unless 0)."""
    original_dir, converted_dir = Path(original_dir), Path(converted_dir)
    for d in (original_dir, converted_dir):
        if not d.is_dir() or not (d / "config.json").is_file():
            raise CheckpointError(f"{d} is not a local model directory with config.json: block-wise verification "
                                  "reads local safetensors checkpoints. Download the model to a directory first, "
                                  "or verify in memory (`normfold verify --no-blockwise`).")
    # a normfold checkpoint: path policy, report schema, and its structure against config.json and the
    # weights' headers, all before anything is built (as normfold.load checks it)
    report = _report_of(converted_dir)
    if centered is None:
        centered = tuple(report.centered_outputs) if report is not None and report.centered_outputs else CENTERED_OUTPUTS
    timer = _PassTimer(progress, getattr(progress, "work", None))
    say = timer.say

    rotation, unrotate = ({}, None) if same_basis else _rotation(report, centered)
    raw_in = frozenset() if same_basis else _raw_input_blocks(report)
    # rotated: a final norm's output lacking γ/β (in the heads) is skipped, a head-less final norm's (γ/β kept,
    # un-rotated by its x·Qᵀ hook) compared unmapped, decided per pass by value as in memory (verify.FinalNorms)
    # --fold-final (not rotated): the folded final norms' outputs, found by value the same way (FinalNorms.folded)
    final_norms = (FinalNorms.of(report.structure) if rotation
                   else FinalNorms.folded(report.structure) if fold_final and report is not None else None)
    skip = tuple(skip)
    lacking_seen: set[str] = set()
    o_read, c_read = CheckpointReader(original_dir), CheckpointReader(converted_dir, direct=direct_reads)
    # ORIGINAL may be a normfold checkpoint too (a reverse conversion's output checked with the roles swapped: added
    # biases, heads tied to centred tables): its structure is replayed as well
    o_report = _report_of(original_dir)
    orig = build_skeleton(original_dir, o_report.structure if o_report is not None else None, names=set(o_read.files))
    conv = build_skeleton(converted_dir, report.structure if report is not None else None, names=set(c_read.files))
    if type(orig).__name__ != type(conv).__name__:
        raise NormfoldError(f"ORIGINAL is a {type(orig).__name__} but CONVERTED is a {type(conv).__name__}")
    o_dtype, c_dtype = o_read.dtype(), c_read.dtype()
    ledger = Ledger()
    ahead = readahead_enabled(readahead)
    o_s, c_s = Streamer(orig, o_read, o_dtype, ledger, ahead), Streamer(conv, c_read, c_dtype, ledger, ahead)
    if inputs is None:
        inputs = _example_inputs(orig, seed)
    o_units, c_units = find_units(orig), find_units(conv)
    blocks = o_units[0]
    if c_units[0] != blocks:
        raise CheckpointError(f"{converted_dir} has block stacks {c_units[0][:3]}... but {original_dir} has "
                              f"{blocks[:3]}...: not a conversion of it")
    tol = fp64_tol if fp64_tol is not None else stored_weights_tolerance(c_dtype)

    threads = _pass_threads()

    track = PassProgress(getattr(progress, "work", None), progress)  # the command's time-left estimate

    def run(streamer, units, dtype, **kw):
        streamer.set_dtype(dtype, pool_units=units[0])
        track.start(timer.step, _pass_elements(streamer, units, replaced=kw.get("replace") is not None))
        streamer.on_free = track.done
        if streamer is c_s:
            kw["rotation"], kw["raw_in"] = rotation, raw_in
        hooks = final_norms if streamer is c_s and final_norms is not None else FinalNorms()
        try:
            with _threads(threads), Pass(streamer, *units, **kw) as p, hooks.hooked(streamer.model) as seen:
                out = run_model(streamer.model, inputs)
        finally:
            streamer.on_free = None
        lacking, unmapped = hooks.classify(out, seen)
        lacking_seen.update(lacking)
        if streamer is c_s and unrotate is not None:  # stream outputs back in the original basis
            out = {k: v if k in unmapped else unrotate(k, v) for k, v in out.items()}
        return p, out, skip + skip_names(lacking)

    say("original in float64")
    p_o64, exact, _ = run(o_s, o_units, FP64, capture=True)
    bad = [k for k, v in exact.items() if not bool(torch.isfinite(v).all())]
    if bad:
        raise NormfoldError(
            f"{original_dir}: the original model's outputs {bad[:3]} are not finite in float64 when run block "
            "by block. Either its weights hold NaN/Inf, or its code reads a weight outside the module that "
            "owns it (weights are loaded per module, and an unloaded weight reads as NaN). Check the "
            "weights, or verify in memory: `normfold verify ORIGINAL CONVERTED --no-blockwise`.")
    ref = p_o64.captured
    say("converted in float64, block by block on the original's hidden states")
    p_c64, out_c64, skip_c64 = run(c_s, c_units, FP64, forced=ref, map_center=True)
    say("converted in float64, heads on the original's last hidden states")
    _, out_tail, skip_tail = run(c_s, c_units, FP64, replace=ref, replace_like=p_c64.free_out, map_center=True)
    say(f"original in {_dt(o_dtype)}")
    p_ow, orig_w, _ = run(o_s, o_units, o_dtype, forced=ref, map_center=False)
    say(f"converted in {_dt(c_dtype)}")
    p_cw, conv_w, skip_w = run(c_s, c_units, c_dtype, forced=ref, map_center=True)
    timer.say("comparisons", quiet=True)
    with _threads(1):
        fp64, failed = _fp64_section(ref, p_c64, out_c64, out_tail, exact, blocks, tol, centered, skip_c64,
                                     rotation, raw_in, skip_tail)
        floor = tol if c_dtype == FP64 else ULP_FLOOR * dtype_eps(c_dtype)
        base = {d.name: d for d in diff_outputs(orig_w, exact, skip_w, centered)}
        rows, working_ok = [], True
        for d in diff_outputs(conv_w, exact, skip_w, centered):
            b_rel = base[d.name].max_rel if d.name in base else 0.0
            ok = d.max_rel <= WORKING_FACTOR * b_rel + floor
            working_ok &= ok
            rows.append({"name": d.name, "converted_rel_error": d.max_rel, "original_rel_error": b_rel, "ok": ok})
        if c_dtype != FP64:
            working_ok = explain_failures(rows, conv_w, exact, c_dtype)
        wblocks = _working_blocks(ref, p_ow, p_cw, floor, rotation)
        direct = diff_outputs(conv_w, orig_w, skip_w, centered)
        worst_direct = worst_of(direct)
        sizes = {"original": _sizes(o_s, o_units), "converted": _sizes(c_s, c_units)}
    timer.done()
    return {
        "passed": bool(working_ok and fp64["passed"]),
        "dtype": _dt(c_dtype),
        "max_abs_error": worst_direct["max_abs_error"], "max_rel_error": worst_direct["max_rel_error"],
        "top1_agreement": top1_agreement(conv_w, orig_w),
        "fp64": fp64,
        "working": {"passed": working_ok, "rule": f"err(converted) <= {WORKING_FACTOR:g} * err(original) + "
                    f"{ULP_FLOOR:g} ulp, errors against the original in float64", "outputs": rows,
                    "blocks": wblocks},
        "baseline": {**worst_of(list(base.values())), "what": "original in its dtype vs itself in float64"},
        "inputs": describe_inputs(inputs),
        "skipped": skipped_outputs(exact, skip_w, lacking_seen),
        "blockwise": {"blocks": len(blocks), "failed_blocks": failed,
                      "peak_weight_bytes": ledger.peak, "loads": ledger.loads,
                      "original_dtype": _dt(o_dtype), **sizes},
    }



@contextlib.contextmanager
def _threads(n: int):
    """torch's intra-op threads set to `n` inside. The comparisons run on one thread: their tensors are
    activations (2 × 16 tokens × width, or × vocabulary for logits), where a second OpenMP thread saves
    little on an idle machine and, on a shared one, makes every operation wait for a descheduled thread
    (measured: 11.3 s instead of 0.1 s for the comparisons of a d = 1600, 11-layer GPT-2 under load 3.5 on 2
    vCPUs). Elementwise operations, max and the per-row means give the same bits on one thread (checked
    on every number of the result)."""
    before = torch.get_num_threads()
    if n == before:
        yield
        return
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)



def _pass_threads() -> int:
    """torch's intra-op threads for the five passes: NORMFOLD_VERIFY_THREADS if set (a positive integer),
    else torch's current setting. On a machine whose cores are shared with other work, 1 avoids OpenMP
    threads waiting for each other (docs/large-checkpoints.md, "Verification: per-pass cost")."""
    raw = os.environ.get("NORMFOLD_VERIFY_THREADS", "").strip()
    if not raw:
        return torch.get_num_threads()
    if not raw.isdigit() or int(raw) < 1:
        raise NormfoldError(f"NORMFOLD_VERIFY_THREADS={raw!r}: expected a positive integer")
    return int(raw)



class _PassTimer:
    """The progress callback, and with NORMFOLD_VERIFY_TIMES=1 in the environment each step's wall and
    CPU seconds on stderr (one line per pass, `verify pass <seconds> s wall, <seconds> s CPU: <pass>`)."""

    def __init__(self, progress, work=None) -> None:
        self.progress, self.work = progress, work
        self.on = os.environ.get("NORMFOLD_VERIFY_TIMES", "") not in ("", "0")
        self.step, self.t0, self.c0 = None, 0.0, 0.0

    def say(self, msg: str, quiet: bool = False) -> None:
        self.done()
        self.step, self.t0, self.c0 = msg, time.perf_counter(), time.process_time()
        if self.progress is not None and not quiet:
            self.progress(msg + (self.work.suffix() if self.work is not None else ""))

    def done(self) -> None:
        if self.on and self.step is not None:
            print(f"verify pass {time.perf_counter() - self.t0:6.2f} s wall, {time.process_time() - self.c0:6.2f} s "
                  f"CPU: {self.step}", file=sys.stderr, flush=True)
        self.step = None



def _report_of(model_dir: Path):
    """The normfold report of `model_dir` (path policy, schema and structure checked against config.json and the
    weights' headers, as normfold.load checks it), or None for a stock checkpoint."""
    from ..io import REPORT_FILE, inspect_converted

    return inspect_converted(model_dir)[0] if os.path.lexists(model_dir / REPORT_FILE) else None



def _rotation(report, centered) -> tuple[dict, Callable | None]:
    """({width: Q}, output map back to the original basis) of a rotated CONVERTED (normfold.rotate), else ({}, None).

    Explicit rotations (structure.rotation["explicit"], replayed on the skeleton as normfold.load replays them)
    need no mapping of their own: a stem's output ·Q (BLOOM, CLIP vision, mBART) is already the rotated stream the
    blocks read, and a final norm's input ·Qᵀ lies after the blocks. A first block whose own input is rotated by
    such a hook (Whisper's encoder) reads the original basis: `_raw_input_blocks`. Online Hadamard ops
    (structure.rotation["online"], replayed too) act inside a block, on its MLP down-projection's input: a block's
    stream input and output are unchanged by them, so they need no mapping either."""
    rot = report.structure.rotation if report is not None else None
    if not rot:
        return {}, None
    from ..rotate import rotation_of, unrotate_outputs

    return rotation_of(rot), unrotate_outputs(rot, centered)


def _raw_input_blocks(report) -> frozenset:
    """Blocks whose stream input is rotated by their own explicit pre-hook (x ← x·Q, the first block of a stream
    whose stem ends in a non-linearity: Whisper's encoder): the input they receive is in the original basis, so
    the original's stream is mapped onto it without Q (the hook applies Q inside the block's call)."""
    rot = report.structure.rotation if report is not None else None
    return frozenset(e["path"] for e in (rot or {}).get("explicit", [])
                     if e.get("where") == "input" and not e.get("transpose"))



def _fp64_section(ref, p_c64, out_c64, out_tail, exact, blocks, tol, centered, skip=(),
                  rotation=None, raw_in=frozenset(), skip_tail=None) -> tuple[dict, list[str]]:
    """float64: end to end, per block (on the original's inputs), the stream entering each stack
    (embeddings) and the outputs computed from the original's last hidden states (heads)."""
    d64 = diff_outputs(out_c64, exact, skip, centered)
    block_rows, failed = [], []
    for b, k in _block_names(p_c64.forced_out):
        r, out = p_c64.forced_out[b][k]
        name = _name(b, k, len(ref[b]))
        d = block_diff(name, out, r.out, rotation) if r is not None else TensorDiff(name, math.inf, math.inf, 0.0)
        block_rows.append({**asdict(d), "passed": d.max_rel <= tol})
        if d.max_rel > tol:
            failed.append(name)
    # a block the converted model did not call as often as the original did
    failed += [b for b in blocks if len(p_c64.forced_out[b]) < len(ref[b]) and b not in failed]
    emb_rows = []
    for b in _stack_heads(blocks):
        if ref[b] and p_c64.free_in[b]:
            d = block_diff(f"stream into {b}", p_c64.free_in[b][0], stream_in(ref[b][0].args, ref[b][0].kwargs),
                           None if b in raw_in else rotation)
            emb_rows.append({**asdict(d), "passed": d.max_rel <= tol})
    head_rows = [{**asdict(d), "passed": d.max_rel <= tol}
                 for d in diff_outputs(out_tail, exact, skip if skip_tail is None else skip_tail, centered)
                 if "hidden_states" not in d.name]
    worst = worst_of(d64)
    ok = worst["max_rel_error"] <= tol and not failed and all(r["passed"] for r in emb_rows + head_rows)
    return ({**worst, "tolerance": tol, "passed": ok, "outputs": [asdict(d) for d in d64],
             "blocks": block_rows, "embeddings": emb_rows, "heads": head_rows}, failed)



def _working_blocks(ref, p_ow, p_cw, floor, rotation=None) -> list[dict]:
    """Per block in the working dtype, both models on the float64 reference inputs (informative)."""
    rows = []
    for b, k in _block_names(p_cw.forced_out):
        r, out = p_cw.forced_out[b][k]
        o_calls = p_ow.forced_out.get(b, [])
        if r is None or k >= len(o_calls) or o_calls[k][0] is None:
            continue
        name = _name(b, k, len(ref[b]))
        c_rel = block_diff(name, out, r.out, rotation).max_rel
        o_rel = block_diff(name, o_calls[k][1], r.out).max_rel
        rows.append({"name": name, "converted_rel_error": c_rel, "original_rel_error": o_rel,
                     "ok": c_rel <= WORKING_FACTOR * o_rel + floor})
    return rows



def _pass_elements(streamer: Streamer, units, replaced: bool) -> int:
    """Elements a pass loads (its progress): every unit once, the blocks unless replaced, the resident
    modules' own parameters."""
    blocks, others, resident = units
    n = sum(streamer.elements(u) for u in ([] if replaced else list(blocks)) + list(others))
    for path in resident:
        m = streamer.model.get_submodule(path) if path else streamer.model
        n += sum(streamer.elements(f"{path}.{k}" if path else k) for k, v in m._parameters.items() if v is not None)
    return n



def _sizes(streamer: Streamer, units) -> dict:
    streamer.set_dtype(FP64)
    per = [streamer.nbytes(u) for u in units[0] + units[1]]
    return {"largest_unit_bytes_fp64": max(per, default=0), "total_bytes_fp64": streamer.nbytes("")}



def _stack_heads(blocks: list[str]) -> list[str]:
    """The first block of each stack ('h.0', 'encoder.layers.0', 'decoder.layers.0')."""
    seen, out = set(), []
    for b in blocks:
        stack = b.rpartition(".")[0]
        if stack not in seen:
            seen.add(stack)
            out.append(b)
    return out



def _dt(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")



def _example_inputs(model: nn.Module, seed: int) -> dict:
    from ..adapters import example_inputs

    return example_inputs(model, torch.Generator().manual_seed(seed), seq=16)



def _block_names(d: dict[str, list]) -> list[tuple[str, int]]:
    return [(b, k) for b, calls in d.items() for k in range(len(calls))]



def _name(block: str, k: int, n: int) -> str:
    return block if n == 1 else f"{block} (call {k})"
