"""The conversion orchestrator: model + adapter plan -> converted model + report.

    converted, report = normfold.convert(model, to="rmsnorm")

Steps (each a small function below): check the input, ask the adapter for the residual-stream
plan, untie parameters that will be edited, centre every stream writer, fold each norm's affine
into its linear readers, swap LayerNorm -> RMSNorm (same eps), then verify against the original
(float64 exactness and working-dtype error, see `normfold.verify`).
"""

from __future__ import annotations

import copy
import dataclasses
import time
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn

from . import algebra
from .algebra.rows import CENTER_CHUNK_BYTES, center_rows_in_place  # the streamed conversion's row chunks too
from .adapters import Adapter, ConversionPlan, NormSite, adapter_for
from .adapters.examples import trace_inputs
from .adapters.base import get, parent_and_leaf
from .errors import NonFiniteWeightsError, UnsupportedConversionError
from .options import ConvertOptions, resolve as resolve_options
from .modelinfo import working_dtype
from .nn import RMSNorm
from .nn.hooks import add_input_recenter, add_output_recenter
from .report import TIE_NOTE, ConversionReport, NormRecord, Structure
from .sizes import measure, size_report
from .verify import CENTERED_OUTPUTS, FinalNorms, check_conversion

Progress = Callable[[str], None]


@dataclass
class Variant:
    """A conversion target registered under `to=` (rmsnorm; later issues add more)."""

    name: str
    description: str
    apply: Callable[[nn.Module, ConversionPlan, ConvertOptions, ConversionReport], None]
    exact: bool = True  # output-equivalent to the original (then float64 verification applies)
    takes_options: bool = False  # accepts variant_options (--option KEY=VALUE); apply() validates them
    # How this target keeps a tied table the original tensor shared with its stock head:
    # keep_ties(model, plan, options, tables) -> the plan rewritten (`recentre_tied_tables` calls it with the
    # tied tables a head reads unchanged). None: the variant unties them (or keeps the tie its own way).
    keep_ties: Callable[[nn.Module, ConversionPlan, ConvertOptions, list[str]], ConversionPlan] | None = None
    # keep_ties also for tables tied to each other with no head reading them (BartModel's `shared` handed to
    # the encoder and the decoder): a variant whose untied tables would not be re-tied otherwise (crmsnorm).
    keep_shared_tables: bool = False
    # What verification compares where the target changes the basis of a stream (rotation):
    # output_map(report, plan) -> a (name, tensor) -> tensor map back to the original basis, or None;
    # final_norms(report, options) -> the final norms whose outputs are found by value (verify.FinalNorms), or None.
    output_map: Callable[[ConversionReport, ConversionPlan], Callable | None] | None = None
    final_norms: Callable[[ConversionReport, ConvertOptions], FinalNorms | None] | None = None
    # The executor: None, the plan's (`convert_by_plan`: an adapter's plan, `apply`, report, verification). A
    # target whose input is not a LayerNorm model brings its own, `executor(model, variant, options, **convert's
    # keywords) -> (model, report)`, and `claims(model)` says which models it takes whatever `to` asks (the
    # reverse conversions, registered by normfold.compress: every model that already carries normfold norms).
    executor: Callable[..., tuple] | None = None
    claims: Callable[[nn.Module], bool] | None = None

    def verified_final_norms(self, report: ConversionReport, options: ConvertOptions) -> FinalNorms | None:
        """The final norms verification finds by value: the variant's own answer, else (--fold-final) the folded ones."""
        if self.final_norms is not None:
            return self.final_norms(report, options)
        return FinalNorms.folded(report.structure) if options.fold_final else None


VARIANTS: dict[str, Variant] = {}


def register_variant(variant: Variant) -> Variant:
    VARIANTS[variant.name] = variant
    return variant


@dataclass(frozen=True)
class Rotator:
    """Residual-stream rotation on top of the rmsnorm variant (`convert(..., rotate=KIND)`), registered
    by `normfold.rotate` (which imports this module). `apply(model, plan, options, report, kind, seed)`
    converts and rotates in place; `output_map(report.structure.rotation, centred patterns)` returns a (name, tensor) ->
    tensor map that brings the rotated model's stream outputs back to the original basis."""

    apply: Callable[..., None]
    output_map: Callable[..., Callable]


ROTATOR: dict[str, Rotator] = {}


def register_rotator(apply: Callable[..., None], output_map: Callable[..., Callable]) -> None:
    ROTATOR["rotator"] = Rotator(apply, output_map)


def rotating_variant(variant: Variant, rotate: str, seed: int, keep_affine: bool, online: bool,
                     attention: str | None = None) -> Variant:
    """`variant` (rmsnorm: `ConvertOptions.check` refuses the others) with its stream rotated afterwards, and
    inside attention where `attention` asks ("vo", "online", "both", "qk", "all")."""
    if "rotator" not in ROTATOR:  # pragma: no cover - normfold/__init__ imports normfold.rotate
        raise UnsupportedConversionError("rotation is not available (import normfold.rotate)")
    rot = ROTATOR["rotator"]

    def apply(model, plan, options, report):
        rot.apply(model, plan, options, report, rotate, seed, online=online, attention=attention)

    # a final norm's output is skipped where its γ/β went into the heads (rotated basis, lacking them) and
    # compared where a head-less final norm kept them (un-rotated by its x·Qᵀ hook): verify.FinalNorms
    return Variant(variant.name, f"{variant.description}; residual stream rotated ({rotate}, seed {seed})", apply,
                   output_map=lambda report, plan: rot.output_map(report.structure.rotation, centered_outputs(plan)),
                   final_norms=lambda report, options: FinalNorms.of(report.structure))


