"""Fold every offline norm of a model into an adjacent linear layer (paper 004, Algorithm 1).

    fused, report = normfold.fuse_offline_norms(model)   # model: trained, with UnifiedNorm/BN/...

In eval mode an offline norm is z = x·scale + shift with fixed statistics. Each one goes:

1. into the following linear(s) when every module reading its output is a linear layer that reads
   nothing else: W' = diag(scale)·W, b' = b + shift·W;
2. else into the preceding linear when its input is the output of one linear layer feeding nothing
   else: W'[o] = scale[o]·W[o], b' = b·scale + shift;
3. else it stays as a `FixedAffine` (x·scale + shift: no statistics, no division), with the reason.

Who reads a norm's output: the adapter plan where one describes the model (its `NormSite.readers`
list every reader, including ones a trace cannot see, such as a head that gathers rows first);
otherwise a trace, one forward with hooks recording which leaf modules receive the norm's output
(or a view of it) and which module produced its input. A trace cannot see functional consumers (a
residual addition, an output returned to the caller), so the fused model is always compared with
the unfused one in float64; a norm whose fusion changes the outputs is kept, and the report says so.
"""

from __future__ import annotations

import copy
from collections import defaultdict
from dataclasses import asdict, dataclass, field

import torch
from torch import Tensor, nn

from .. import algebra
from ..adapters import example_inputs as adapter_examples
from ..errors import NormfoldError
from ..forward import accepts
from ..nn.offline import FixedAffine, FoldedNorm, OfflineNorm, offline_norms

# Modules that are the identity in eval mode: their output still carries the norm's output.
PASS_THROUGH = (nn.Dropout, nn.Identity)


@dataclass
class Decision:
    name: str
    action: str  # "following" | "preceding" | "keep"
    into: tuple[str, ...] = ()
    source: str = ""  # "adapter plan" | "trace"
    reason: str = ""  # why it was kept


@dataclass
class FusionReport:
    fused: list[dict] = field(default_factory=list)  # {"name", "into", "direction", "source"}
    kept: list[dict] = field(default_factory=list)  # {"name", "reason"}
    untied: list[str] = field(default_factory=list)
    added_bias: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    verification: dict | None = None

    def to_dict(self) -> dict:
        return asdict(self)


# ---- who reads what: the trace ------------------------------------------------------------------------

@dataclass
class Flow:
    readers: list[str] = field(default_factory=list)  # leaf modules that received the norm's output
    preceding: set = field(default_factory=set)  # producers of its input (None: not a module output)
    calls: int = 0
    other: str = ""  # a non-module consumer of its output the static trace saw ("" = none seen)


@dataclass
class Trace:
    flows: dict[str, Flow]
    sources: dict[str, set]  # leaf module -> norms its inputs came from ("" = something else)
    consumers: dict[str, set]  # leaf module -> leaf modules that received its output


def _root(t: Tensor) -> Tensor:
    return t if t._base is None else t._base


def _leaves(model: nn.Module):
    return [(n, m) for n, m in model.named_modules() if n and next(m.children(), None) is None]


