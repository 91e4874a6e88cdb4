"""Streaming conversion: a safetensors checkpoint converted tensor by tensor, never materialized.

    report = stream_convert(source_dir, out_dir)

Two passes over one plan, both with the in-memory conversion's own code (normfold.convert):

1. *Structure*, on a model built on the meta device: the registered adapter's plan and the variant's
   `apply` run on meta tensors (shapes only, no arithmetic). That yields the exact report (norm
   records, untied parameters, Recenter hooks, stock-reloadability) and the output tensor names,
   dtypes and shapes, so every output header is known before any data is written. The only value
   `apply` looks at, whether a norm's β is all zero, is read from the checkpoint beforehand.
2. *Values*, on a second meta model: the edits are grouped into components (edits that share a
   parameter: a norm with its readers, a writer alone, ...). Each component's parameters are read
   from the checkpoint into real tensors, the same edit functions (`fold_scales`, `center_writer_at`,
   `swap_norm`) run on them in plan order, the results are written and the modules go back to meta.
   Every output tensor therefore goes through the exact roundings of the in-memory path: the files
   hold the same bytes as `normfold.convert` + `normfold.save` (tests/stream/test_stream_convert.py).

Tensors no edit touches are copied file to file in bounded chunks (checked finite on the way).
"""

from __future__ import annotations

import contextlib
import copy
import errno
import importlib
import json
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from .. import checkpoint, io
from ..adapters import find_adapter
from ..adapters.base import get, parent_and_leaf
from ..algebra import layout_of
from ..options import ConvertOptions, resolve as resolve_options
from ..convert import (VARIANTS, kept_norms, will_fold, center_writer_at, centered_outputs,
                       fold_scales, layernorm_names, swap_norm, tied_head_shift, edited_params)
from ..convert import untie as untie_params
from ..nn import TiedHead
from ..errors import CheckpointError, NonFiniteWeightsError, NormfoldError
from ..modelinfo import working_dtype
from ..report import ConversionReport
from . import safetensors_io as st

Progress = Callable[[str], None]
INDEX = io.STOCK_INDEX
METADATA = {"format": "pt"}  # as io.save writes it
# A writer whose output axis is its last (embeddings, Conv1D) is centred in row chunks of about this many
# float64 bytes: the same result (rows are independent), float64 temporaries stay small and in cache
# (~5x faster than whole-tensor passes on a 2-core machine).
CHUNK_BYTES = 4 * 1024 * 1024
PENDING = "verification: pending block verifier"


class StreamUnsupportedError(NormfoldError):
    """This checkpoint or option needs the in-memory conversion (`--stream never`)."""


# ---- the source checkpoint ---------------------------------------------------------------------------

@dataclass
class Source:
    path: Path
    shards: list[Path]  # in index order
    tensors: dict[str, st.TensorInfo]
    sharded: bool

    @property
    def total_bytes(self) -> int:
        return sum(p.stat().st_size for p in self.shards)


def weight_files(source_dir: str | os.PathLike) -> tuple[list[Path], bool] | None:
    """The safetensors weight files of a model directory (and whether sharded), or None; every name
    checked by the path policy (`normfold.checkpoint`)."""
    return checkpoint.weight_files(checkpoint.ModelDir(source_dir), INDEX, io.STOCK_WEIGHTS)


def open_source(source_dir: str | os.PathLike) -> Source:
    found = weight_files(source_dir)
    if found is None:
        raise StreamUnsupportedError(f"{source_dir} has no safetensors weights (model.safetensors or {INDEX}); "
                                     "streaming reads only safetensors; convert it in memory (--stream never)")
    shards, sharded = found
    tensors: dict[str, st.TensorInfo] = {}
    for shard in shards:
        infos, _ = st.read_header(shard)
        tensors.update(infos)
    return Source(Path(source_dir), shards, tensors, sharded)


# ---- the meta model ---------------------------------------------------------------------------------