def variant_for(options: ConvertOptions, model: nn.Module | None = None) -> Variant:
    """The registered target `options` asks for (`options` checked: `ConvertOptions.check`), rotated if asked; for
    a `model` a registered target claims (`Variant.claims`: one that already carries normfold norms), that target."""
    variant = VARIANTS[options.to]
    if options.rotate is not None:
        variant = rotating_variant(variant, options.rotate, options.rotate_seed, options.keep_affine,
                                   options.rotate_online, options.rotate_attention)
    variant_options = options.target_options()
    if variant_options and not variant.takes_options:
        raise UnsupportedConversionError(
            f"--to {options.to} takes no options (got {', '.join(sorted(variant_options))}); "
            f"options exist for: {', '.join(n for n, v in VARIANTS.items() if v.takes_options) or 'none'}")
    if model is not None:
        variant = next((v for v in VARIANTS.values() if v.claims is not None and v.claims(model)), variant)
    return variant


# ---- checks -----------------------------------------------------------------------------------

def check_finite(model: nn.Module) -> None:
    for name, p in model.named_parameters():
        if p.is_floating_point() and not torch.isfinite(p).all():
            bad = (~torch.isfinite(p)).sum().item()
            raise NonFiniteWeightsError(
                f"parameter {name} has {bad} NaN/inf value(s); no conversion of it can be exact. "
                "Fix or re-download the checkpoint.")


def is_layernorm(module: nn.Module) -> bool:
    return isinstance(module, nn.LayerNorm)


def layernorm_names(model: nn.Module) -> list[str]:
    return [n for n, m in model.named_modules() if is_layernorm(m)]


# ---- parameter surgery ---------------------------------------------------------------------------

def _params_of(model: nn.Module, path: str) -> list[nn.Parameter]:
    obj = get(model, path)
    if isinstance(obj, nn.Parameter):
        return [obj]
    lay = algebra.layout_of(obj)
    if lay is None:
        return []
    out = [getattr(obj, lay.weight)]
    if lay.bias and getattr(obj, lay.bias, None) is not None:
        out.append(getattr(obj, lay.bias))
    return out


def untie(model: nn.Module, params: list[nn.Parameter]) -> list[str]:
    """Give every alias of each shared parameter in `params` its own copy; returns alias names."""
    targets = {id(p) for p in params}
    aliases: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in targets:
            aliases.setdefault(id(p), []).append(name)
    untied = []
    for names in aliases.values():
        if len(names) < 2:
            continue
        for name in names:
            parent, leaf = parent_and_leaf(model, name)
            old = getattr(parent, leaf)
            setattr(parent, leaf, nn.Parameter(old.detach().clone(), requires_grad=old.requires_grad))
            untied.append(name)
    if untied:
        disable_weight_tying(model)
        # tie_word_embeddings=False also stops transformers re-tying the model's other pairs on load
        # (RoBERTa's lm_head.bias / lm_head.decoder.bias): give them their own storage so each is saved.
        untied += untie(model, _shared_params(model))
    return untied


def _shared_params(model: nn.Module) -> list[nn.Parameter]:
    names: dict[int, list[nn.Parameter]] = {}
    for _, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(p)
    return [ps[0] for ps in names.values() if len(ps) > 1]


def disable_weight_tying(model: nn.Module) -> None:
    """Tell transformers the embeddings are no longer tied (config, and its cached tie map)."""
    for module in model.modules():
        cfg = getattr(module, "config", None)
        if cfg is None:
            continue
        for c in {id(cfg): cfg, **{id(s): s for s in _sub_configs(cfg)}}.values():
            if getattr(c, "tie_word_embeddings", False):
                c.tie_word_embeddings = False
        if hasattr(module, "get_expanded_tied_weights_keys") and hasattr(module, "all_tied_weights_keys"):
            module.all_tied_weights_keys = module.get_expanded_tied_weights_keys(all_submodels=False)


def _sub_configs(cfg) -> list:
    subs = []
    for key in getattr(cfg, "sub_configs", {}) or {}:
        sub = getattr(cfg, key, None)
        if sub is not None:
            subs.append(sub)
    return subs


def _set(param: nn.Parameter, value: torch.Tensor) -> None:
    with torch.no_grad():
        param.copy_(value)


def center_writer_at(model: nn.Module, path: str) -> int:
    """Make the output of the writer at `path` zero-mean over the stream axis. Returns #tensors edited."""
    obj = get(model, path)
    if isinstance(obj, nn.Parameter):
        _set(obj, algebra.center(obj, -1))
        return 1
    lay = algebra.layout_of(obj)
    if lay is None:
        raise UnsupportedConversionError(
            f"stream writer {path} is a {type(obj).__name__}, which normfold cannot centre "
            "(register its weight layout with normfold.algebra.register_layout)")
    weight = getattr(obj, lay.weight)
    bias = getattr(obj, lay.bias, None) if lay.bias else None
    if _center_rows_in_place(weight, lay.out_dim):
        new_b = None if bias is None else algebra.center(bias, -1)
    else:
        new_w, new_b = algebra.center_writer(weight, bias, lay.out_dim)
        _set(weight, new_w)
    if bias is not None:
        _set(bias, new_b)
    return 1 + (bias is not None)