def trace(model: nn.Module, inputs: dict, norms: list[str]) -> Trace:
    """One forward (no grad) with hooks: the dataflow between leaf modules around each norm."""
    flows = {n: Flow() for n in norms}
    origin: dict[int, str] = {}  # id(tensor) -> norm whose output it is
    produced: dict[int, str] = {}  # id(tensor) -> leaf module whose output it is
    sources, consumers = defaultdict(set), defaultdict(set)
    alive: list[Tensor] = []  # keeps ids unique while the trace runs

    def pre(name, module):
        def hook(mod, args, kwargs):
            tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, Tensor)]
            for t in tensors:
                key = id(_root(t))
                if isinstance(module, PASS_THROUGH):
                    continue
                src = origin.get(key)
                sources[name].add(src or "")
                if src and name not in flows[src].readers:
                    flows[src].readers.append(name)
                if key in produced:
                    consumers[produced[key]].add(name)
            if name in flows:
                flows[name].calls += 1
                flows[name].preceding.add(produced.get(id(_root(tensors[0]))) if tensors else None)
        return hook

    def post(name, module):
        def hook(mod, args, out):
            if not isinstance(out, Tensor):
                return
            alive.append(out)
            key = id(_root(out))
            if name in flows:
                origin[key] = name
            elif isinstance(module, PASS_THROUGH) and args and isinstance(args[0], Tensor):
                src = origin.get(id(_root(args[0])))
                if src:
                    origin[key] = src
                elif id(_root(args[0])) in produced:
                    produced[key] = produced[id(_root(args[0]))]
            elif algebra.layout_of(module) is not None:
                produced[key] = name
        return hook

    handles = []
    for name, module in _leaves(model):
        handles.append(module.register_forward_pre_hook(pre(name, module), with_kwargs=True))
        handles.append(module.register_forward_hook(post(name, module)))
    try:
        with torch.no_grad():
            _forward(model, inputs)
    finally:
        for h in handles:
            h.remove()
    return Trace(flows, dict(sources), dict(consumers))


class _LeafTracer(torch.fx.Tracer):
    """fx tracer that keeps every leaf module and every offline norm as one call (no inputs needed)."""

    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        return isinstance(m, OfflineNorm) or next(m.children(), None) is None or super().is_leaf_module(m, qualname)


def static_trace(model: nn.Module, norms: list[str]) -> Trace:
    """The same dataflow as `trace`, read from a symbolic (fx) trace: no inputs, no forward pass. Unlike the
    hooks, it also sees functional consumers (a residual add, a returned tensor), so a norm whose output
    or input goes anywhere but modules is not folded that way. Raises when the model is not traceable."""
    graph = _LeafTracer().trace(model)
    flows = {n: Flow() for n in norms}
    sources, consumers = defaultdict(set), defaultdict(set)
    modules = dict(model.named_modules())

    def through(node):  # skip pass-through modules (dropout, identity) backwards
        while node.op == "call_module" and isinstance(modules.get(node.target), PASS_THROUGH) and node.args:
            node = node.args[0]
        return node

    def users(node):  # skip pass-through modules forwards
        for u in node.users:
            if u.op == "call_module" and isinstance(modules.get(u.target), PASS_THROUGH):
                yield from users(u)
            else:
                yield u

    for node in graph.nodes:
        if node.op != "call_module":
            continue
        name = str(node.target)
        for a in node.all_input_nodes:
            a = through(a)
            src = str(a.target) if a.op == "call_module" else ""
            sources[name].add(src if src in flows else "")
            if src:
                consumers[src].add(name)
        if name in flows:
            flow = flows[name]
            flow.calls += 1
            inp = through(node.args[0]) if node.args else None
            producer = str(inp.target) if inp is not None and inp.op == "call_module" else None
            if producer is not None and algebra.layout_of(modules[producer]) is None:
                producer = None
            flow.preceding.add(producer)
            for u in users(node):
                if u.op == "call_module":
                    if str(u.target) not in flow.readers:
                        flow.readers.append(str(u.target))
                elif not flow.other:
                    flow.other = "the model output" if u.op == "output" else f"{u.op} {u.target}"
    # a producer whose output also goes to a function (not a module) has a consumer the hooks never see
    for node in graph.nodes:
        if node.op == "call_module" and algebra.layout_of(modules.get(str(node.target))) is not None:
            for u in users(node):
                if u.op != "call_module":
                    consumers[str(node.target)].add(f"<{u.op} {u.target}>")
    return Trace(flows, dict(sources), dict(consumers))


# ---- deciding where each norm goes --------------------------------------------------------------------

def plan_sites(model: nn.Module) -> dict:
    """Norm sites of the adapter plan describing `model` (empty when no adapter matches)."""
    from ..adapters import find_adapter

    try:
        plan = find_adapter(model).plan(model)
    except (NormfoldError, AttributeError):
        return {}
    return {s.path: s for stream in plan.streams for s in stream.norms}