def _checkpoint_dtype(source: Source) -> torch.dtype:
    floats = {i.dtype for i in source.tensors.values() if i.dtype in ("F64", "F32", "F16", "BF16")}
    if len(floats) != 1:
        raise StreamUnsupportedError(f"the checkpoint mixes floating dtypes ({', '.join(sorted(floats)) or 'none'}); "
                                     "streaming keeps one dtype; convert it in memory (--stream never)")
    return st.TORCH_DTYPES[floats.pop()]


def meta_model(source_dir: Path, dtype: torch.dtype) -> nn.Module:
    """The model class named by the config, built on the meta device (no memory, no init), tied as
    from_pretrained ties it, in eval mode."""
    transformers = io.transformers_module()
    config = transformers.AutoConfig.from_pretrained(source_dir)  # never trust_remote_code
    cls = io.model_class(config)
    with torch.device("meta"):
        model = cls(config)
    model = model.to(dtype)
    model.config.dtype = dtype  # as from_pretrained(dtype="auto") records it
    if hasattr(model, "tie_weights"):
        model.tie_weights()
    return model.eval()


def _renamed(model: nn.Module, source: Source) -> dict[str, str]:
    """{model name: checkpoint name} by transformers' own load-time key renaming (legacy names such as
    GPT-NeoX's embed_out, the base-model prefix added or stripped). A key that transformers converts
    (merges, splits) rather than renames cannot be copied tensor by tensor: refused."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightRenaming, rename_source_key
    except ImportError:  # older transformers: names are used as stored
        return {k: k for k in source.tensors}
    transforms = get_model_conversion_mapping(model)
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if not isinstance(t, WeightRenaming)]
    meta = model.state_dict()
    prefix = getattr(model, "base_model_prefix", None)
    out: dict[str, str] = {}
    for key in source.tensors:
        new, converter = rename_source_key(key, renamings, converters, prefix, meta)
        if converter is not None:
            raise StreamUnsupportedError(
                f"transformers converts checkpoint tensor {key} on load (pattern {converter}), not just renames it; "
                "streaming copies tensors one by one; convert this model in memory (--stream never)")
        out.setdefault(new, key)
    return out


def source_names(model: nn.Module, source: Source) -> dict[str, str]:
    """{state-dict name: checkpoint tensor name}; tied aliases map to whichever alias is stored."""
    renamed = _renamed(model, source)
    groups: dict[int, list[str]] = {}
    state = model.state_dict(keep_vars=True)
    for name, t in state.items():
        groups.setdefault(id(t), []).append(name)
    out = {}
    for names in groups.values():
        found = next((renamed[n] for n in names if n in renamed), None)
        if found is None:
            raise StreamUnsupportedError(
                f"the checkpoint has no tensor for {names[0]} of {type(model).__name__}; its tensor names differ "
                "from the model class's (transformers may rename them on load); convert it in memory "
                "(--stream never)")
        info = source.tensors[found]
        for name in names:
            if tuple(state[name].shape) != info.shape:
                raise CheckpointError(
                    f"{found} has shape {list(info.shape)} in the checkpoint but the config gives "
                    f"{names[0]} shape {list(state[name].shape)}; the weights do not belong to this config")
            if st.TORCH_DTYPES.get(info.dtype) != state[name].dtype:
                raise StreamUnsupportedError(
                    f"{found} is stored as {info.dtype} but the model holds it as {state[name].dtype}; "
                    "convert it in memory (--stream never)")
            out[name] = found
    return out


# ---- edits and their components ----------------------------------------------------------------------

@dataclass
class Edit:
    kind: str  # "scale" | "center" | "swap" | "tieprep" | "tiedhead"
    arg: object  # (writer, scale) pair | writer path | NormSite | TieEdit
    modules: list[str]  # paths of the modules / parameters it changes
    params: list[str]  # parameter names it reads


@dataclass
class Component:
    edits: list[Edit] = field(default_factory=list)
    params: list[str] = field(default_factory=list)
    modules: list[str] = field(default_factory=list)


def _param_names(model: nn.Module, path: str) -> list[str]:
    obj = get(model, path)
    if isinstance(obj, nn.Parameter):
        return [path]
    return [f"{path}.{n}" for n, _ in obj.named_parameters(recurse=False)] if isinstance(obj, nn.Module) else []


@dataclass(frozen=True)
class TieEdit:
    """A head kept tied to a centred table (report.structure.tied_heads), with the norm whose γ it holds."""

    head: str
    table: str
    norm: str | None  # the norm site whose γ was folded into the head (its `scale`), else None


def tie_edits(model: nn.Module, plan, tied_heads: list[dict]) -> tuple[list[Edit], list[Edit]]:
    """For each tied head: an edit before every other one (the original table's row means and the norm's γ,
    read before centring and folding change them) and one after (the TiedHead built from the centred table).
    Both share the table's parameters with its centring, so all three run in one component."""
    first, last = [], []
    sites = {r: site.path for st in plan.streams for site in st.norms for r in site.readers}
    for rec in tied_heads:
        norm = sites.get(rec["head"]) if rec["scale"] else None
        arg = TieEdit(rec["head"], rec["table"], norm)
        table_params = _param_names(model, rec["table"])
        first.append(Edit("tieprep", arg, [rec["table"]] + ([norm] if norm else []),
                          table_params + (_param_names(model, norm) if norm else [])))
        head_params = [n for n in _param_names(model, rec["head"]) if n.endswith(".bias")]
        last.append(Edit("tiedhead", arg, [rec["head"], rec["table"]], table_params + head_params))
    return first, last