def _center_rows_in_place(weight: torch.Tensor, out_dim: int) -> bool:
    """A writer whose output axis is its last (embedding tables, Conv1D), centred in place in row chunks of about
    CENTER_CHUNK_BYTES of float64: the values of one whole-tensor `algebra.center` (each row's mean is its own;
    no chunk of a single row, which torch would reduce in another order), without its float64 copies of the
    whole table (2.5x a float32 table at once: 1.6 GB for GPT-2-XL's). False: not such a writer."""
    if (weight.dim() < 2 or out_dim not in (-1, weight.dim() - 1) or not weight.is_contiguous()
            or weight.device.type == "meta"):
        return False
    flat = weight.data.view(-1, weight.shape[-1])
    with torch.no_grad():
        center_rows_in_place(flat, CENTER_CHUNK_BYTES // 8 // max(1, flat.shape[1]))
    return True


def fold_scales(model: nn.Module, pairs: list[tuple[str, str]]) -> int:
    """Scale folding: each writer absorbs the per-channel multiplier parameter applied to its output
    (LayerScale λ; a functional writer lists its weight and its bias as two pairs with the same λ), and
    every multiplier becomes 1 once all are folded. Returns #tensors edited."""
    values = {scale: get(model, scale).detach().clone() for _, scale in pairs}
    edited = 0
    for writer, scale in pairs:
        lam = values[scale]
        obj = get(model, writer)
        if isinstance(obj, nn.Parameter):  # functional: a weight (x @ W, output = last dim) or a bias
            _set(obj, algebra.scale_writer(obj, None, lam, obj.dim() - 1)[0])
            edited += 1
            continue
        lay = algebra.layout_of(obj)
        if lay is None:
            raise UnsupportedConversionError(f"cannot fold {scale} into {writer}: a {type(obj).__name__} has no "
                                             "known weight layout")
        weight = getattr(obj, lay.weight)
        bias = getattr(obj, lay.bias, None) if lay.bias else None
        new_w, new_b = algebra.scale_writer(weight, bias, lam, lay.out_dim)
        _set(weight, new_w)
        if bias is not None:
            _set(bias, new_b)
        edited += 1 + (bias is not None)
    for scale in values:
        lam = get(model, scale)
        _set(lam, torch.ones_like(lam))
        edited += 1
    return edited


class TensorValues:
    """The value questions a conversion plan asks of the model's tensors, answered from the tensors themselves
    (a model in memory). The plan's decisions depend on values in two places only: whether a norm's β is all
    zero (then there is no β to fold or keep) and whether a tied head still holds its original table (the
    crmsnorm target re-ties it). A model without values (on the meta device: `normfold.stream`) carries a
    tensor source that answers from the checkpoint instead (`ConversionPlan.values`)."""

    def is_zero(self, name: str, t: torch.Tensor | None) -> bool:
        """Is the parameter `name` (holding `t`; None: absent) all zero?"""
        return t is None or not bool(t.detach().ne(0).any())

    def head_unchanged(self, name: str, weight: torch.Tensor, original: torch.Tensor) -> bool:
        """Does the head weight `name` still hold the original tied table `original`?"""
        return torch.equal(weight, original)


IN_MEMORY = TensorValues()


def values_of(plan: ConversionPlan) -> TensorValues:
    """The tensor source that answers `plan`'s value questions (the tensors themselves unless the plan names one)."""
    return getattr(plan, "values", None) or IN_MEMORY


def _reader_bias(reader: nn.Module) -> torch.Tensor | None:
    lay = algebra.layout_of(reader)
    return getattr(reader, lay.bias, None) if lay.bias else None


def fold_decision(site: NormSite, readers: list[nn.Module], fold: bool, has_gamma: bool, has_beta: bool,
                  options: ConvertOptions) -> tuple[bool, bool]:
    """(fold γ, fold β) of the norm at `site` read by the modules `readers`: `fold` (`will_fold`) and every reader
    a linear or conv reader; β only where every reader has a bias to take it (or its β term cancels, or
    `allow_new_bias`); γ alone only when no β stays behind (the norm would then have to output n + β/γ). The one
    rule both the conversion (`swap_norm`) and the streamed plan (which needs it before any value is read) use."""
    fold = fold and bool(readers) and all(algebra.is_linear_reader(r) or algebra.is_conv_reader(r) for r in readers)
    cancels = set(site.beta_cancels)  # bias-less readers whose β term cancels (keys before softmax)
    fold_beta = fold and has_beta and (
        options.allow_new_bias or all(_reader_bias(r) is not None or p in cancels
                                      for p, r in zip(site.readers, readers)))
    fold_gamma = fold and has_gamma and (not has_beta or fold_beta)
    return fold_gamma, fold_beta


def swap_norm(model: nn.Module, site: NormSite, fold: bool, options: ConvertOptions,
              norm_cls: type[nn.Module] = RMSNorm,
              values: TensorValues = IN_MEMORY) -> tuple[NormRecord, int, list[str]]:
    """Replace the LayerNorm at `site` by `norm_cls`, folding its affine into the readers if `fold`
    (`fold_decision`); `values` says whether β is all zero (`TensorValues`).

    Returns (record, tensors edited, modules that grew a bias)."""
    ln = get(model, site.path)
    if not is_layernorm(ln):
        raise UnsupportedConversionError(
            f"{site.path} is a {type(ln).__name__}, not a LayerNorm; the adapter's plan does not match this model")
    if len(ln.normalized_shape) != 1:
        raise UnsupportedConversionError(f"{site.path} normalizes over {tuple(ln.normalized_shape)}; "
                                         "only last-dimension norms can be converted")
    gamma = ln.weight
    beta = None if values.is_zero(f"{site.path}.bias", getattr(ln, "bias", None)) else ln.bias
    readers = [get(model, r) for r in site.readers]
    edited, grown = 0, []
    cancels = set(site.beta_cancels)
    fold_gamma, fold_beta = fold_decision(site, readers, fold, gamma is not None, beta is not None, options)
    if fold_gamma or fold_beta:
        for path, reader in zip(site.readers, readers):
            lay = algebra.layout_of(reader)
            w = getattr(reader, lay.weight)
            b = _reader_bias(reader)
            drop = fold_beta and b is None and path in cancels  # βW is constant per softmax row: dropped
            if algebra.is_conv_reader(reader):  # a conv over the norm's channels, no zero padding
                new_w, new_b = algebra.fold_affine_conv(w, b, gamma if fold_gamma else None,
                                                        beta if fold_beta else None, reader.groups)
            else:
                new_w, new_b = algebra.fold_affine(w, b, gamma if fold_gamma else None,
                                                   beta if fold_beta and not drop else None, lay.in_dim)
            _set(w, new_w)
            edited += 1
            if new_b is not None and b is None:
                setattr(reader, lay.bias, nn.Parameter(new_b, requires_grad=w.requires_grad))
                grown.append(path)
                edited += 1
            elif new_b is not None and fold_beta:
                _set(b, new_b)
                edited += 1
    keep_w = gamma is not None and not fold_gamma
    keep_b = beta is not None and not fold_beta
    new = norm_cls.from_layernorm(ln, keep_weight=keep_w, keep_bias=keep_b)
    parent, leaf = parent_and_leaf(model, site.path)
    setattr(parent, leaf, new)
    record = NormRecord(name=site.path, type=norm_cls.__name__, eps=float(ln.eps), weight=keep_w, bias=keep_b,
                        folded_into=list(site.readers) if (fold_gamma or fold_beta) else [],
                        stock_weight=ln.weight is not None, stock_bias=getattr(ln, "bias", None) is not None)
    return record, edited, grown


# ---- the rmsnorm variant ---------------------------------------------------------------------------

def edited_params(model: nn.Module, plan: ConversionPlan, options: ConvertOptions) -> list[nn.Parameter]:
    params: list[nn.Parameter] = []
    for stream in plan.streams:
        for w, scale in stream.scale_folds:
            params += _params_of(model, w) + _params_of(model, scale)
        for w in stream.writers:
            params += _params_of(model, w)
        for site in stream.norms:
            if will_fold(site, options):
                for r in site.readers:
                    params += _params_of(model, r)
    return params


def will_fold(site: NormSite, options: ConvertOptions) -> bool:
    return not options.keep_affine and bool(site.readers) and (not site.final or options.fold_final)


def apply_rmsnorm(model: nn.Module, plan: ConversionPlan, options: ConvertOptions,
                  report: ConversionReport) -> None:
    """Pre-LN -> Pre-RMSNorm on `model` in place (paper 001 §3.1), recording what was done."""
    structure = report.structure
    rewritten = recentre_tied_tables(model, plan, options)
    if rewritten is not plan:  # a caller that did not rewrite its plan first (convert and stream do): the note too
        report.notes += [n for n in rewritten.notes if n not in report.notes]
    plan = rewritten
    ties = None if options.untie else tie_groups(model, plan)  # before any edit: original row means, γ
    structure.untied = untie(model, edited_params(model, plan, options))
    edited = 0
    for stream in plan.streams:
        edited += fold_scales(model, stream.scale_folds)  # before centring: centre W·diag(λ), not W
        for path in stream.writers:
            edited += center_writer_at(model, path)
            report.centered.append(path)
        for site in stream.norms:
            record, n, grown = swap_norm(model, site, will_fold(site, options), options, values=values_of(plan))
            structure.norms.append(record)
            structure.added_bias += grown
            edited += n
    # Hooks go on the final modules, after every swap: a Recenter after a norm (BLOOM's embedding
    # norm, CLIP's pre_layrnorm) must survive that norm's swap. io.apply_structure replays this order.
    for stream in plan.streams:
        for path in stream.recenter_after:
            add_output_recenter(get(model, path))
            structure.recenter_after.append(path)
        for path in stream.recenter_before:
            add_input_recenter(get(model, path))
            structure.recenter_before.append(path)
    report.tensors_edited = edited
    if ties is not None and structure.untied:
        keep_ties(model, plan, ties, report)
    # A stream Recenter does not stop a stock load: there every norm is a LayerNorm again (γ 1 / β 0 where
    # folded), LN(x) = LN(x − mean x), and the stream is read only by its norms, so the Recenter changes
    # only hidden-state outputs, by a per-token constant (tests/test_stock_recenter.py, every family).
    # An added bias (absent from the stock module) or an nn.TiedHead (the row-mean term) does stop it.
    if structure.added_bias or structure.tied_heads:
        report.stock_reloadable = False


# ---- tied embedding / head: the table stays the original, its output is re-centred ------------------------

def _tied_tables(model: nn.Module, plan: ConversionPlan, options: ConvertOptions, shared: bool = False) -> list[str]:
    """The paths of the centred embedding tables of `plan` that share their
    weight with a plain linear head the conversion leaves as it is (not folded into, not scaled), or, with
    `shared`, with another embedding table only (no head). Decided
    from the plan, the options and parameter identity only (no values: meta models too)."""
    writers = {w for st in plan.streams for w in st.writers}
    edited = {r for st in plan.streams for site in st.norms if will_fold(site, options) for r in site.readers}
    edited |= {p for st in plan.streams for pair in st.scale_folds for p in pair}
    by_id: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(p), []).append(name)
    modules = dict(model.named_modules(remove_duplicate=False))  # every path a parameter name above starts with
    out: list[str] = []
    for names in by_id.values():
        if len(names) < 2:
            continue
        tables, heads, ok = [], [], True
        for name in names:
            path, _, leaf = name.rpartition(".")
            module = modules[path]
            if leaf == "weight" and isinstance(module, nn.Embedding) and path not in edited and name not in edited:
                tables.append(path)
            elif (leaf == "weight" and _is_plain_linear(module) and path not in edited and name not in edited
                    and path not in writers):
                heads.append(path)
            else:
                ok = False
        centred = [t for t in tables if t in writers]
        if ok and (heads or (shared and len(tables) > 1)) and centred:
            out += [t for t in centred if t not in out]
    return out