def _following(model: nn.Module, name: str, flow: Flow, tr: Trace, site) -> tuple[tuple[str, ...], str, str]:
    """(readers, source, reason-if-none) for folding into the readers of `name`'s output."""
    if site is not None and site.readers:
        readers = tuple(site.readers)
        unlisted = [r for r in flow.readers if r not in readers]
        if all(algebra.is_linear_reader(model.get_submodule(r)) for r in readers) and not unlisted:
            return readers, "adapter plan", ""
    if flow.calls == 0:
        return (), "", "the example forward never called it"
    if not flow.readers:
        return (), "", "no module reads its output (it is returned, or goes to a non-module operation)"
    if flow.other:
        return (), "", f"its output also goes to {flow.other}, not a module"
    nonlinear = [r for r in flow.readers if not algebra.is_linear_reader(model.get_submodule(r))]
    if nonlinear:
        kinds = ", ".join(f"{r} ({type(model.get_submodule(r)).__name__})" for r in nonlinear[:3])
        return (), "", f"its output is read by non-linear module(s): {kinds}"
    shared = [r for r in flow.readers if tr.sources.get(r, set()) != {name}]
    if shared:
        return (), "", f"reader(s) {', '.join(shared)} also read other inputs"
    return tuple(flow.readers), "trace", ""


def _preceding(model: nn.Module, name: str, flow: Flow, tr: Trace) -> tuple[str | None, str]:
    if len(flow.preceding) != 1 or None in flow.preceding:
        return None, "its input is not the output of a linear layer (e.g. a residual addition)"
    (prev,) = flow.preceding
    lay = algebra.layout_of(model.get_submodule(prev))
    if lay is None or lay.in_dim is None or lay.bias is None:
        return None, f"its input comes from {prev}, which cannot absorb a shift"
    others = sorted(tr.consumers.get(prev, set()) - {name})
    if others:
        return None, f"the output of {prev} also feeds {', '.join(others)}"
    return prev, ""


def decide(model: nn.Module, tr: Trace, sites: dict, fold_final: bool = True) -> list[Decision]:
    decisions = []
    for name, _ in offline_norms(model):
        site = sites.get(name)
        flow = tr.flows.get(name, Flow())
        if site is not None and site.final and not fold_final:
            decisions.append(Decision(name, "keep", reason="final norm (its output is a model output); "
                                                           "fold_final=True folds it into the heads"))
            continue
        readers, source, why_not_following = _following(model, name, flow, tr, site)
        if readers:
            decisions.append(Decision(name, "following", readers, source))
            continue
        prev, why_not_preceding = _preceding(model, name, flow, tr)
        if prev is not None:
            decisions.append(Decision(name, "preceding", (prev,), "trace"))
            continue
        decisions.append(Decision(name, "keep", reason=f"{why_not_following}; {why_not_preceding}"))
    return decisions


# ---- applying the decisions -----------------------------------------------------------------------------

def _weight_and_bias(module: nn.Module):
    lay = algebra.layout_of(module)
    return lay, getattr(module, lay.weight), (getattr(module, lay.bias, None) if lay.bias else None)


def _store(module: nn.Module, lay, weight: nn.Parameter, bias, new_w: Tensor, new_b: Tensor) -> bool:
    """Write W', b' into `module`; returns True when it had to grow a bias."""
    with torch.no_grad():
        weight.copy_(new_w)
        if bias is not None:
            bias.copy_(new_b)
            return False
    setattr(module, lay.bias, nn.Parameter(new_b.to(weight.dtype), requires_grad=weight.requires_grad))
    return True


