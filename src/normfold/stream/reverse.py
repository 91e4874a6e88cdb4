"""Streamed reverse conversion: a Pre-RMSNorm (or Pre-CRMSNorm) checkpoint written by normfold
(normfold.json) back to the stock Pre-LN model (`to="layernorm"`), or a Pre-CRMSNorm one to Pre-RMSNorm
(`to="rmsnorm"`: decompress only), tensor by tensor, with the same bytes as `normfold.load` +
`normfold.convert(model, to=...)` + `normfold.save`.

Why it streams: `compress.reverse.to_layernorm` changes no tensor but two kinds, each computable on its own:

- every RMSNorm becomes a LayerNorm holding the same γ / β (a byte copy), or ones / zeros where the affine
  was folded away (a fill);
- a head kept tied to the centred table (nn.TiedHead, no folded γ, no added bias) is tied again: the table
  becomes E' + μ1ᵀ, computed in float64 and rounded once (elementwise, so row chunks give the same bytes);
  one holding a folded γ or an added bias is untied as `TiedHead.untied_linear` computes it, (E' + μ1ᵀ)·diag γ
  in float64 over row chunks, rounded once (its bias copied; the table stays E').

Every other tensor is copied file to file; Recenters have no tensors. The structure (output names, dtypes,
shapes, which tensor is which) comes from `to_layernorm` itself run on the converted model built on the meta
device, so the names and their order are those of the in-memory result.

A Pre-CRMSNorm source (`--to layernorm`) goes through `compress.reverse.decompress` first, on the meta model too;
its tensors are per tensor as well: a writer's d−1 outputs get their last one back as −Σ of the others
(`restore_last`, float64, rounded once; row chunks where the axis is the last), a reader gets a zero input column
(not when padded), a tied compressed head becomes the untied (restored table + row means), all as decompress
computes them.

`to="rmsnorm"` from Pre-CRMSNorm runs `decompress` alone on the meta model: the same per-tensor values, and the
output tensors are `io.export_state_dict`'s (`plan.output_tensors`: folded-away affines as ones / zeros where the
result is stock-reloadable). A model rotated through its weights (`--rotate`) comes back as in memory:
`to_layernorm` keeps the rotated basis (no Qᵀ; the stream is zero-mean in it), so its weights are byte copies.

Not streamed (StreamUnsupportedError; convert in memory): any other target or option from a normfold checkpoint
(a Pre-RMSNorm one `--to rmsnorm` / `--to crmsnorm`), and a stream rotated with explicit / online ops (which the
in-memory reverse conversions refuse too).
"""

from __future__ import annotations

import copy
import os
import time
from pathlib import Path

import torch
from torch import nn

from .. import algebra, checkpoint, io
from ..adapters import find_adapter
from ..adapters.base import get
from ..compress.reverse import decompress, note_reverse, restore_last, reverse_report, to_layernorm
from ..compress.runtime import StreamCRMSNorm, TiedCompressedHead
from ..errors import NonFiniteWeightsError, NormfoldError
from ..nn import RMSNorm, TiedHead
from ..report import ConversionReport
from . import safetensors_io as st
from .compute import CHUNK_BYTES, row_chunks
from .plan import OutTensor, output_tensors, shard_files
from .source import Source, StreamUnsupportedError, checkpoint_dtype
from .writer import write_streamed

REVERSE_TARGETS = ("layernorm", "rmsnorm")


def is_normfold_checkpoint(source_dir) -> bool:
    return (Path(source_dir) / io.REPORT_FILE).is_file()


def _open(path: Path, stock: bool) -> Source:
    directory = checkpoint.ModelDir(path)
    if stock:
        found = checkpoint.weight_files(directory, io.STOCK_INDEX, io.STOCK_WEIGHTS)
    else:
        found = checkpoint.weight_files(directory, io.NORMFOLD_INDEX, io.NORMFOLD_WEIGHTS)
    if found is None:
        raise StreamUnsupportedError(f"{path} has no safetensors weights; convert it in memory (--stream never)")
    shards, sharded = found
    tensors: dict[str, st.TensorInfo] = {}
    for shard in shards:
        infos, _ = st.read_header(shard)
        tensors.update(infos)
    return Source(path, shards, tensors, sharded)