def recentre_tied_tables(model: nn.Module, plan: ConversionPlan, options: ConvertOptions) -> ConversionPlan:
    """The plan with every tied embedding table that a head reads unchanged (`_tied_tables`) moved from the
    stream's writers to its `recenter_after`: the table stays the original tensor, still shared with the stock
    head (logits are the original GEMM, no correction, no extra parameter), and an explicit Recenter after the
    embedding makes its output zero-mean (Recenter(E[ids]) = (E·C)[ids], the centred table's rows, exactly in
    real arithmetic). Applies to `--to rmsnorm` without `untie` (Pre-CRMSNorm, rotation and --untie untie the
    head first); a head the final norm's γ is folded into (fold_final) keeps the nn.TiedHead form. Idempotent:
    a plan already rewritten has no tied table among its writers. `normfold.stream` calls it on its plan too,
    so both paths make the same edits. Each target says how it keeps the tie (`Variant.keep_ties`: this
    Recenter form for rmsnorm; Pre-CRMSNorm compresses after the summed embeddings instead, where it can)."""
    variant = VARIANTS.get(options.to or "rmsnorm")
    if options.untie or variant is None or variant.keep_ties is None:
        return plan
    moved = _tied_tables(model, plan, options, shared=variant.keep_shared_tables)
    if not moved:
        return plan
    return variant.keep_ties(model, plan, options, moved)