def apply_decisions(model: nn.Module, decisions: list[Decision]) -> tuple[list[str], list[str]]:
    """Fold / freeze every offline norm as decided (in place). Returns (untied params, grown biases)."""
    from ..conversion import untie

    edited = [p for d in decisions if d.action != "keep" for path in d.into
              for p in _weight_and_bias(model.get_submodule(path))[1:] if p is not None]
    untied, grown = untie(model, edited), []
    for d in decisions:
        norm = model.get_submodule(d.name)
        scale, shift = norm.inference_affine()
        for path in d.into:
            module = model.get_submodule(path)
            lay, w, b = _weight_and_bias(module)
            if d.action == "following":
                new_w, new_b = algebra.fold_offline_norm(w, b, scale, shift, lay.in_dim)
            else:
                new_w, new_b = algebra.fold_into_writer(w, b, scale, shift, lay.out_dim)
            if _store(module, lay, w, b, new_w, new_b):
                grown.append(path)
        if d.action == "keep":
            new = FixedAffine(norm.num_features, device=scale.device, dtype=norm.running_var.dtype)
            with torch.no_grad():
                new.weight.copy_(scale)
                new.bias.copy_(shift)
        else:
            new = FoldedNorm()
        parent_name, _, leaf = d.name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, leaf, new)
    return untied, grown


# ---- running and checking -------------------------------------------------------------------------------

def _outputs_only(model: nn.Module, inputs: dict) -> dict:
    """The model's default outputs: a fused final norm legitimately changes returned hidden states."""
    out = dict(inputs)
    if accepts(model, "output_hidden_states"):
        out.setdefault("output_hidden_states", False)
    return out


def _forward(model: nn.Module, inputs: dict):
    from ..forward import run_model

    return run_model(model, _outputs_only(model, inputs))


def example_inputs(model: nn.Module, generator: torch.Generator | None = None) -> dict:
    """Inputs for the trace and the check: `normfold.adapters.example_inputs` (the adapter's, else from
    the config: text, images or audio), up to 16 tokens."""
    try:
        return adapter_examples(model, generator, seq=16)
    except NormfoldError as exc:
        raise NormfoldError(f"normfold cannot make example inputs for {type(model).__name__}; pass inputs={{...}} "
                            "(keyword arguments of its forward) to fuse_offline_norms") from exc


def _fp64_error(original64: nn.Module, decisions: list[Decision], inputs: dict, reference: dict) -> float:
    from ..verify import diff_outputs

    fused = copy.deepcopy(original64)
    apply_decisions(fused, decisions)
    diffs = diff_outputs(_forward(fused.eval(), inputs), reference, centered=())
    return max((d.max_rel for d in diffs), default=0.0)


def _demote_failures(original: nn.Module, decisions: list[Decision], inputs: dict, tol: float) -> list[Decision]:
    """Fuse each norm alone in float64; keep the ones whose fusion alone changes the outputs."""
    orig64 = copy.deepcopy(original).to(torch.float64).eval()
    reference = _forward(orig64, inputs)
    out = []
    for d in decisions:
        if d.action != "keep":
            err = _fp64_error(orig64, [d], inputs, reference)
            if not err <= tol:
                d = Decision(d.name, "keep", reason=f"fusing it into {', '.join(d.into)} changed the model's outputs "
                             f"(float64 relative error {err:.1e}): something else reads its output or input")
        out.append(d)
    return out


def _site_input(module: nn.Module, features: int, generator: torch.Generator) -> Tensor:
    return torch.randn(3, 5, features, generator=generator, dtype=torch.float64)


def check_site(original: nn.Module, decision: Decision, seed: int = 0) -> float:
    """Float64 relative error of one fused site on random inputs of that site's shape (no model inputs):
    following: readers(norm(x)) against the fused readers(x); preceding: norm(writer(x)) against the fused
    writer(x). Random inputs exercise every direction, so an exact fold gives ~1e-16."""
    orig = copy.deepcopy(original).to(torch.float64).eval()
    fused = copy.deepcopy(orig)
    apply_decisions(fused, [decision])
    g = torch.Generator().manual_seed(seed)
    norm_o, norm_f = orig.get_submodule(decision.name), fused.get_submodule(decision.name)
    errs = []
    with torch.no_grad():
        if decision.action == "following":
            x = _site_input(norm_o, norm_o.num_features, g)
            for path in decision.into:
                ref = orig.get_submodule(path)(norm_o(x))
                got = fused.get_submodule(path)(norm_f(x))
                errs.append(((got - ref).abs().max() / ref.abs().max().clamp_min(1e-300)).item())
        else:
            (path,) = decision.into
            writer_o = orig.get_submodule(path)
            lay = algebra.layout_of(writer_o)
            x = _site_input(writer_o, getattr(writer_o, lay.weight).shape[lay.in_dim], g)
            ref = norm_o(writer_o(x))
            got = norm_f(fused.get_submodule(path)(x))
            errs.append(((got - ref).abs().max() / ref.abs().max().clamp_min(1e-300)).item())
    return max(errs, default=0.0)