class _Tables:
    """The `derived` outputs of a streamed reverse: each restored tied table E' + μ1ᵀ, and each head untied as
    (E' + μ1ᵀ)·diag γ (`nn.TiedHead.untied_linear`), float64, rounded once, in row chunks (elementwise: the
    bytes of one whole-table pass). Duck-types the forward Computer for `writer.write_checkpoint` (no
    components). `tables`: output name -> (table, row means, γ or None), stored names."""

    def __init__(self, source: Source, tables: dict[str, tuple[str, str, str | None]],
                 specs: dict[str, tuple] | None = None):
        self.source = source
        self.specs = dict(specs or {})  # output name -> (kind, source names..., args): Pre-CRMSNorm decompression
        self.head_means = {**tables, **self.specs}  # every output computed here (the writer asks by membership)

    def _read(self, name: str) -> torch.Tensor:
        t = st.read_tensor(self.source.tensors[name])
        if t.is_floating_point() and not st.all_finite(t):
            raise NonFiniteWeightsError(f"tensor {name} of {self.source.path} has NaN/inf values; no conversion "
                                        "of it can be exact. Fix or re-download the checkpoint.")
        return t

    def derived(self, name: str) -> torch.Tensor:
        if name in self.specs:
            return self._decompressed(*self.specs[name])
        table_name, mean_name, scale_name = self.head_means[name]
        mean = self._read(mean_name)
        scale = self._read(scale_name).double()[None, :] if scale_name is not None else None
        info = self.source.tensors[table_name]
        # one table-sized buffer: the stored table is read into it and each row chunk replaced by its result
        out = torch.empty(tuple(info.shape), dtype=st.TORCH_DTYPES[info.dtype])
        st.read_into(info.file, info.start, out)
        for a, b in row_chunks(out.shape[0], CHUNK_BYTES // 8 // max(1, out.shape[1])):
            rows = out[a:b]
            if rows.is_floating_point() and not st.all_finite(rows):
                raise NonFiniteWeightsError(f"tensor {table_name} of {self.source.path} has NaN/inf values; no "
                                            "conversion of it can be exact. Fix or re-download the checkpoint.")
            full = rows.double() + mean[a:b].double()[:, None]
            if scale is not None:  # untied_linear's order: (E' + μ1ᵀ), then ·diag γ
                full = full * scale
            rows.copy_(full.to(out.dtype))
        return out

    def _decompressed(self, kind: str, src: str, arg, pad: bool = False, mean_src: str | None = None) -> torch.Tensor:
        """`decompress`'s value of one tensor: a writer's restored last output, a reader's zero input column, a
        tied compressed head's (restored table + row means). Row chunks where the restored axis is the last
        (each row's sum is its own; no single-row chunk), so float64 stays chunk-sized."""
        t = self._read(src)
        if kind == "reader":
            return algebra.decompress_reader(t, arg)
        mean = self._read(mean_src) if kind == "head" else None
        dim = arg if arg >= 0 else t.dim() + arg
        if t.dim() < 2 or dim != t.dim() - 1:
            return restore_last(t, dim, pad)
        flat = t.reshape(-1, t.shape[-1])
        width = flat.shape[1] - (1 if pad else 0) + 1
        out = torch.empty(flat.shape[0], width, dtype=t.dtype)
        for a, b in row_chunks(flat.shape[0], CHUNK_BYTES // 8 // max(1, width)):
            rows = restore_last(flat[a:b], 1, pad)
            if mean is not None:
                rows = (rows.double() + mean[a:b].double()[:, None]).to(t.dtype)
            out[a:b] = rows
        return out.reshape(*t.shape[:-1], width)


def _meta_converted(report, config, cls, kwargs, dtype) -> nn.Module:
    from ..io import apply_structure

    with torch.device("meta"), io.default_dtype(dtype):
        model = cls(config, **kwargs)
        model = model.to(dtype)
        if hasattr(model, "tie_weights"):
            model.tie_weights()
        apply_structure(model, report.structure)
    model.config.dtype = dtype
    return model.eval()


def prepare_reverse(source_dir: str | os.PathLike, to: str = "layernorm"):
    """Every check `stream_reverse` makes before it reads a weight (no output needed): raises
    StreamUnsupportedError for what streams only in memory. Returns what `inspect_converted_kwargs` read and
    the weights' headers (a Source)."""
    path = Path(source_dir)
    if to not in REVERSE_TARGETS:
        raise StreamUnsupportedError(f"streaming converts a normfold checkpoint --to layernorm (or a Pre-CRMSNorm "
                                     f"one --to rmsnorm) only; --to {to} from it needs the in-memory conversion "
                                     "(--stream never, or normfold.convert)")
    if not is_normfold_checkpoint(path):
        raise StreamUnsupportedError(f"{path} has no {io.REPORT_FILE}: --to {to} converts a normfold "
                                     "checkpoint back")
    src_report, config, cls, stock, kwargs = io.inspect_converted_kwargs(path)
    structure = src_report.structure
    crms = src_report.variant == "crmsnorm" and bool(structure.compression)
    if not crms and (src_report.variant != "rmsnorm" or structure.compression):
        raise StreamUnsupportedError(
            f"streaming converts a Pre-RMSNorm or Pre-CRMSNorm checkpoint back to LayerNorm; this one is "
            f"{src_report.variant}: convert it in memory (--stream never, or normfold.load + normfold.convert)")
    if to == "rmsnorm" and not crms:
        raise StreamUnsupportedError(f"{path} already is a Pre-RMSNorm checkpoint: --to rmsnorm streams the way "
                                     "back from Pre-CRMSNorm only; convert it in memory (--stream never) to be "
                                     "told what it can become")
    if structure.rotation and (structure.rotation.get("explicit") or structure.rotation.get("online")):
        raise StreamUnsupportedError(
            "this checkpoint's stream is rotated with explicit / online rotation ops (normfold.json "
            "structure.rotation), which the reverse conversions do not carry over: convert the original LayerNorm "
            "model instead (in memory, --stream never, says so too)")
    return src_report, config, cls, stock, kwargs, _open(path, stock)


def stream_reverse(source_dir: str | os.PathLike, out_dir: str | os.PathLike, *, to: str = "layernorm",
                   progress=None) -> ConversionReport:
    """A Pre-RMSNorm or Pre-CRMSNorm checkpoint written by normfold, streamed back in `out_dir` (an existing
    empty directory): `to="layernorm"` the stock Pre-LN model, `to="rmsnorm"` (Pre-CRMSNorm only) the
    decompressed Pre-RMSNorm normfold checkpoint; the same tensors as the in-memory reverse conversion.
    Verification is not run here (the report says so; the CLI runs `normfold.cli.convert_stream.verify_reverse`)."""
    say = progress or (lambda msg: None)
    t0 = time.perf_counter()
    path = Path(source_dir)
    out = Path(out_dir)
    if not out.is_dir() or any(out.iterdir()):
        raise NormfoldError(f"{out} must be an existing empty directory")
    src_report, config, cls, stock, kwargs, source = prepare_reverse(path, to)
    structure = src_report.structure
    dtype = checkpoint_dtype(source)

    model = _meta_converted(src_report, config, cls, kwargs, dtype)
    adapter = find_adapter(model)
    # every tensor of the converted model: its stored name (tied aliases: whichever is stored)
    state = model.state_dict(keep_vars=True)
    stored: dict[int, str] = {}
    for name, t in state.items():
        if name in source.tensors:
            stored.setdefault(id(t), name)
    by_name = {name: stored[id(t)] for name, t in state.items() if id(t) in stored}
    norm_src: dict[str, str] = {}  # LayerNorm output name -> the RMSNorm tensor it copies
    for name, m in model.named_modules():
        if type(m) is RMSNorm:
            for leaf in ("weight", "bias"):
                p = getattr(m, leaf, None)
                if p is not None:
                    norm_src[f"{name}.{leaf}"] = stored[id(p)]
    # nn.TiedHead (untie_heads): retied (the table gets its row means back: E' + μ1ᵀ) where it holds no folded γ
    # and no added bias, else untied: the head becomes (E' + μ1ᵀ)·diag γ (+ its bias, a copy), the table stays E'
    restored: dict[int, tuple[str, str, None]] = {}  # table parameter id -> (table, mean, None), stored names
    untied: dict[str, tuple[str, str, str | None]] = {}  # untied head weight -> (table, mean, γ or None)
    for name, m in model.named_modules():
        if not isinstance(m, TiedHead):
            continue
        table, mean = stored[id(m._table.weight)], stored[id(m.mean)]
        if m.scale is None and name not in structure.added_bias:
            restored[id(m._table.weight)] = (table, mean, None)
        else:
            untied[f"{name}.weight"] = (table, mean, None if m.scale is None else stored[id(m.scale)])
            if m.bias is not None:
                by_name[f"{name}.bias"] = stored[id(m.bias)]  # untied_linear copies it into a new Linear
    comp = structure.compression
    specs: dict[str, tuple] = {}  # Pre-CRMSNorm: output name -> how decompress computes it
    if comp:
        pad = bool(comp.get("pad"))
        for tie in comp.get("tied_heads", []):
            head = get(model, tie["head"])
            if isinstance(head, TiedCompressedHead):
                specs[f"{tie['head']}.weight"] = ("head", stored[id(head.weight)], 1, pad, stored[id(head.mean)])
        for name, dim in comp.get("writer_params", {}).items():
            specs.setdefault(name, ("writer", by_name[name], dim, pad))
        if not pad:
            for name, in_dim in comp.get("reader_params", {}).items():
                specs.setdefault(name, ("reader", by_name[name], in_dim))
        norm_src = {}  # decompress makes new RMSNorms (same names): their tensors are copied by name, below
    steps = (["decompress"] if comp else []) + (["layernorm"] if to == "layernorm" else [])

    from ..sizes import measure, size_report

    layernorms_total = sum(isinstance(m, (nn.LayerNorm, RMSNorm, StreamCRMSNorm)) for m in model.modules())
    model.normfold_report = copy.deepcopy(src_report)  # measure reads a compressed stream's width from it
    before = measure(model)
    ln = model  # decompress / to_layernorm in place on the meta model: the structure of the in-memory result
    with torch.device("meta"):  # new modules on meta too (their values: copies, fills and `specs`, below)
        if comp:
            decompress(ln)
        if to == "layernorm":
            to_layernorm(ln)
    done = ln.normfold_report.structure  # as the in-memory steps left it (untie_heads adds to `untied`)

    # the report compress.reverse.convert_converted writes
    report = reverse_report(to, adapter.name, ln, layernorms_total, done, structure.added_bias, src_report)
    report.size = size_report(before, ln)
    note_reverse(report, src_report.variant, steps, src_report)
    report.notes.append("converted shard by shard from the safetensors files (normfold.stream)")

    lnstate = ln.state_dict(keep_vars=True)
    if to == "layernorm":
        groups: dict[int, list[str]] = {}
        for name, t in lnstate.items():
            if t.numel():
                groups.setdefault(id(t), []).append(name)
        keep = io.saved_names(list(groups.values()), io.retied_names(ln))  # as io.save picks them
        wanted = [OutTensor(name, t.dtype, tuple(t.shape)) for name, t in lnstate.items()
                  if not t.numel() or name in keep]
    else:  # a normfold Pre-RMSNorm checkpoint: io.export_state_dict's tensors (fills where stock-reloadable)
        wanted = output_tensors(ln, report)
    outputs: list[OutTensor] = []
    names: dict[str, str] = {}
    tables: dict[str, tuple[str, str, str | None]] = {}
    for o in wanted:
        name = o.name
        t = lnstate.get(name)
        if o.fill is not None:
            outputs.append(o)
        elif name in specs:
            outputs.append(o)
        elif name in untied:
            outputs.append(o)
            tables[name] = untied[name]
        elif name in norm_src:
            outputs.append(o)
            names[name] = norm_src[name]
        elif id(t) in restored:
            outputs.append(o)
            tables[name] = restored[id(t)]
        elif id(t) in stored:
            outputs.append(o)
            names[name] = stored[id(t)]
        elif name in by_name:  # a module made anew (a CRMSNorm's γ / β, an untied head's bias): copied by name
            outputs.append(o)
            names[name] = by_name[name]
        elif isinstance(get(ln, name.rpartition(".")[0]), nn.LayerNorm):
            # a LayerNorm affine the RMSNorm did not hold: ones / zeros, as to_layernorm fills it
            outputs.append(OutTensor(name, o.dtype, o.shape, 1.0 if name.endswith(".weight") else 0.0))
        else:
            raise NormfoldError(f"internal: {name} of the {to} model has no tensor in {path}")
    for o in outputs:
        src = names.get(o.name) or tables.get(o.name, (None,))[0]
        if src is not None:
            info = source.tensors[src]
            if st.TORCH_DTYPES.get(info.dtype) != o.dtype or tuple(info.shape) != o.shape:
                raise StreamUnsupportedError(f"{src} is stored as {info.dtype}{list(info.shape)} but the model "
                                             f"holds {o.name} as {o.dtype}{list(o.shape)}; convert it in memory")
    say(f"{type(ln).__name__}, {dtype}, {len(source.shards)} shard(s): {src_report.variant} -> {to}")

    placed = {**tables, **{k: (v[1],) for k, v in specs.items()}}
    files = _assign_files(source, report, outputs, names, placed)
    return write_streamed(out, files, outputs, {}, [], _Tables(source, tables, specs), names, source, say, ln,
                          report, t0)


def _assign_files(source: Source, report, outputs, names, tables) -> dict[str, list[OutTensor]]:
    """`plan.shard_files` for a reverse conversion: each tensor beside the tensor it comes from, a fill beside its
    module's other tensors (else the first shard)."""
    if not (source.sharded and report.stock_reloadable):
        return shard_files(source, report.stock_reloadable, outputs, None)
    index = {p: i for i, p in enumerate(source.shards)}

    def shard(name: str) -> int | None:
        src = names.get(name) or tables.get(name, (None,))[0]
        return None if src is None else index[source.tensors[src].file]

    by_module = {}
    for o in outputs:
        k = shard(o.name)
        if k is not None:
            by_module.setdefault(o.name.rpartition(".")[0], k)

    def shard_of(o: OutTensor) -> int:
        k = shard(o.name)
        return by_module.get(o.name.rpartition(".")[0], 0) if k is None else k

    return shard_files(source, report.stock_reloadable, outputs, shard_of)