def recenter_tied_tables_after(model: nn.Module, plan: ConversionPlan, options: ConvertOptions,
                               moved: list[str]) -> ConversionPlan:
    """rmsnorm's `Variant.keep_ties`: the tied tables `moved` leave the writers for `recenter_after`."""
    plan = copy.copy(plan)
    plan.streams = [dataclasses.replace(
        st, writers=[w for w in st.writers if w not in moved],
        recenter_after=list(st.recenter_after) + [t for t in st.writers if t in moved and t not in st.recenter_after])
        for st in plan.streams]
    plan.notes = list(plan.notes) + [
        f"{TIE_NOTE}: the table stays the original (uncentred) tensor shared with the stock head; "
        f"its output is re-centred instead (Recenter after {', '.join(moved)}), so the logits are the original GEMM "
        "with no correction term and no extra parameter. Stock transformers computes the same logits without the "
        "Recenter (its LayerNorms re-centre their input); normfold.load re-attaches it. --untie (untie=True) "
        "writes the untied form (centred table copied into the head) instead"]
    return plan


# ---- tied embedding / head: kept tied (nn.TiedHead) ---------------------------------------------------

@dataclass
class TieGroup:
    """Parameter names sharing one tensor before the conversion, with what keep_ties needs to re-tie them."""

    names: list[str]
    row_means: torch.Tensor | None = None  # float64 row means of the original table (embedding groups)
    gammas: dict = field(default_factory=dict)  # head module path -> γ of the norm it reads (float64 copy)


def _module_and_leaf(model: nn.Module, name: str) -> tuple[str, nn.Module, str]:
    head, _, leaf = name.rpartition(".")
    return head, (get(model, head) if head else model), leaf


def _is_plain_linear(module: nn.Module) -> bool:
    return isinstance(module, nn.Linear) and type(module).forward is nn.Linear.forward


@dataclass
class Ties:
    groups: list[TieGroup]
    configs: list  # configs with tie_word_embeddings set before the conversion


def tie_groups(model: nn.Module, plan: ConversionPlan) -> Ties:
    """Every group of parameter names sharing one tensor, before the conversion edits any of them."""
    by_id: dict[int, list[str]] = {}
    params: dict[int, nn.Parameter] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(p), []).append(name)
        params[id(p)] = p
    sites = {r: site for st in plan.streams for site in st.norms for r in site.readers}
    groups = []
    for pid, names in by_id.items():
        if len(names) < 2:
            continue
        group = TieGroup(list(names))
        p = params[pid]
        if p.dim() == 2 and p.is_floating_point():
            group.row_means = p.detach().double().mean(dim=-1)
            for name in names:
                path, module, leaf = _module_and_leaf(model, name)
                site = sites.get(path)
                if leaf == "weight" and _is_plain_linear(module) and site is not None:
                    ln = get(model, site.path)
                    if getattr(ln, "weight", None) is not None:
                        group.gammas[path] = ln.weight.detach().double().clone()
        groups.append(group)
    return Ties(groups, _tied_configs(model))


def _edit_kinds(plan: ConversionPlan, structure: Structure) -> dict[str, str]:
    """What the conversion did to each module / parameter path it touched: 'centred' (a stream writer),
    'scaled' (a writer or multiplier of a scale fold), 'folded' (a reader that took a norm's γ/β, or grew a
    bias). Decided from the plan and the records alone, so it works on meta tensors (normfold.stream)."""
    kinds: dict[str, str] = {}
    for st in plan.streams:
        for w in st.writers:
            kinds[w] = "centred"
        for w, scale in st.scale_folds:
            kinds[w] = kinds[scale] = "scaled"
    for rec in structure.norms:
        for r in rec.folded_into:
            kinds[r] = "folded"
    for r in structure.added_bias:
        kinds[r] = "folded"
    return kinds


def _kind(kinds: dict[str, str], name: str) -> str:
    path = name.rpartition(".")[0]
    return kinds.get(name) or kinds.get(path) or "none"


