"""Pre-LN → Pre-CRMSNorm (`to="crmsnorm"`, paper 001 §3.2): the Pre-RMSNorm conversion, then compression.

Per residual stream of the adapter's plan (all algebra float64, each tensor rounded once):

1. the Pre-RMSNorm conversion (`convert.apply_rmsnorm`): writers centred, affines folded, LN → RMSNorm;
2. the compression point: where the stream is born zero-mean. Normally that is its writers; where
   it starts with an explicit Recenter (BLOOM's and mBART's embedding norm, CLIP's pre_layrnorm,
   Whisper's / SigLIP 2's non-linear stem) the Recenter becomes a recentre-and-compress op and the
   writers and the norm before it stay d-wide;
3. writers after the point: drop the last output coordinate (`algebra.compress_writer`);
4. norms after the point become `StreamCRMSNorm`: with no affine left (folded into readers) the
   output stays compressed and each reader gets W ← W[:d−1] − W[d−1], last input dropped
   (`algebra.compress_reader`); a norm that keeps γ/β (final norms: their output is a model output;
   norms whose readers have no bias to take β) returns the decompressed d-wide γ⊙n + β and its
   readers are unchanged;
5. tied parameters: where the family's entry is known (`TIE_ENTRY`: per stream, the first block or the
   embedding norm; unpadded), a tied table stays the original d-wide tensor shared with the stock head
   and every other embedding holding it (an encoder-decoder's encoder and decoder): the embedding
   writers (the table and what is summed with it) leave the writers and each stream is recentred and
   compressed on its entry's input (`keep_ties_compressed`; d-wide Recenter only where the entry is a
   norm ahead of the compression point, mBART's layernorm_embedding); the final norm returns the d-wide
   γ⊙n + β, so the logits are the original GEMM. Elsewhere (--pad) the rmsnorm step untied every edited
   tensor (centring wte unties it from lm_head) and `retie_heads` ties the head to the compressed table
   (`TiedCompressedHead`).

Padded mode (`variant_options={"pad": True}`, `--pad`): shapes stay d; the dropped coordinate is
zero instead (writers' last output row and bias entry, readers' last input column).
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
import re

import torch
from torch import nn

from .. import algebra
from ..adapters import ConversionPlan, NormSite, StreamPlan
from ..adapters.base import base_prefix, get, join, parent_and_leaf
from ..errors import NormfoldError, UnsupportedConversionError, UnsupportedModelError
from ..nn import RMSNorm
from .runtime import (
    StreamCRMSNorm,
    add_input_compress,
    add_input_narrow,
    add_output_compress,
    add_output_widen,
    set_param,
)

_BLOCK = re.compile(r"\.\d+(\.|$)")
OPTIONS = ("pad",)

# Families whose forward reshapes the final norm's output to the stream width it measured on the
# embeddings (`output_shape = ... + (hidden_states.size(-1),)` after the embedding dropout, then
# `ln_f(x).view(output_shape)`). For them the compressed embedding sum is decompressed at the
# output of that dropout (so the measured width is d) and compressed again on the way into the
# first block: two O(d) ops per token, tables still compressed. Paths relative to the base model.
WIDTH_AT_EMBEDDINGS: dict[str, tuple[str, str]] = {
    "gpt2": ("drop", "h.0"),
    "gpt_bigcode": ("drop", "h.0"),
    "gpt_neo": ("drop", "h.0"),
    "gptj": ("drop", "h.0"),
}


# Where the summed embeddings of a stream holding a tied table enter what reads them (path relative to the base
# model), per adapter: a tied table is kept there in the original (`keep_ties_compressed`). A plain path is the
# entry of the family's one token stream; a dict maps stream names to entries (an encoder-decoder's shared table
# feeds the encoder's and the decoder's embeddings: each stream gets its own entry). The entry is the first
# block (decoder-only Pre-LN models, the Whisper decoder) or the embedding norm (BART / mBART's
# layernorm_embedding, the BERT family's embeddings.LayerNorm: Post-LN models whose stream the embedding norm
# ends, and mBART, where that norm is ahead of the compression point and its input gets a d-wide Recenter).
# A family enters once its tests do (tests/test_ties_crms.py); the others keep the TiedCompressedHead form.
_EMBED_NORM = "embeddings.LayerNorm"
_SEQ2SEQ = {"encoder": "encoder.layernorm_embedding", "decoder": "decoder.layernorm_embedding"}
TIE_ENTRY: dict[str, str | dict[str, str]] = {
    "gpt2": "h.0", "gpt_neo": "h.0", "gpt_bigcode": "h.0", "falcon": "h.0", "opt": "decoder.layers.0",
    "gpt_neox": "layers.0", "phi": "layers.0", "whisper": {"decoder": "decoder.layers.0"},
    "bart": _SEQ2SEQ, "mbart": _SEQ2SEQ,
    "bert": _EMBED_NORM, "roberta": _EMBED_NORM, "distilbert": _EMBED_NORM, "electra": _EMBED_NORM}


def tie_entry(adapter: str, stream: str) -> str | None:
    """The entry of stream `stream` of family `adapter` (relative to the base model), or None."""
    entry = TIE_ENTRY.get(adapter)
    return entry.get(stream) if isinstance(entry, dict) else entry


_BLOCK_LIST = re.compile(r"^(.*?)\.(\d+)(\.|$)")


def derived_tie_entries(plan: ConversionPlan, stream: StreamPlan) -> tuple[list[str] | None, str]:
    """(entries, why not) of a stream of a plan derived from the analysis (`plan.adapter == "analysis"`, no
    TIE_ENTRY): read from the plan, in the order the analysis lists the stream's writers and norms, i.e. the
    analysis' own finding of which writers each foldable norm's input sums. Full paths. Two shapes qualify:

    * one Pre-LN block list: every writer outside a block (the summed embeddings) comes before the first block
      writer, every block writer and every non-final norm lies in one block list (`<prefix>.<i>`) and the first
      norm sits in the first block: the entry is that block (GPT-2, OPT, GPT-NeoX, Phi, the Whisper decoder,
      MPT ...);
    * embedding norms only (Post-LN models, whose block norms the analysis keeps): no writer in a block, every
      norm of the stream is outside the blocks (each then gets the recentre-and-compress op on its own input,
      RMSNorm(Recenter(x)) = LN(x) whatever the writers), and each embedding writer lies under exactly one
      norm's parent module: the entries are those norms (BART's encoder and decoder layernorm_embedding, BERT's
      embeddings.LayerNorm).

    Then the summed embeddings reach nothing but the entry's input before a norm (the analysis centred them for
    these norms only), which is where `keep_ties_compressed` recentres and compresses. A plan with a Recenter,
    or any other shape, gives None and `why` (the caller keeps the untied form)."""
    if any(st.recenter_after or st.recenter_before for st in plan.streams):
        return None, "the plan has an explicit Recenter"
    writers = list(stream.writers)
    first = next((i for i, w in enumerate(writers) if _BLOCK.search(w)), None)
    inner = [n.path for n in stream.norms if not n.final]
    if first is None:
        outside = [n.path for n in stream.norms if not _BLOCK.search(n.path)]  # final: they keep γ/β
        if not outside or len(outside) != len(stream.norms):
            return None, "the stream has no block writer and norms other than embedding norms"
        owners = {w: [n for n in outside if w.startswith(n.rpartition(".")[0] + ".")] for w in writers}
        if any(len(o) != 1 for o in owners.values()) or any(n not in {o[0] for o in owners.values()}
                                                              for n in outside):
            return None, "its embedding writers do not sit one-to-one under its embedding norms' modules"
        return outside, ""
    if any(not _BLOCK.search(w) for w in writers[first:]):
        return None, "a writer outside the blocks comes after the first block (more than one token stream)"
    lists = {_BLOCK_LIST.match(w).group(1) for w in writers[first:]}
    lists |= {_BLOCK_LIST.match(n).group(1) if _BLOCK_LIST.match(n) else n for n in inner}
    if len(lists) != 1:
        return None, f"its writers and norms span {len(lists)} block lists or stand outside the blocks " \
                     f"({', '.join(sorted(lists))})"
    m = _BLOCK_LIST.match(writers[first])
    entry = f"{m.group(1)}.{m.group(2)}"
    if not inner or not inner[0].startswith(entry + "."):
        return None, f"its first norm is not in its first block {entry}"
    return [entry], ""


def keep_ties_compressed(model: nn.Module, plan: ConversionPlan, options, moved: list[str]) -> ConversionPlan:
    """crmsnorm's `Variant.keep_ties` (see `convert.recentre_tied_tables`): each stream holding a tied table
    `moved` is compressed where its summed embeddings enter what reads them (a recentre-and-compress op on the
    entry's input: `recenter_before`, which `compress` turns into `compress_before`), so the embedding tables
    summed before it stay d-wide and as they are: the tied table is the original tensor shared with the stock
    head, and the position table is not edited either (the op recentres the sum; an embedding scale such as
    BART's embed_scale acts before it). Where the entry is a norm ahead of the stream's compression point
    (mBART's layernorm_embedding, compressed on its output), the op on its input is a d-wide Recenter instead.
    Padded mode, or a family or stream without a known entry, keeps the plan (the TiedCompressedHead form, or
    the untied one)."""
    from ..report import TIE_NOTE

    opts = options.target_options() if hasattr(options, "target_options") else dict(options.variant_options or {})
    derived = plan.adapter == "analysis"
    if opts.get("pad") or (plan.adapter not in TIE_ENTRY and not derived):
        return plan
    holding = [st for st in plan.streams if any(t in st.writers for t in moved)]
    entries = {}
    for st in holding:
        if derived:
            entry, why = derived_tie_entries(plan, st)
            if entry is None:
                plan = copy.copy(plan)
                plan.notes = list(plan.notes) + [
                    f"tie not kept by --to crmsnorm ({', '.join(moved)}): no entry point for the summed embeddings "
                    f"could be read from the derived plan: {why}; the table is centred and compressed "
                    "as any writer (the head tied to the compressed table, untied, or refused, as without an entry)"]
                return plan
            entries[st.name] = entry
        else:
            entry = tie_entry(plan.adapter, st.name)
            if entry is None:
                return plan  # a stream without a known entry: the tie cannot be kept in every stream it feeds
            entries[st.name] = [join(base_prefix(model), entry)]
    streams, done, compressed, recentred = [], [], [], []
    for st in plan.streams:
        if st not in holding:
            streams.append(st)
            continue
        embeds = [w for w in st.writers if not _BLOCK.search(w)]  # summed before the entry
        streams.append(dataclasses.replace(st, writers=[w for w in st.writers if w not in embeds],
                                           recenter_before=list(st.recenter_before) + entries[st.name]))
        for entry in entries[st.name]:
            (recentred if entry in st.recenter_after else compressed).append(entry)
        done += [t for t in moved if t in st.writers]
    plan = copy.copy(plan)
    plan.streams = streams
    # the adapter's notes that assumed centred tables (post_ln: "... is tied to ...; centring it unties them",
    # inputs_embeds as rows of the centred table) no longer hold: the tables are not edited, the op recentres
    plan.notes = [n for n in plan.notes if not any(n.startswith(f"{t} is tied to ") for t in done)
                  and not n.startswith("tied parameters untied so the writers can be centred")
                  and not n.startswith("inputs_embeds passed by the caller must be rows of the (centred)")]
    where = []
    if compressed:
        where.append(f"the stream is recentred and compressed to d−1 on the input of {', '.join(compressed)}")
    if recentred:
        where.append(f"the input of {', '.join(recentred)} (a norm ahead of the compression point, compressed on "
                     "its output) is recentred d-wide")
    plan.notes = list(plan.notes) + [
        f"{TIE_NOTE}: the table stays the original (uncentred, d-wide) tensor shared with the stock head and "
        f"every embedding tied to it ({', '.join(done)}); {'; '.join(where)}, after the summed embeddings, so the "
        "embedding tables are not edited, and the final norm returns the d-wide output: the logits are the original "
        "GEMM, no correction term, no extra parameter"]
    return plan


def _stream_width(model: nn.Module, stream: StreamPlan) -> int:
    for site in stream.norms:
        norm = get(model, site.path)
        if isinstance(norm, RMSNorm):
            return int(norm.normalized_shape[0])
    raise UnsupportedConversionError(f"stream {stream.name!r} has no converted norm to compress around")


def _pre_point(stream: StreamPlan) -> tuple[set[str], set[str]]:
    """Writers and norms that act before the stream's compression point (they stay d-wide)."""
    if not stream.recenter_after:
        return set(), set()
    writers: set[str] = set()
    for w in stream.writers:
        if _BLOCK.search(w):
            break
        writers.add(w)
    return writers, set(stream.recenter_after)


def _writer_params(model: nn.Module, path: str) -> list[tuple[str, int]]:
    """(parameter name, axis of the stream coordinate) of a writer (module or parameter)."""
    obj = get(model, path)
    if isinstance(obj, nn.Parameter):
        return [(path, -1)]
    lay = algebra.layout_of(obj)
    if lay is None:
        raise UnsupportedConversionError(f"stream writer {path} is a {type(obj).__name__}, which normfold cannot "
                                         "compress (register its layout with normfold.algebra.register_layout)")
    out = [(f"{path}.{lay.weight}", lay.out_dim)]
    if lay.bias and getattr(obj, lay.bias, None) is not None:
        out.append((f"{path}.{lay.bias}", -1))
    return out


def _drop_or_zero(t: torch.Tensor, dim: int, pad: bool) -> torch.Tensor:
    t = t.detach().movedim(dim, -1)
    if pad:
        t = torch.cat([t[..., :-1], torch.zeros_like(t[..., -1:])], dim=-1)
    else:
        t = t[..., :-1]
    t = t.movedim(-1, dim)
    # as .contiguous(), the copy's memory from algebra.result_buffer (recycled inside a streamed conversion)
    if t.is_contiguous() or t.device.type != "cpu":  # (meta: the structure pass)
        return t.contiguous()
    return algebra.result_buffer(t.shape, t.dtype).copy_(t)


def compress_writer(model: nn.Module, path: str, pad: bool, record: dict | None = None) -> int:
    n = 0
    for name, dim in _writer_params(model, path):
        set_param(model, name, _drop_or_zero(get(model, name), dim, pad))
        if record is not None:
            record[name] = dim
        n += 1
    return n


def compress_reader(model: nn.Module, path: str, pad: bool, record: dict | None = None) -> None:
    module = get(model, path)
    lay = algebra.layout_of(module)
    w = getattr(module, lay.weight)
    new = algebra.compress_reader(w, lay.in_dim)  # float64 inside, rounded once
    if pad:
        new = algebra.decompress_reader(new, lay.in_dim)  # zero last input column
    set_param(model, f"{path}.{lay.weight}", new)
    if record is not None:
        record[f"{path}.{lay.weight}"] = lay.in_dim


def _compressed_output(site: NormSite, norm: RMSNorm, model: nn.Module, writers: set[str]) -> bool:
    """May this norm hand its readers the compressed n' (no affine on it, linear readers)?"""
    if site.final or norm.weight is not None:
        return False
    if norm.bias is not None and f"{site.path}.bias" not in writers:
        return False
    return all(algebra.is_linear_reader(get(model, r)) for r in site.readers)


def compress(model: nn.Module, plan: ConversionPlan, report, pad: bool = False) -> dict:
    """Compress every stream of an already Pre-RMSNorm `model` in place; returns the structure's
    `compression` record (what normfold.load replays) and updates the norm records."""
    structure = report.structure
    records = {r.name: r for r in structure.norms}
    shapes_before = {n: tuple(p.shape) for n, p in model.named_parameters()}
    streams, after, before = [], [], []
    writer_params: dict[str, int] = {}
    reader_params: dict[str, int] = {}
    edited = 0
    for stream in plan.streams:
        d = _stream_width(model, stream)
        pre_writers, pre_norms = _pre_point(stream)
        writers = [w for w in stream.writers if w not in pre_writers]
        writer_set = set(writers)
        for w in writers:
            edited += compress_writer(model, w, pad, writer_params)
        n_compressed = n_decompressed = 0
        for site in stream.norms:
            if site.path in pre_norms:
                continue
            norm = get(model, site.path)
            if not isinstance(norm, RMSNorm):
                raise UnsupportedConversionError(f"{site.path} is a {type(norm).__name__} after the Pre-RMSNorm step")
            squeeze = _compressed_output(site, norm, model, writer_set)
            ref = next(norm.parameters(), None)
            with torch.device(ref.device if ref is not None else "cpu"):  # meta in the streamed structure pass
                new = StreamCRMSNorm(d, eps=norm.eps, weight=norm.weight is not None, bias=norm.bias is not None,
                                     decompress=not squeeze, pad=pad, dtype=ref.dtype if ref is not None else None)
            with torch.no_grad():
                if norm.weight is not None:
                    new.weight.copy_(norm.weight)
                if norm.bias is not None:
                    new.bias.copy_(norm.bias)  # already compressed/zeroed when it is a stream writer
            parent, leaf = parent_and_leaf(model, site.path)
            setattr(parent, leaf, new)
            rec = records.get(site.path)
            if rec is not None:
                rec.type = "StreamCRMSNorm"
                rec.options = {"width": d, "decompress": not squeeze, "pad": pad}
            if squeeze:
                for r in site.readers:
                    compress_reader(model, r, pad, reader_params)
                    edited += 1
                n_compressed += 1
            else:
                n_decompressed += 1
        for path in stream.recenter_after:
            add_output_compress(get(model, path), pad)
            after.append(path)
        for path in stream.recenter_before:
            if path in pre_norms:
                continue  # a norm ahead of the compression point: its input Recenter stays d-wide (mBART's kept tie)
            add_input_compress(get(model, path), pad)
            before.append(path)
        streams.append({"name": stream.name, "width_before": d, "width_after": d if pad else d - 1,
                        "writers_compressed": len(writers), "norms_compressed_output": n_compressed,
                        "norms_decompressed_output": n_decompressed,
                        "compression_point": (stream.recenter_after or [p for p in stream.recenter_before
                                                                        if p not in pre_norms] or ["writers"])[0]})
    widen, narrow = [], []
    spec = WIDTH_AT_EMBEDDINGS.get(plan.adapter)
    # a stream compressed on the entry block's input (a kept tie) is d-wide at the embeddings already
    if spec is not None and not pad and join(base_prefix(model), spec[1]) not in before:
        base = base_prefix(model)
        widen.append(join(base, spec[0]))
        narrow.append(join(base, spec[1]))
        add_output_widen(get(model, widen[0]))
        add_input_narrow(get(model, narrow[0]))
    structure.recenter_after = [p for p in structure.recenter_after if p not in after]
    structure.recenter_before = [p for p in structure.recenter_before if p not in before]
    shapes = {n: list(p.shape) for n, p in model.named_parameters() if shapes_before.get(n) != tuple(p.shape)}
    report.tensors_edited += edited
    return {"pad": pad, "streams": streams, "shapes": shapes, "compress_after": after, "compress_before": before,
            "widen_after": widen, "narrow_before": narrow, "writer_params": writer_params,
            "reader_params": reader_params}


def apply_crmsnorm(model: nn.Module, plan: ConversionPlan, options, report) -> None:
    """The `crmsnorm` variant: Pre-LN → Pre-RMSNorm → Pre-CRMSNorm, in place."""
    from ..conversion import apply_rmsnorm

    opts = options.target_options() if hasattr(options, "target_options") else dict(options.variant_options or {})
    unknown = sorted(set(opts) - set(OPTIONS))
    if unknown:
        raise UnsupportedConversionError(f"--to crmsnorm takes the option(s) {', '.join(OPTIONS)}; "
                                         f"got {', '.join(unknown)}")
    pad = bool(opts.get("pad", False))
    on_stream = [site.path for st in plan.streams for site in st.norms
                 if not site.readers and not site.final and _BLOCK.search(site.path)]
    if plan.kept and on_stream:
        raise UnsupportedConversionError(
            f"{plan.adapter}: this configuration has Post-LN block norms whose output is the residual stream "
            f"({on_stream[0]}, ...) next to LayerNorms that stay LayerNorms ({plan.kept[0].path}); the stream they "
            "build is not a sum of compressible writers, so it cannot be compressed. Use --to rmsnorm.")
    aliases = _aliases(model)
    # a tied table kept the original where the family allows (idempotent: convert and stream rewrote it already;
    # the float64 re-conversion of the verification passes the adapter's own plan)
    from ..conversion import recentre_tied_tables

    rewritten = recentre_tied_tables(model, plan, options)
    if rewritten is not plan:
        report.notes += [n for n in rewritten.notes if n not in report.notes]
    plan = rewritten
    # untied first (the d-wide head reads the decompressed final norm); retie_heads re-ties what it can
    apply_rmsnorm(model, plan, dataclasses.replace(options, untie=True), report)
    report.structure.compression = compress(model, plan, report, pad=pad)
    report.structure.compression["tied_heads"] = retie_heads(model, plan, aliases, report.structure.compression)
    report.stock_reloadable = False
    width = ", ".join(f"{s['name']} {s['width_before']} → {s['width_after']}" for s in report.structure.compression["streams"])
    report.notes.append(
        f"Pre-CRMSNorm{' (zero-padded: shapes stay d, the last stream coordinate is held at 0)' if pad else ''}: "
        f"stream width {width}; the checkpoint loads with normfold.load only (its stream is narrower than "
        "config.hidden_size, or padded, which stock LayerNorms cannot read)")
    _probe(model, pad)
    model.normfold_report = report


def _aliases(model: nn.Module) -> dict[str, tuple[int, torch.Tensor]]:
    """name -> (id of the shared parameter, its original values) for every tied parameter."""
    by_id: dict[int, list[str]] = {}
    params = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(p), []).append(name)
        params[id(p)] = p
    return {n: (i, params[i].detach().clone()) for i, names in by_id.items() if len(names) > 1 for n in names}


def retie_heads(model: nn.Module, plan: ConversionPlan, aliases: dict, compression: dict) -> list[dict]:
    """Express a tied head exactly on the compressed table instead of keeping an untied d-wide copy.

    The Pre-RMSNorm step untied the head (centring the table changed the table, not the head). When
    the head still holds the original table (its final norm's affine was not folded into it) and
    that table is a compressed writer of the same stream, the head becomes a TiedCompressedHead:
    the vocab×d copy is replaced by the vocabulary's row means (vocab numbers)."""
    from .runtime import TiedCompressedHead

    from ..conversion import values_of

    values = values_of(plan)  # on a meta model (normfold.stream) the checkpoint answers
    pad = bool(compression.get("pad"))
    shaped = set(compression.get("shapes", {}))
    ties = []
    for stream in plan.streams:
        tables = {}
        for w in stream.writers:
            obj = get(model, w)
            if isinstance(obj, nn.Embedding) and (f"{w}.weight" in shaped or pad) and f"{w}.weight" in aliases:
                tables[aliases[f"{w}.weight"][0]] = w
        for site in stream.norms:
            if not site.final:
                continue
            for r in site.readers:
                head = get(model, r)
                name = f"{r}.weight"
                if not isinstance(head, nn.Linear) or name not in aliases or aliases[name][0] not in tables:
                    continue
                original = aliases[name][1]
                if not values.head_unchanged(name, head.weight.detach(), original):
                    continue  # the final norm's affine was folded into it: a different matrix now
                table = get(model, tables[aliases[name][0]])
                mean = tied_head_mean(original)
                new = TiedCompressedHead(table, mean, head.bias, pad=pad)
                parent, leaf = parent_and_leaf(model, r)
                setattr(parent, leaf, new)
                ties.append({"head": r, "table": tables[aliases[name][0]], "bias": head.bias is not None})
    return ties


def compressed_value(name: str, value: torch.Tensor, compression: dict) -> torch.Tensor:
    """What `compress` makes of parameter `name` of the Pre-RMSNorm model holding `value` (a writer loses or
    zeroes its last stream coordinate, a reader of a compressed norm output gets W[:d-1] - W[d-1]): the same
    operations in the same order, so the streamed conversion writes the same bytes. Others unchanged."""
    pad = bool(compression.get("pad"))
    dim = compression.get("writer_params", {}).get(name)
    if dim is not None:
        value = _drop_or_zero(value, dim, pad)
    in_dim = compression.get("reader_params", {}).get(name)
    if in_dim is not None:
        value = algebra.compress_reader(value, in_dim)
        if pad:
            value = algebra.decompress_reader(value, in_dim)
    return value


def tied_head_mean(original: torch.Tensor) -> torch.Tensor:
    """A TiedCompressedHead's `mean`: the original table's row means, in float64, rounded once."""
    return original.double().mean(dim=-1).to(original.dtype)


def _probe(model: nn.Module, pad: bool) -> None:
    """Run the compressed model once: HF code that reads the stream width itself (a LayerNorm kept
    on the stream of a Post-LN block, an accumulator shaped like another tensor) fails here, and
    the user gets an UnsupportedConversionError instead of a model that cannot run."""
    from ..adapters import find_adapter

    if any(p.is_meta for p in model.parameters()):
        return  # the streamed conversion's structure pass: shapes only (its output is verified after writing)
    kept: list[str] = []
    handles = []
    for name, m in model.named_modules():
        if isinstance(m, nn.LayerNorm):
            def seen(mod, args, name=name):
                x = args[0] if args and isinstance(args[0], torch.Tensor) else None
                if x is not None and x.shape[-1] + 1 == mod.normalized_shape[-1]:
                    kept.append(name)
            handles.append(m.register_forward_pre_hook(seen))
    try:
        try:
            inputs = find_adapter(model).example_inputs(model, torch.Generator().manual_seed(0))
        except UnsupportedModelError:  # a plan derived by the analysis: inputs from the config
            from ..analysis.autoplan import modality_inputs

            try:
                inputs = modality_inputs(model)
            except NormfoldError:
                return  # nothing to probe with; the verification runs the model anyway
        dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
        inputs = {k: (v.to(dtype) if isinstance(v, torch.Tensor) and v.is_floating_point() else v)
                  for k, v in inputs.items()}
        # no KV cache: the probe checks stream shapes only, and some HF heads cannot even build their
        # cache (MBartForCausalLM sizes it by encoder_layers, so encoder_layers < decoder_layers fails)
        if "use_cache" in inspect.signature(model.forward).parameters:
            inputs["use_cache"] = False
        was = model.training
        model.eval()
        with torch.no_grad():
            model(**inputs)
        model.train(was)
    except RuntimeError as exc:
        msg = str(exc).strip().splitlines()[0][:300]
        hint = "" if pad else " Try the zero-padded form (--pad / variant_options={'pad': True}), which keeps every shape."
        if kept:
            _refuse_kept(model, kept)
        raise UnsupportedConversionError(
            f"{type(model).__name__} cannot run on the compressed (d−1)-wide stream: {msg}. Some module of this "
            f"configuration reads the stream width itself.{hint}") from exc
    finally:
        for h in handles:
            h.remove()
    if kept:
        _refuse_kept(model, kept)


def _refuse_kept(model: nn.Module, kept: list[str]) -> None:
    names = ", ".join(sorted(set(kept))[:3])
    raise UnsupportedConversionError(
        f"{type(model).__name__}: LayerNorm(s) kept by the Pre-RMSNorm plan read the residual stream directly "
        f"({names}); a LayerNorm needs all d coordinates and a non-zero-mean input, so this stream cannot be "
        "compressed. Convert with --to rmsnorm instead.")