def _fuse_per_site(model: nn.Module, norms: list[str], *, inplace: bool, verify: bool, fp64_tol: float,
                   fold_final: bool, use_plan: bool) -> tuple[nn.Module, FusionReport]:
    """No inputs and none to make: decide from a symbolic trace, fold each norm locally, check each site."""
    try:
        tr = static_trace(model, norms)
    except Exception as exc:  # fx raises many types on untraceable code
        raise NormfoldError(
            f"normfold cannot make example inputs for {type(model).__name__} and cannot trace it symbolically "
            f"({type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}); pass inputs={{...}} "
            "(keyword arguments of its forward) to fuse_offline_norms") from None
    sites = plan_sites(model) if use_plan else {}
    decisions = decide(model, tr, sites, fold_final)
    report = FusionReport()
    checked = []
    if verify:
        out = []
        for d in decisions:
            if d.action != "keep":
                err = check_site(model, d)
                checked.append({"name": d.name, "into": list(d.into), "max_rel_error": err, "passed": err <= fp64_tol})
                if not err <= fp64_tol:
                    d = Decision(d.name, "keep", reason=f"fusing it into {', '.join(d.into)} changed that site's "
                                                        f"output (float64 relative error {err:.1e})")
            out.append(d)
        decisions = out
    target = model if inplace else copy.deepcopy(model)
    report.untied, report.added_bias = apply_decisions(target, decisions)
    target.eval()
    if verify:
        worst = max((c["max_rel_error"] for c in checked if c["passed"]), default=0.0)
        report.verification = {"performed": True, "scope": "per-site", "dtype": "float64", "fp64_tol": fp64_tol,
                               "passed": True, "max_rel_error": worst, "sites": checked}
    report.notes.append("no inputs: each fused site was checked alone on random float64 inputs of its shape; "
                        "pass inputs= for a model-level check")
    for d in decisions:
        if d.action == "keep":
            report.kept.append({"name": d.name, "reason": d.reason})
        else:
            report.fused.append({"name": d.name, "into": list(d.into), "direction": d.action,
                                 "source": "adapter plan" if d.source == "adapter plan" else "static trace"})
    return target, report