def keep_ties(model: nn.Module, plan: ConversionPlan, ties: "Ties", report: ConversionReport) -> None:
    """Undo the untying of `apply_rmsnorm` without changing the function (in place). A table whose head the
    conversion leaves as it is never gets here: `recentre_tied_tables` kept it the original, untouched and
    still tied (a Recenter after the embedding instead); what is left is a head that was edited (fold_final).

    A group that no edit changed is simply shared again (bias pairs, tables that were not edited). A
    table tied to heads: every embedding alias shares the centred table E' again (one the plan does
    not centre, such as BART's `shared` that only hands the tensor to encoder and decoder, too), and
    every head alias (a plain nn.Linear) becomes an `nn.TiedHead` computing its original output from E'
    plus the row means that centring removed (and the folded γ where the final norm's affine was folded
    into the head). Anything else stays untied (the plain form) with a note. The decisions read the plan
    and the records only (no values), so normfold.stream makes the same ones on meta tensors."""
    from .nn import TiedHead

    structure = report.structure
    kinds = _edit_kinds(plan, structure)
    folded = {r: rec for rec in structure.norms for r in rec.folded_into}
    retied: set[str] = set()
    for group in ties.groups:
        if not any(n in structure.untied for n in group.names):
            continue
        edits = {n: _kind(kinds, n) for n in group.names}
        if all(k == "none" for k in edits.values()):
            first = get(model, group.names[0])
            for name in group.names[1:]:
                parent, leaf = parent_and_leaf(model, name)
                setattr(parent, leaf, first)
            retied.update(group.names)
            continue
        tables, heads, other = [], [], []
        for name in group.names:
            path, module, leaf = _module_and_leaf(model, name)
            if leaf == "weight" and isinstance(module, nn.Embedding) and edits[name] in ("none", "centred"):
                tables.append((name, path))
            elif leaf == "weight" and _is_plain_linear(module) and edits[name] in ("none", "folded"):
                heads.append((name, path))
            else:
                other.append(name)
        centred = [t for t in tables if edits[t[0]] == "centred"]
        if other or not centred or (heads and group.row_means is None):
            report.notes.append(f"tied parameters {', '.join(group.names)} stay untied: normfold keeps a tie only "
                                "between centred embedding tables and plain linear heads")
            continue
        tables = centred + [t for t in tables if t not in centred]
        canon = get(model, tables[0][0])
        for name, _ in tables[1:]:
            parent, leaf = parent_and_leaf(model, name)
            setattr(parent, leaf, canon)
        table_path = tables[0][1]
        table = get(model, table_path)
        for name, path in heads:
            head = get(model, path)
            rec = folded.get(path)
            gamma = group.gammas.get(path) if (rec is not None and not rec.weight and rec.stock_weight) else None
            new = TiedHead(table, tied_head_shift(group.row_means, canon),
                           None if gamma is None else gamma.to(canon.dtype), head.bias)
            parent, leaf = parent_and_leaf(model, path)
            setattr(parent, leaf, new)
            structure.tied_heads.append({"head": path, "table": table_path, "scale": gamma is not None,
                                         "bias": head.bias is not None})
        retied.update(group.names)
    structure.untied = [n for n in structure.untied if n not in retied]
    if not structure.untied:
        enable_weight_tying(model, ties.configs)
    if structure.tied_heads:
        heads = ", ".join(f"{t['head']} -> {t['table']}" for t in structure.tied_heads)
        vocab = ", ".join(str(get(model, t["head"]).out_features) for t in structure.tied_heads)
        report.notes.append(
            f"tied embedding/head kept tied ({heads}): the head reads the centred table plus its row means "
            f"(nn.TiedHead, {vocab} numbers) instead of an untied copy; the checkpoint loads with normfold.load "
            "only. --untie (untie=True) writes the untied plain-transformers form that stock transformers reloads")


def tied_head_shift(row_means: torch.Tensor, centred: torch.Tensor) -> torch.Tensor:
    """TiedHead's `mean`: what each row of the table lost, the original float64 row mean minus what is left
    of it in the rounded centred table (float64, rounded once to the table's dtype)."""
    return (row_means - centred.detach().double().mean(dim=-1)).to(centred.dtype)


def _tied_configs(model: nn.Module) -> list:
    out = {}
    for module in model.modules():
        cfg = getattr(module, "config", None)
        if cfg is not None:
            for c in [cfg, *_sub_configs(cfg)]:
                if getattr(c, "tie_word_embeddings", False):
                    out[id(c)] = c
    return list(out.values())


def enable_weight_tying(model: nn.Module, configs: list) -> None:
    """Tell transformers the embeddings are tied again (undoes disable_weight_tying on `configs`)."""
    for c in configs:
        c.tie_word_embeddings = True
    for module in model.modules():
        if hasattr(module, "get_expanded_tied_weights_keys") and hasattr(module, "all_tied_weights_keys"):
            try:
                module.all_tied_weights_keys = module.get_expanded_tied_weights_keys(all_submodels=False)
            except (ValueError, AttributeError):  # a head's weight is now the TiedHead's view of the table
                pass


register_variant(Variant("rmsnorm", "Pre-LN -> Pre-RMSNorm: zero-mean stream, LayerNorm -> RMSNorm (exact)",
                         apply_rmsnorm, keep_ties=recenter_tied_tables_after))


def centered_outputs(plan: ConversionPlan) -> tuple[str, ...]:

    return tuple(CENTERED_OUTPUTS) + tuple(plan.centered_outputs)


# ---- public entry point -------------------------------------------------------------------------------

def _dropout_warning(model: nn.Module) -> str | None:
    if not model.training:
        return None
    ps = sorted({m.p for m in model.modules() if isinstance(m, nn.Dropout) and m.p > 0})
    if not ps:
        return None
    return (f"the input model was in training mode with active dropout (p={', '.join(map(str, ps))}): the "
            "converted model is returned in eval mode and is equivalent only in eval mode; dropout on a "
            "residual branch breaks the zero-mean stream, so its training forward is not equivalent.")


def kept_norms(layernorms: list[str], plan: ConversionPlan, converted: set[str]) -> list[dict]:
    """The LayerNorms of the original (`layernorms`, `layernorm_names`) the conversion left as they are, with why."""
    reasons = {k.path: k.reason for k in plan.kept}
    kept = []
    for name in layernorms:
        if name in converted:
            continue
        kept.append({"name": name, "reason": reasons.get(
            name, "not on a residual stream described by the adapter (its input is not provably zero-mean)")})
    return kept


