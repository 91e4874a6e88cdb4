"""The plan of a streamed conversion: the in-memory conversion's edits grouped into components (edits that
share a parameter), the value-dependent answers the structure pass needs read from the checkpoint beforehand,
the output tensors (names, dtypes, shapes) and which component and file each one comes from."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from .. import io
from ..adapters.base import get
from ..conversion import TensorValues, fold_decision, will_fold
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



class CheckpointValues(TensorValues):
    """The plan's value questions for a model on the meta device, answered from the checkpoint (read before the
    structure pass: `checkpoint_values`); a tensor with values is asked as usual."""

    def __init__(self, betas_zero: dict[str, bool], heads: dict[str, bool]) -> None:
        self.betas_zero = betas_zero  # {norm bias name: all zero}
        self.heads = heads  # {head weight name: still the original tied table}

    def is_zero(self, name: str, t: torch.Tensor | None) -> bool:
        if t is not None and t.is_meta:
            return self.betas_zero[name]
        return super().is_zero(name, t)

    def head_unchanged(self, name: str, weight: torch.Tensor, original: torch.Tensor) -> bool:
        if weight.is_meta:
            return self.heads.get(name, True)
        return super().head_unchanged(name, weight, original)


def checkpoint_values(model: nn.Module, plan, names: dict[str, str], source: Source,
                      options: ConvertOptions) -> CheckpointValues:
    """The answers the structure pass needs, read from the checkpoint: every norm's β all zero or not, and for the
    readers of final norms whether swap_norm leaves their weight as it is (it changes a reader's weight only when it
    folds γ into it, by `convert.fold_decision` with β read from the checkpoint, and then bit for bit only if γ is
    not all ones)."""

    def read(path):
        return st.read_tensor(source.tensors[names[path]])

    betas = {}
    for stream in plan.streams:
        for site in stream.norms:
            if getattr(get(model, site.path), "bias", None) is not None:
                betas[f"{site.path}.bias"] = not bool(read(f"{site.path}.bias").ne(0).any())
    heads = {}
    for stream in plan.streams:
        for site in stream.norms:
            if not site.final or not site.readers:
                continue
            norm = get(model, site.path)
            readers = [get(model, r) for r in site.readers]
            has_beta = not betas.get(f"{site.path}.bias", True)
            fold_gamma, _ = fold_decision(site, readers, will_fold(site, options), norm.weight is not None, has_beta,
                                          options)
            changed = fold_gamma and not bool(read(f"{site.path}.weight").eq(1).all())
            for r in site.readers:
                heads[f"{r}.weight"] = not changed
    return CheckpointValues(betas, heads)



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



def tied_aliases(model: nn.Module, outputs: list[OutTensor], owner: dict[str, int],
                 comps: list[Component]) -> dict[str, tuple[str, int]]:
    """{output name: (the computed parameter it shares one tensor with in the converted (structure) model, its
    component)} for outputs no edit owns: a table the conversion re-ties to a centred one (BART's `shared`,
    handed to encoder and decoder, is the centred table again after `conversion.keep_ties`) takes that table's
    value, not the source's bytes."""
    where: dict[str, int] = {}
    for i, c in enumerate(comps):
        for m in c.modules + c.params:
            where.setdefault(m, i)
    state = model.state_dict(keep_vars=True)
    computed: dict[int, list[tuple[str, int]]] = {}
    for name, t in state.items():
        i = where.get(name, where.get(name.rpartition(".")[0]))
        if i is not None:
            computed.setdefault(id(t), []).append((name, i))
    out = {}
    for o in outputs:
        if o.fill is not None or o.name in owner or o.name not in state:
            continue
        others = [c for c in computed.get(id(state[o.name]), []) if c[0] != o.name]
        if others:
            out[o.name] = others[0]
    return out


def shard_files(source: Source, stock_reloadable: bool, outputs: list[OutTensor],
                shard_of) -> dict[str, list[OutTensor]]:
    """Output file -> tensors, for every streamed conversion (forward and reverse): one file, or, for a sharded
    stock-reloadable source, the source's sharding: `shard_of(output)` says which source shard an output goes
    with; the shards that get outputs are renumbered model-0000j-of-0000n."""
    weights = io.STOCK_WEIGHTS if stock_reloadable else io.NORMFOLD_WEIGHTS
    if not (source.sharded and stock_reloadable):
        return {weights: list(outputs)}
    by_shard: dict[int, list[OutTensor]] = {}
    for o in outputs:
        by_shard.setdefault(shard_of(o), []).append(o)
    n = len(by_shard)
    return {f"model-{j + 1:05d}-of-{n:05d}.safetensors": by_shard[k] for j, k in enumerate(sorted(by_shard))}


def assign_files(source: Source, report, outputs, owner, comps, names) -> dict[str, list[OutTensor]]:
    """`shard_files` for a forward conversion: each edit's outputs go with its first input's shard (so no edit
    spans two output files), a copied tensor with its source, a fill beside its norm's other tensors (else the
    first shard)."""
    if not (source.sharded and report.stock_reloadable):
        return shard_files(source, report.stock_reloadable, outputs, None)
    index = {p: i for i, p in enumerate(source.shards)}
    comp_shard = [min((index[source.tensors[names[p]].file] for p in c.params if p in names), default=0)
                  for c in comps]

    def shard_of(o: OutTensor) -> int:
        if o.name in owner:
            return comp_shard[owner[o.name]]
        if o.name in names:
            return index[source.tensors[names[o.name]].file]
        return next((comp_shard[i] for i, c in enumerate(comps) if o.name.rpartition(".")[0] in c.modules), 0)

    return shard_files(source, report.stock_reloadable, outputs, shard_of)


PENDING = "verification: pending block verifier"


def pending_verification(dtype: str) -> dict:
    """The report's verification before the block-wise verifier has run on a streamed output."""
    return {"performed": False, "passed": None, "dtype": dtype, "max_abs_error": None, "max_rel_error": None,
            "top1_agreement": None, "fp64": None, "reason": PENDING}
