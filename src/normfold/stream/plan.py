"""The plan of a streamed conversion: the in-memory conversion's edits grouped into components (edits that
share a parameter), the value-dependent answers the structure pass needs read from the checkpoint beforehand,
the output tensors (names, dtypes, shapes) and which component and file each one comes from."""

from __future__ import annotations

import contextlib
import importlib
from dataclasses import dataclass, field

import torch
from torch import nn

from .. import io
from ..adapters.base import get
from ..algebra import layout_of
from ..compress import convert as compress_convert
from ..convert import will_fold
from ..modelinfo import working_dtype
from ..options import ConvertOptions
from ..report import ConversionReport
from . import safetensors_io as st
from .source import Source



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



@contextlib.contextmanager
def beta_zero_from(table: dict[int, bool]):
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



def norm_betas(model: nn.Module, plan, names: dict[str, str], source: Source) -> dict[int, bool]:
    table = {}
    for stream in plan.streams:
        for site in stream.norms:
            bias = getattr(get(model, site.path), "bias", None)
            if bias is not None:
                t = st.read_tensor(source.tensors[names[f"{site.path}.bias"]])
                table[id(bias)] = not bool(t.ne(0).any())
    return table



@contextlib.contextmanager
def heads_unchanged_from(table: dict[str, bool]):
    """compress.retie_heads asks whether a head still holds its original tied table; on meta tensors answer
    it from the checkpoint (read beforehand, `heads_unchanged`), elsewhere as usual."""
    original = compress_convert.head_unchanged

    def unchanged(name, weight, before):
        if weight.is_meta:
            return table.get(name, True)
        return original(name, weight, before)

    compress_convert.head_unchanged = unchanged
    try:
        yield
    finally:
        compress_convert.head_unchanged = original



def heads_unchanged(model: nn.Module, plan, names: dict[str, str], source: Source, options) -> dict[str, bool]:
    """{head weight name: unchanged} for the readers of final norms: swap_norm changes a reader's weight only
    when it folds γ into it (same decision as swap_norm's, with β read from the checkpoint), and then bit for
    bit only if γ is not all ones."""
    from ..algebra import is_conv_reader, is_linear_reader

    def read(path):
        return st.read_tensor(source.tensors[names[path]])

    table = {}
    for stream in plan.streams:
        for site in stream.norms:
            if not site.final or not site.readers:
                continue
            norm = get(model, site.path)
            readers = [get(model, r) for r in site.readers]
            fold = will_fold(site, options) and all(is_linear_reader(r) or is_conv_reader(r) for r in readers)
            has_beta = getattr(norm, "bias", None) is not None and bool(read(f"{site.path}.bias").ne(0).any())
            fold_beta = fold and has_beta and (options.allow_new_bias or all(
                _reader_has_bias(r) or p in site.beta_cancels for p, r in zip(site.readers, readers)))
            fold_gamma = fold and norm.weight is not None and (not has_beta or fold_beta)
            changed = fold_gamma and not bool(read(f"{site.path}.weight").eq(1).all())
            for r in site.readers:
                table[f"{r}.weight"] = not changed
    return table



def _reader_has_bias(reader: nn.Module) -> bool:
    lay = layout_of(reader)
    return bool(lay.bias) and getattr(reader, lay.bias, None) is not None



@dataclass
class OutTensor:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    fill: float | None = None  # a folded-away norm affine written back as ones / zeros (stock layout)



def output_tensors(model: nn.Module, report: ConversionReport) -> list[OutTensor]:
    """io.export_state_dict on a meta model: same names, dtypes and shapes (tied aliases by identity,
    since meta tensors share no storage to compare)."""
    state = model.state_dict(keep_vars=True)
    groups: dict[int, list[str]] = {}
    for name, t in state.items():
        if t.numel():
            groups.setdefault(id(t), []).append(name)
    keep = io.saved_names(list(groups.values()), io.retied_names(model))
    out = {name: OutTensor(name, t.dtype, tuple(t.shape)) for name, t in state.items()
           if not t.numel() or name in keep}
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



def owners(comps: list[Component], outputs: list[OutTensor]) -> dict[str, int]:
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



def assign_files(source: Source, report, outputs, owner, comps, names) -> dict[str, list[OutTensor]]:
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


PENDING = "verification: pending block verifier"


def pending_verification(dtype: str) -> dict:
    """The report's verification before the block-wise verifier has run on a streamed output."""
    return {"performed": False, "passed": None, "dtype": dtype, "max_abs_error": None, "max_rel_error": None,
            "top1_agreement": None, "fp64": None, "reason": PENDING}