def new_report(architecture: str, dtype: torch.dtype, layernorms: list[str], adapter: Adapter, plan: ConversionPlan,
               options: ConvertOptions) -> ConversionReport:
    """The report a conversion by `plan` starts from (both executors: `convert`, `stream_convert`), of a model of
    class `architecture` computing in `dtype` (`working_dtype`) with the LayerNorms `layernorms` (`layernorm_names`)."""
    return ConversionReport(variant=options.to, adapter=adapter.name, architecture=architecture,
                            dtype=str(dtype).replace("torch.", ""), layernorms_total=len(layernorms),
                            stock_reloadable=plan.stock_reloadable, notes=list(plan.notes),
                            centered_outputs=list(centered_outputs(plan)), options=options.to_record())


def finish_report(report: ConversionReport, layernorms: list[str], plan: ConversionPlan) -> None:
    """What a report says once the variant has run (both executors): which of the original's LayerNorms
    `layernorms` were kept, and why. (Each executor sets `report.size`, `sizes.size_report`, from the sizes it
    measured before any edit.)"""
    report.kept = kept_norms(layernorms, plan, {r.name for r in report.structure.norms})


def not_verified(variant: Variant, dtype: str) -> dict:
    """The `verification` entry of a variant that changes the model's function on purpose."""
    return {"performed": False, "passed": None, "dtype": dtype, "max_abs_error": None, "max_rel_error": None,
            "top1_agreement": None, "fp64": None,
            "reason": f"{variant.name} is not output-exact ({variant.description}); no float64 equivalence check "
                      "was run"}


def convert(model: nn.Module, to: str | None = None, *, options: ConvertOptions | None = None,
            keep_affine: bool | None = None, fold_final: bool | None = None, allow_new_bias: bool | None = None,
            pad: bool | None = None, variant_options: dict | None = None, adapter: Adapter | None = None,
            inplace: bool = False, verify: bool = True, inputs: dict | None = None, fp64_tol: float = 1e-9,
            progress: Progress | None = None, auto: bool = False, rotate: str | None = None,
            rotate_seed: int | None = None, rotate_online: bool | None = None, untie: bool | None = None,
            rotate_attention: str | None = None, fast: bool = True,
            discard_original: bool = False) -> tuple[nn.Module, ConversionReport]:
    """Convert `model` and return (converted model in eval mode, report).

    The original is not modified unless `inplace=True`. With `verify=True` (default) both models
    are run on `inputs` (default: the adapter's example inputs) in float64 and in the working
    dtype, and the numbers go to `report.verification`; failing verification does not raise here
    (see `report.verification["passed"]`; the CLI exits 1). A variant that is not output-exact
    (`Variant.exact` False, e.g. "un") is not verified: the report says so (`performed: false`).

    Without `adapter`, the registered adapter of the model's family is used; a model without one (or any
    model with `auto=True`) gets the plan `normfold.analyze` derives, traced on `inputs` (default: made
    from the config's modality, see `normfold.analysis.autoplan`).

    How to convert is `options` (a `normfold.ConvertOptions`) or its fields as keywords (`to`,
    `keep_affine`, `fold_final`, `allow_new_bias`, `pad`, `untie`, `rotate`, `rotate_seed`, `rotate_online`,
    `variant_options`); a keyword overrides the
    object's field. Defaults: to="rmsnorm", γ/β folded into readers, final norms kept.
    `rotate` ("hadamard" or "orthogonal", seeded by `rotate_seed`): after the Pre-RMSNorm conversion with
    every γ folded (final norms into their heads), rotate each residual stream by an orthogonal Q that
    fixes the all-ones direction (`normfold.rotate`); refused with the reason where it cannot be exact.
    `rotate_online`: also an online Hadamard before every MLP down-projection (exact; the checkpoint then
    needs `normfold.load`).
    `rotate_attention` (needs `rotate`): "vo" rotates V and O per head in the weights (exact, nothing added),
    "online" adds an online Hadamard before every attention output projection (needs `normfold.load`), "both";
    "qk" rotates queries and keys per head (in the weights; after the rotary positions at run time for rotary
    families, which then need `normfold.load`), "all" = both + qk.

    A head tied to an embedding table stays tied (loads with normfold.load): the table stays the original
    tensor, the head the stock Linear reading it, and a Recenter after the embedding centres its output
    (`recentre_tied_tables`); a head that takes the final norm's γ (`fold_final`) reads the centred table
    plus its row means instead (`nn.TiedHead`). `untie=True` gives the head its own copy of the table
    (plain `transformers` form, stock-reloadable, V×d more parameters).

    `fast` (default True) applies `normfold.fastpath` to the result, as `normfold.load` does: the
    residual add fused with the next norm in supported blocks, padded Pre-CRMS writers, bfloat16 `nn.TiedHead`s
    packed into one GEMM (`nn.TiedHead.pack`). They change
    how the model computes (rounding only), not its parameters; fast=False leaves them out.

    `discard_original` (the CLI): the caller will not use `model` again, so verification casts it to float64 in
    place and re-converts it there instead of copying it (`verify.verify_conversion(consume_original=True)`):
    peak memory 3x a float32 model instead of 5x; `model` is left converted, in float64.
    """
    options = conversion_options(options, to=to, keep_affine=keep_affine, fold_final=fold_final,
                                 allow_new_bias=allow_new_bias, pad=pad, variant_options=variant_options, untie=untie,
                                 rotate=rotate, rotate_seed=rotate_seed, rotate_online=rotate_online,
                                 rotate_attention=rotate_attention)
    variant = variant_for(options, model)
    keywords = dict(adapter=adapter, inplace=inplace, verify=verify, inputs=inputs, fp64_tol=fp64_tol,
                    progress=progress, auto=auto, fast=fast, discard_original=discard_original)
    if variant.executor is not None:  # a target with its own executor (the reverse conversions: Variant.executor)
        return variant.executor(model, variant, options, **keywords)
    return convert_by_plan(model, variant, options, **keywords)