def plan_edits(model: nn.Module, plan, options: ConvertOptions, tied_heads: list[dict] | None = None) -> list[Edit]:
    """apply_rmsnorm's edits, in its order (scale folds, writers, norms; stream by stream), with the tied heads'
    edits around them."""
    first, last = tie_edits(model, plan, tied_heads or [])
    edits = list(first)
    for stream in plan.streams:
        for pair in stream.scale_folds:
            paths = list(pair)
            edits.append(Edit("scale", pair, paths, [n for p in paths for n in _param_names(model, p)]))
        for path in stream.writers:
            edits.append(Edit("center", path, [path], _param_names(model, path)))
        for site in stream.norms:
            paths = [site.path] + (list(site.readers) if will_fold(site, options) else [])
            edits.append(Edit("swap", site, paths, [n for p in paths for n in _param_names(model, p)]))
    return edits + last


def components(edits: list[Edit]) -> list[Component]:
    """Edits that share a parameter, joined (union-find), each keeping plan order."""
    parent = list(range(len(edits)))

    def find(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    owner: dict[str, int] = {}
    for i, e in enumerate(edits):
        for n in e.params + e.modules:
            if n in owner:
                parent[find(i)] = find(owner[n])
            else:
                owner[n] = i
    groups: dict[int, Component] = {}
    for i, e in enumerate(edits):
        c = groups.setdefault(find(i), Component())
        c.edits.append(e)
        c.params += [p for p in e.params if p not in c.params]
        c.modules += [m for m in e.modules if m not in c.modules]
    return list(groups.values())


# ---- pass 1: structure on the meta device ----------------------------------------------------------------

@contextlib.contextmanager
def _beta_zero_from(table: dict[int, bool]):
    """swap_norm asks `_is_zero(β)`, the one value-dependent choice of the plan; on meta tensors answer it
    from the checkpoint (read beforehand), elsewhere as usual."""
    _convert = importlib.import_module("normfold.convert")  # the module (the package attribute is the function)
    original = _convert._is_zero

    def is_zero(t):
        if t is not None and t.is_meta:
            return table[id(t)]
        return original(t)

    _convert._is_zero = is_zero
    try:
        yield
    finally:
        _convert._is_zero = original


def _norm_betas(model: nn.Module, plan, names: dict[str, str], source: Source) -> dict[int, bool]:
    table = {}
    for stream in plan.streams:
        for site in stream.norms:
            bias = getattr(get(model, site.path), "bias", None)
            if bias is not None:
                t = st.read_tensor(source.tensors[names[f"{site.path}.bias"]])
                table[id(bias)] = not bool(t.ne(0).any())
    return table


@dataclass
class OutTensor:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    fill: float | None = None  # a folded-away norm affine written back as ones / zeros (stock layout)


def output_tensors(model: nn.Module, report: ConversionReport) -> list[OutTensor]:
    """io.export_state_dict on a meta model: same names, dtypes and shapes (tied aliases by identity,
    since meta tensors share no storage to compare)."""
    seen, out = set(), {}
    for name, t in model.state_dict(keep_vars=True).items():
        if id(t) in seen and t.numel():
            continue
        seen.add(id(t))
        out[name] = OutTensor(name, t.dtype, tuple(t.shape))
    if report.stock_reloadable:
        for rec in report.structure.norms:
            norm = get(model, rec.name)
            ref = next(iter(norm.parameters()), None)
            dtype = ref.dtype if ref is not None else working_dtype(model)
            shape = tuple(norm.normalized_shape)
            for key, flag, fill in ((f"{rec.name}.weight", rec.stock_weight, 1.0), (f"{rec.name}.bias", rec.stock_bias, 0.0)):
                if flag and key not in out:
                    out[key] = OutTensor(key, dtype, shape, fill)
    return list(out.values())


# ---- pass 2: values ----------------------------------------------------------------------------------------

class Computer:
    """Runs one component at a time on real tensors read from the checkpoint, the rest of the model on meta."""

    def __init__(self, model: nn.Module, plan, options: ConvertOptions, source: Source, names: dict[str, str]):
        self.model, self.plan, self.options, self.source, self.names = model, plan, options, source, names
        self.ties: dict[str, tuple] = {}  # head -> (original row means, γ or None), from its "tieprep" edit

    def _read(self, name: str) -> torch.Tensor:
        src = self.names[name]
        t = st.read_tensor(self.source.tensors[src])
        if t.is_floating_point() and not st.all_finite(t):
            raise NonFiniteWeightsError(f"tensor {src} of {self.source.path} has NaN/inf values; no conversion of it "
                                        "can be exact. Fix or re-download the checkpoint.")
        return t

    def run(self, comp: Component, keys: list[str]) -> dict[str, torch.Tensor]:
        release_memory()  # the previous component's buffers, freed but kept by malloc
        for name in comp.params:
            parent, leaf = parent_and_leaf(self.model, name)
            setattr(parent, leaf, nn.Parameter(self._read(name), requires_grad=False))
        try:
            if not self._chunked(comp):
                for batch in _batches(comp.edits):
                    self._apply(batch)
            return {k: get(self.model, k).detach() for k in keys}
        finally:
            for path in comp.modules:  # back to meta: frees the component's memory
                obj = get(self.model, path)
                if isinstance(obj, nn.Parameter):
                    parent, leaf = parent_and_leaf(self.model, path)
                    setattr(parent, leaf, nn.Parameter(torch.empty_like(obj, device="meta"), requires_grad=False))
                else:
                    obj.to("meta")

    def _apply(self, batch: list[Edit]) -> None:
        kind = batch[0].kind
        if kind == "scale":
            fold_scales(self.model, [e.arg for e in batch])
        elif kind == "center":
            center_writer_at(self.model, batch[0].arg)
        elif kind == "tieprep":  # as convert.tie_groups reads them: before any edit
            t = batch[0].arg
            table = get(self.model, t.table).weight
            gamma = get(self.model, t.norm).weight.detach().double().clone() if t.norm else None
            self.ties[t.head] = (table.detach().double().mean(dim=-1), gamma)
        elif kind == "tiedhead":  # as convert.keep_ties builds it
            t = batch[0].arg
            table = get(self.model, t.table)
            means, gamma = self.ties.pop(t.head)
            head = get(self.model, t.head)
            parent, leaf = parent_and_leaf(self.model, t.head)
            setattr(parent, leaf, TiedHead(table, tied_head_shift(means, table.weight),
                                           None if gamma is None else gamma.to(table.weight.dtype), head.bias))
        else:
            swap_norm(self.model, batch[0].arg, will_fold(batch[0].arg, self.options), self.options)

    def _chunked(self, comp: Component) -> bool:
        """A lone big writer whose output axis is its last (embedding tables, Conv1D): centre it in row
        chunks, in place, through the same `center_writer_at`."""
        if len(comp.edits) != 1 or comp.edits[0].kind != "center":
            return False
        obj = get(self.model, comp.edits[0].arg)
        if isinstance(obj, nn.Parameter):
            weight, bias, out_dim = obj, None, -1
        else:
            lay = layout_of(obj)
            if lay is None:
                return False
            weight = getattr(obj, lay.weight)
            bias = getattr(obj, lay.bias, None) if lay.bias else None
            out_dim = lay.out_dim
        if weight.dim() < 2 or out_dim not in (-1, weight.dim() - 1):
            return False
        flat = weight.data.reshape(-1, weight.shape[-1])
        with torch.no_grad():
            for a, b in row_chunks(flat.shape[0], CHUNK_BYTES // 8 // max(1, weight.shape[-1])):
                flat[a:b] = center_writer_rows(flat[a:b])
            if bias is not None:
                bias.copy_(_center_bias(bias))
        return True


def _malloc_trim():
    try:
        import ctypes

        return ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc: nothing to trim
        return None


_TRIM = _malloc_trim()


def release_memory() -> None:
    """Give freed heap memory back to the OS. Tensors of a few MB come from malloc's heap, which glibc does not
    shrink on its own: without this, resident memory grew ~30 MB per GPT-2-XL layer (fragmentation)."""
    if _TRIM is not None:
        _TRIM(0)


def row_chunks(n: int, rows: int) -> list[tuple[int, int]]:
    """[a, b) row ranges of about `rows` rows, none of exactly one row unless n == 1: torch reduces a single
    row (one output) by splitting it across threads, in another summation order than row by row."""
    rows = max(2, rows)
    bounds = [(a, min(a + rows, n)) for a in range(0, n, rows)]
    if len(bounds) > 1 and bounds[-1][1] - bounds[-1][0] == 1:
        bounds[-2:] = [(bounds[-2][0], n)]
    return bounds


def center_writer_rows(rows: torch.Tensor) -> torch.Tensor:
    from ..algebra import center_writer as cw

    return cw(rows, None, -1)[0]


def _center_bias(bias: torch.Tensor) -> torch.Tensor:
    from ..algebra import center

    return center(bias, -1)


def _batches(edits: list[Edit]) -> list[list[Edit]]:
    """Consecutive scale folds go to one fold_scales call (it sets each multiplier to 1 after all its writers)."""
    out: list[list[Edit]] = []
    for e in edits:
        if e.kind == "scale" and out and out[-1][0].kind == "scale":
            out[-1].append(e)
        else:
            out.append([e])
    return out


# ---- the entry point ----------------------------------------------------------------------------------------

def stream_convert(source_dir: str | os.PathLike, out_dir: str | os.PathLike, *, to: str | None = None,
                   options: ConvertOptions | None = None, keep_affine: bool | None = None,
                   fold_final: bool | None = None, allow_new_bias: bool | None = None, pad: bool | None = None,
                   untie: bool | None = None,
                   progress: Progress | None = None) -> ConversionReport:
    """Convert the safetensors checkpoint in `source_dir` into `out_dir` (an existing empty directory)
    shard by shard. Writes the weights (sharded like the source when it is stock-reloadable, else one
    normfold_model.safetensors), config.json, the tokenizer/generation files and normfold.json.
    Verification is not run here (the report says so); see `normfold.cli.convert_stream.verify_streamed`."""
    options = resolve_options(options, "stream_convert", to=to, keep_affine=keep_affine, fold_final=fold_final,
                              allow_new_bias=allow_new_bias, pad=pad, untie=untie)
    options = options.replace(keep_affine=bool(options.keep_affine))
    to = options.to
    say = progress or (lambda msg: None)
    if to != "rmsnorm" or options.pad or options.variant_options:
        raise StreamUnsupportedError(f"streaming converts --to rmsnorm only; --to {to} needs the in-memory "
                                     "conversion (--stream never, or normfold.convert)")
    out = Path(out_dir)
    if not out.is_dir() or any(out.iterdir()):
        raise NormfoldError(f"{out} must be an existing empty directory")
    t0 = time.perf_counter()
    checkpoint.ModelDir(source_dir).check_all()  # config, weights, tokenizer files: nothing from outside
    source = open_source(source_dir)
    dtype = _checkpoint_dtype(source)

    original = meta_model(source.path, dtype)
    names = source_names(original, source)
    adapter = find_adapter(original)
    if adapter.check is not None:
        adapter.check(original)
    plan = adapter.plan(original)
    say(f"{type(original).__name__}, {dtype}, {len(source.shards)} shard(s), adapter {adapter.display_name}")

    # pass 1: the structure and the report, by the variant's own apply, on meta tensors
    from ..sizes import measure, size_report

    structure_model = copy.deepcopy(original)
    report = ConversionReport(variant=to, adapter=adapter.name, architecture=type(original).__name__,
                              dtype=str(working_dtype(original)).replace("torch.", ""),
                              layernorms_total=len(layernorm_names(original)),
                              stock_reloadable=plan.stock_reloadable, notes=list(plan.notes),
                              centered_outputs=list(centered_outputs(plan)))
    before = measure(original)
    with _beta_zero_from(_norm_betas(structure_model, plan, names, source)):
        VARIANTS[to].apply(structure_model, plan, options, report)
    structure_model.eval()
    report.size = size_report(before, structure_model)
    report.kept = kept_norms(original, plan, {r.name for r in report.structure.norms})
    report.source = {"model": str(source_dir), "architecture": type(original).__name__,
                     "model_type": getattr(original.config, "model_type", None), "path": str(source_dir)}
    report.notes.append("converted shard by shard from the safetensors files (normfold.stream)")
    outputs = output_tensors(structure_model, report)

    # pass 2: values, component by component, on the untransformed meta model
    values_model = copy.deepcopy(original)
    untie_params(values_model, edited_params(values_model, plan, options))
    comps = components(plan_edits(values_model, plan, options, report.structure.tied_heads))
    owner = _owners(comps, outputs)
    computer = Computer(values_model, plan, options, source, names)
    files = _assign_files(source, report, outputs, owner, comps, names)
    written = _write(out, files, outputs, owner, comps, computer, names, source, say)

    _write_aux(out, structure_model, source.path, report, written)
    report.weight_files = written["digests"]
    report.seconds["convert"] = round(time.perf_counter() - t0, 3)
    report.verification = pending_verification(report.dtype)
    (out / io.REPORT_FILE).write_text(report.to_json() + "\n")
    return report


def pending_verification(dtype: str) -> dict:
    return {"performed": False, "passed": None, "dtype": dtype, "max_abs_error": None, "max_rel_error": None,
            "top1_agreement": None, "fp64": None, "reason": PENDING}


def _owners(comps: list[Component], outputs: list[OutTensor]) -> dict[str, int]:
    """{output name: component index} for the outputs an edit produces (ones/zeros fills excluded)."""
    where: dict[str, int] = {}
    for i, c in enumerate(comps):
        for m in c.modules:
            where[m] = i
    owner = {}
    for o in outputs:
        if o.fill is not None:
            continue
        if o.name in where:
            owner[o.name] = where[o.name]
        else:
            mod = o.name.rpartition(".")[0]
            if mod in where:
                owner[o.name] = where[mod]
    return owner


def _assign_files(source: Source, report, outputs, owner, comps, names) -> dict[str, list[OutTensor]]:
    """Output file -> tensors. Stock-reloadable sharded sources keep their sharding (each edit's outputs go
    with its first input's shard, so no edit spans two output files); otherwise one file."""
    weights = io.STOCK_WEIGHTS if report.stock_reloadable else io.NORMFOLD_WEIGHTS
    if not (source.sharded and report.stock_reloadable):
        return {weights: list(outputs)}
    index = {p: i for i, p in enumerate(source.shards)}
    comp_shard = [min((index[source.tensors[names[p]].file] for p in c.params if p in names), default=0)
                  for c in comps]
    by_shard: dict[int, list[OutTensor]] = {}
    for o in outputs:
        if o.name in owner:
            k = comp_shard[owner[o.name]]
        elif o.name in names:
            k = index[source.tensors[names[o.name]].file]
        else:  # a fill: beside the norm's other tensors if any, else the first shard
            k = next((comp_shard[i] for i, c in enumerate(comps) if o.name.rpartition(".")[0] in c.modules), 0)
        by_shard.setdefault(k, []).append(o)
    n = len(by_shard)
    return {f"model-{j + 1:05d}-of-{n:05d}.safetensors": by_shard[k] for j, k in enumerate(sorted(by_shard))}


def _finite_check(dtype: torch.dtype, name: str):
    if not dtype.is_floating_point:
        return None

    def check(view) -> None:
        if not st.all_finite(torch.frombuffer(view, dtype=dtype)):
            raise NonFiniteWeightsError(f"tensor {name} has NaN/inf values; no conversion of it can be exact. "
                                        "Fix or re-download the checkpoint.")
    return check


def _write(out: Path, files, outputs, owner, comps, computer: Computer, names, source: Source, say) -> dict:
    """Write each output file: header first, then every tensor at its offset; a component is computed when
    its first output comes up and its other outputs wait in `pending` (same file, see _assign_files)."""
    weight_map = {}
    digests: dict[str, dict] = {}
    pending: dict[str, torch.Tensor] = {}
    total = 0
    for fname, tensors in files.items():
        by_name = {o.name: o for o in tensors}
        header, placed = st.layout({o.name: (st.ST_DTYPES[o.dtype], o.shape) for o in tensors}, METADATA)
        say(f"writing {fname} ({len(tensors)} tensors)")
        raw_fd = os.open(out / fname, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        fd = checkpoint.HashingSink(raw_fd, out / fname)  # SHA-256 while writing (tamper evidence)
        try:
            st.write_all(fd, header, 0)
            base = len(header)
            _preallocate(raw_fd, base + sum(n for _, _, n in placed))
            for name, offset, nbytes in placed:
                o = by_name[name]
                if o.fill is not None:
                    st.write_tensor(fd, torch.full(o.shape, o.fill, dtype=o.dtype), base + offset)
                elif name in owner:
                    if name not in pending:
                        i = owner[name]
                        keys = [k for k, v in owner.items() if v == i]
                        pending.update(computer.run(comps[i], keys))
                    t = pending.pop(name)
                    if t.dtype != o.dtype or tuple(t.shape) != o.shape:
                        raise NormfoldError(f"internal: {name} computed as {t.dtype}{list(t.shape)}, "
                                            f"planned {o.dtype}{list(o.shape)}")
                    st.write_tensor(fd, t, base + offset)
                    del t
                else:
                    info = source.tensors[names[name]]
                    st.copy_range(info.file, info.start, nbytes, fd, base + offset,
                                  check=_finite_check(o.dtype, names[name]))
                weight_map[name] = fname
                total += nbytes
            digests[fname] = {"sha256": fd.hexdigest(), "bytes": os.fstat(raw_fd).st_size}
        finally:
            os.close(raw_fd)
    if pending:
        raise NormfoldError(f"internal: computed tensors never written: {sorted(pending)[:5]}")
    return {"files": list(files), "weight_map": weight_map, "total_size": total, "digests": digests}


def _preallocate(fd: int, size: int) -> None:
    """Reserve the file's blocks at once (ext4 otherwise allocates page by page as writes extend the file):
    faster, and a full disk fails here, before the work."""
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as exc:
        if exc.errno in (errno.EOPNOTSUPP, errno.EINVAL, getattr(errno, "ENOTSUP", errno.EOPNOTSUPP)):
            return  # a filesystem without fallocate: extend as we write
        raise


def _write_aux(out: Path, model: nn.Module, source_dir: Path, report, written: dict) -> None:
    """config.json (architectures = this class, as normfold.save writes it), the index of a sharded output,
    and the tokenizer / generation files copied from the source."""
    if len(written["files"]) > 1:
        index = {"metadata": {"total_size": written["total_size"]},
                 "weight_map": dict(sorted(written["weight_map"].items()))}
        (out / INDEX).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    config = copy.deepcopy(model.config)
    config.architectures = [type(model).__name__]
    config.save_pretrained(out)
    for f in checkpoint.ModelDir(source_dir).auxiliary_files():  # checked: nothing from outside the source
        shutil.copy2(f, out / f.name)
    io.apply_umask(out)