def fuse_offline_norms(model: nn.Module, inputs: dict | None = None, *, inplace: bool = False,
                       fold_final: bool = True, verify: bool = True, use_plan: bool = True,
                       fp64_tol: float = 1e-9) -> tuple[nn.Module, FusionReport]:
    """Fold every offline norm (UnifiedNorm, BN/MABN/PN* OfflineNorm) of `model` into its adjacent
    linear layer, in eval mode. Returns (fused model in eval mode, report of what was fused, what
    was kept and why, and the verification: float64 relative error ≤ `fp64_tol` and the error in
    the working dtype). `inputs`: forward kwargs for the trace and the check (default: examples).
    A module normfold cannot make inputs for (a custom nn.Module) is fused without any: its dataflow comes
    from a symbolic trace, each norm is folded locally and each fused site is checked alone on random
    float64 inputs of its shape (`verification["scope"] == "per-site"`).

    fold_final: also fold final norms (adapter plan's `final`) into the heads; the model's returned
        final hidden state is then the un-normalized stream (logits are unchanged).
    """
    norms = [n for n, _ in offline_norms(model)]
    if not norms:
        raise NormfoldError(f"{type(model).__name__} has no offline norms to fuse (UnifiedNorm, OfflineNorm); "
                            "convert its LayerNorms first: normfold.convert(model, to='un'), then fine-tune")
    was_training = model.training
    model.eval()
    if inputs is None:
        try:
            inputs = example_inputs(model)
        except NormfoldError:  # a custom module: fold per site from a symbolic trace, check each site
            target, report = _fuse_per_site(model, norms, inplace=inplace, verify=verify, fp64_tol=fp64_tol,
                                            fold_final=fold_final, use_plan=use_plan)
            if was_training and not inplace:
                model.train()
            return target, report
    original = copy.deepcopy(model) if verify else model  # the unfused reference for the checks
    sites = plan_sites(model) if use_plan else {}
    decisions = decide(model, trace(model, inputs, norms), sites, fold_final)

    def build(decs):
        target = model if inplace else copy.deepcopy(original)
        return target, apply_decisions(target, decs)

    report = FusionReport()
    if verify:
        # A trace cannot see functional readers: check in float64 before touching the model.
        orig64 = copy.deepcopy(original).to(torch.float64)
        err = _fp64_error(orig64, decisions, inputs, _forward(orig64, inputs))
        del orig64
        if not err <= fp64_tol:
            decisions = _demote_failures(original, decisions, inputs, fp64_tol)
    target, (report.untied, report.added_bias) = build(decisions)
    target.eval()
    if verify:
        from ..verify import verify_conversion

        def refuse(m64: nn.Module) -> nn.Module:
            apply_decisions(m64, decisions)
            return m64.eval()

        report.verification = verify_conversion(original, target, _outputs_only(original, inputs), reconvert=refuse,
                                                fp64_tol=fp64_tol, centered=()).to_dict()
    for d in decisions:
        if d.action == "keep":
            report.kept.append({"name": d.name, "reason": d.reason})
        else:
            report.fused.append({"name": d.name, "into": list(d.into), "direction": d.action, "source": d.source})
    final = [d.name for d in decisions if d.action != "keep" and getattr(sites.get(d.name), "final", False)]
    if final:
        report.notes.append(f"final norm(s) {', '.join(final)} folded into the heads: outputs computed from them "
                            "(logits, ...) are unchanged, but a returned final hidden state is now un-normalized")
    if was_training and not inplace:
        model.train()
    return target, report


def checkpoint_report(base, fusion: FusionReport, dtype: str, source: dict):
    """The normfold.json of a fused checkpoint: `base` is the report of the UN checkpoint it came from.
    Its structure (FoldedNorm / FixedAffine per norm, grown biases) is what `normfold.load` replays."""
    from ..report import ConversionReport, NormRecord

    eps = {r.name: r.eps for r in base.structure.norms}
    rep = ConversionReport(variant="un-fused", adapter=base.adapter, architecture=base.architecture, dtype=dtype,
                           layernorms_total=base.layernorms_total, kept=list(base.kept), stock_reloadable=False,
                           warnings=list(base.warnings), source=source, verification=fusion.verification)
    for f in fusion.fused:
        rep.structure.norms.append(NormRecord(name=f["name"], type="FoldedNorm", eps=eps.get(f["name"], 0.0),
                                              weight=False, bias=False, folded_into=list(f["into"])))
    for k in fusion.kept:
        rep.structure.norms.append(NormRecord(name=k["name"], type="FixedAffine", eps=eps.get(k["name"], 0.0),
                                              weight=True, bias=True))
        rep.notes.append(f"{k['name']} kept as a fixed per-channel affine: {k['reason']}")
    rep.structure.added_bias = list(base.structure.added_bias) + list(fusion.added_bias)
    rep.structure.untied = list(base.structure.untied) + list(fusion.untied)
    rep.centered_outputs = []
    rep.notes = [f"{len(fusion.fused)} offline norm(s) folded into adjacent linear layers, {len(fusion.kept)} kept "
                 "as fixed affines"] + rep.notes + list(fusion.notes)
    return rep