def convert_by_plan(model: nn.Module, variant: Variant, options: ConvertOptions, *, adapter: Adapter | None,
                    inplace: bool, verify: bool, inputs: dict | None, fp64_tol: float, progress: Progress | None,
                    auto: bool, fast: bool, discard_original: bool) -> tuple[nn.Module, ConversionReport]:
    """The executor of every target that applies an adapter's plan: plan -> execute -> report -> verify, each a
    function below (keywords as `convert`)."""
    say = progress or (lambda msg: None)
    t0 = time.perf_counter()
    # what the steps read of the original, once and before any edit (`inplace` edits it): its sizes (the report)
    # and the dtype it computes in (the analysis' inputs, the report, the verification)
    before, dtype = measure(model), working_dtype(model)
    adapter, plan, inputs = plan_conversion(model, options, adapter, dtype, auto=auto, inputs=inputs, say=say)
    target, original, report = execute(model, adapter, plan, variant, options, dtype, inplace=inplace, keep=verify,
                                       fast=fast, say=say)
    report.seconds["convert"] = round(time.perf_counter() - t0, 3)
    if not variant.exact:
        report.verification = not_verified(variant, report.dtype)
    elif verify:
        t1 = time.perf_counter()
        say("verifying (float64 and working dtype)")
        report.verification = verify_step(original, target, adapter, plan, variant, options, report, inputs, dtype,
                                          fp64_tol=fp64_tol, consume_original=discard_original and not inplace)
        report.seconds["verify"] = round(time.perf_counter() - t1, 3)
    report.size = size_report(before, target)  # the converted model is not changed by the verification
    return target, report


# ---- the steps of convert() ------------------------------------------------------------------------------

def conversion_options(options: ConvertOptions | None, **keywords) -> ConvertOptions:
    """Step 1: the options object with the keywords laid over it, γ/β folded by default, every combination checked."""
    options = resolve_options(options, "normfold.convert", **keywords)
    options = options.replace(keep_affine=bool(options.keep_affine))
    if options.to not in VARIANTS:
        raise UnsupportedConversionError(f"unknown conversion target {options.to!r}; available: {', '.join(VARIANTS)}")
    return options.check()  # every rule on combinations; with rotate: fold_final and untie set


def plan_conversion(model: nn.Module, options: ConvertOptions, adapter: Adapter | None, dtype: torch.dtype, *,
                    auto: bool, inputs: dict | None, say: Progress) -> tuple[Adapter, ConversionPlan, dict | None]:
    """Step 2: the family's adapter (`adapters.adapter_for`), or for a model without one (or with `auto`) the plan
    the analysis derives from `inputs` (default: made from the config's modality) made as it traces them, floating
    inputs in `dtype` (`adapters.examples.trace_inputs`); the adapter's checks, and the plan with the tie the
    options keep (`recentre_tied_tables`). Returns (adapter, plan, inputs as traced)."""
    if adapter is None and not auto:
        adapter = adapter_for(model)
    if adapter is None:  # the analysis' plan: no adapter is registered, or auto=True
        from .analysis.autoplan import adapter_from_inputs

        traced = trace_inputs(model, inputs, dtype)
        adapter, _ = adapter_from_inputs(model, traced, progress=say)
        if inputs is not None:
            inputs = traced  # as traced: forward kwargs, floating inputs in the model's dtype
    if adapter.check is not None:
        adapter.check(model)
    check_finite(model)
    return adapter, recentre_tied_tables(model, adapter.plan(model), options), inputs


def execute(model: nn.Module, adapter: Adapter, plan: ConversionPlan, variant: Variant, options: ConvertOptions,
            dtype: torch.dtype, *, inplace: bool, keep: bool, fast: bool,
            say: Progress) -> tuple[nn.Module, nn.Module, ConversionReport]:
    """Step 3, the in-memory executor: the variant applies the plan to a copy of `model` (to `model` itself with
    `inplace`; then a copy of the original is kept if `keep`) and the report is filled, but for its sizes
    (`convert_by_plan`). `dtype`: the original's `working_dtype`. Returns (converted, original, report)."""
    warn = _dropout_warning(model)
    layernorms = layernorm_names(model)  # read before any edit (`inplace` edits `model`)
    report = new_report(type(model).__name__, dtype, layernorms, adapter, plan, options)
    if warn:
        report.warnings.append(warn)
    original = model
    if inplace and keep:
        original = copy.deepcopy(model)
    target = model if inplace else copy.deepcopy(model)
    say(f"rewriting weights ({adapter.display_name} adapter, {len(plan.streams)} stream(s))")
    variant.apply(target, plan, options, report)
    target.eval()
    if fast:
        from . import fastpath

        fastpath.apply(target)
    target.normfold_report = report  # what the reverse conversions (compress/reverse.py) read back
    finish_report(report, layernorms, plan)
    return target, original, report


def verify_step(original: nn.Module, target: nn.Module, adapter: Adapter, plan: ConversionPlan, variant: Variant,
                options: ConvertOptions, report: ConversionReport, inputs: dict | None, dtype: torch.dtype, *,
                fp64_tol: float, consume_original: bool) -> dict:
    """Step 4: float64 exactness (the variant re-applied to a float64 copy) and error in the working dtype `dtype`
    against the original (`verify.check_conversion`), on `inputs` or the adapter's example inputs."""
    if inputs is None:
        inputs = adapter.example_inputs(original, torch.Generator().manual_seed(0))

    def reconvert(m: nn.Module) -> nn.Module:
        scratch = ConversionReport(variant=options.to, adapter=adapter.name, architecture="", dtype="",
                                   layernorms_total=0)
        variant.apply(m, adapter.plan(m), options, scratch)
        return m.eval()

    output_map = variant.output_map(report, plan) if variant.output_map is not None else None
    return check_conversion(
        original, target, inputs, dtype=dtype, reconvert=reconvert if variant.exact else None, fp64_tol=fp64_tol,
        centered=centered_outputs(plan), output_map=output_map,
        final_norms=variant.verified_final_norms(report, options), consume_original=consume_original).to_dict()
