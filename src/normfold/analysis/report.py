"""The analysis report: per LayerNorm, foldable or not and why; and the conversion plan it implies."""

from __future__ import annotations

import copy
import json
from dataclasses import asdict, dataclass, field, replace

from torch import nn

from ..adapters.base import Adapter, ConversionPlan, KeptNorm, NormSite, StreamPlan
from .propagate import NormCall, Propagation
from .rules import Multi, NotZeroMean, Zero, ZeroMean

FORMAT_VERSION = 1


@dataclass
class NormReport:
    """One LayerNorm (module, or a functional F.layer_norm call site)."""

    name: str
    foldable: bool
    reason: str
    # Centrable writers its input depends on (all of them when foldable: the converter centres these).
    writers: list[str] = field(default_factory=list)
    readers: list[str] = field(default_factory=list)  # linear modules reading its output
    affine_foldable: bool = False  # γ/β can move into the readers (every consumer is one of them)
    affine_note: str | None = None  # why not, naming the other consumer
    beta_cancels: list[str] = field(default_factory=list)  # bias-less readers whose β term cancels (keys)
    final: bool = False  # its output is (also) a model output
    recenter: list[str] = field(default_factory=list)  # explicit Recenters it relies on (recenter=True)
    # Norms whose output counts as zero-mean only for their current values (γ constant, β = 0): the
    # verdict holds for these weights, not for every value (structural=True refuses it).
    assumes: list[str] = field(default_factory=list)
    module: bool = True  # an nn.LayerNorm module (the converter swaps only those)
    calls: int = 1
    eps: float | None = None
    normalized_shape: list[int] = field(default_factory=list)
    affine: str = ""  # "weight+bias", "weight", "none"


@dataclass
class WriterReport:
    name: str  # module path or parameter name
    op: str
    module: str
    centrable: bool
    problem: str | None = None
    tied_with: list[str] = field(default_factory=list)
    paths: list[str] = field(default_factory=list)
    scales: list[str] = field(default_factory=list)  # multipliers folded into it before centring (LayerScale)


@dataclass
class AnalysisReport:
    architecture: str
    tracer: str
    center_embeddings: bool
    recenter: bool
    structural: bool = False
    norms: list[NormReport] = field(default_factory=list)
    writers: list[WriterReport] = field(default_factory=list)  # centrable writers the foldable norms need
    other_norms: dict[str, int] = field(default_factory=dict)  # non-LayerNorm normalization modules
    stream_outputs: list[str] = field(default_factory=list)  # outputs returned recentred after conversion
    notes: list[str] = field(default_factory=list)
    source: dict = field(default_factory=dict)
    seconds: dict = field(default_factory=dict)
    inputs: dict | None = field(default=None, repr=False, compare=False)  # the traced inputs (not serialized)
    graph: object = field(default=None, repr=False, compare=False)  # the trace (not serialized)

    @property
    def total(self) -> int:
        return len(self.norms)

    @property
    def foldable(self) -> list[NormReport]:
        return [n for n in self.norms if n.foldable]

    def norm(self, name: str) -> NormReport:
        for n in self.norms:
            if n.name == name:
                return n
        raise KeyError(f"no LayerNorm named {name!r} in the report")

    # ---- serialization -------------------------------------------------------------------------
    def to_dict(self) -> dict:
        d = asdict(replace(self, inputs=None, graph=None))
        d.pop("inputs")
        d.pop("graph")
        from .._version import __version__

        return {"format_version": FORMAT_VERSION, "normfold_version": __version__,
                "layernorms": {"total": self.total, "foldable": len(self.foldable)}, **d}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, ensure_ascii=False)

    def table(self, width: int = 100) -> str:
        from ..tables import table

        rows = []
        for n in self.norms:
            readers = _short_list([_relative(r, n.name) for r in n.readers], 1) if n.readers else "-"
            if n.final:
                readers += " (final)"
            rows.append([n.name, "yes" if n.foldable else "no", readers, _clip(_short_reason(n), width)])
        return table(rows, header=["LayerNorm", "foldable", "readers", "why"])

    # ---- the conversion plan ----------------------------------------------------------------------
    def to_plan(self) -> ConversionPlan:
        """A ConversionPlan for normfold's converter: centre the writers the foldable norms rely on, fold
        each norm's affine into its readers where every consumer is linear, keep the rest with the reason."""
        by_name = {w.name: w for w in self.writers}
        writers, recenters, scales = [], [], []
        norms, kept = [], []
        for n in self.norms:
            if not n.module:
                continue
            if not n.foldable:
                kept.append(KeptNorm(n.name, n.reason))
                continue
            for w in n.writers:
                for path in by_name[w].paths:
                    if path not in writers:
                        writers.append(path)
                        scales += [(path, s) for s in by_name[w].scales]
            recenters += [r for r in n.recenter if r not in recenters]
            norms.append(NormSite(n.name, tuple(n.readers) if n.affine_foldable else (), final=n.final,
                                  beta_cancels=tuple(n.beta_cancels) if n.affine_foldable else ()))
        streams = [StreamPlan("analysis", writers=writers, norms=norms, scale_folds=scales)]
        if recenters:  # after the norm swaps: a recentred module may itself be a converted norm
            streams.append(StreamPlan("recenter", recenter_after=recenters))
        notes = [f"plan derived by normfold.analyze ({self.tracer} trace)"]
        tied = sorted({t for w in self.writers if w.name in {x for n in self.foldable for x in n.writers}
                       for t in w.tied_with})
        assumed = sorted({a for n in self.foldable for a in n.assumes})
        if assumed:
            notes.append(f"exact for these weights only: relies on {', '.join(assumed)} having a constant γ and "
                         "β = 0 (analyze with structural=True for a plan that holds for any values)")
        if scales:
            notes.append(f"{len(scales)} per-channel multiplier(s) (LayerScale) folded into their writers and set "
                         f"to 1: {_short_list([s for _, s in scales], 2)}")
        if tied:
            notes.append(f"tied parameters untied so the writers can be centred: {', '.join(tied)}")
        # Stock-reloadable with its Recenters too: the analysis puts one only where the shift walk proved that a
        # per-token constant added to that output reaches norms (LayerNorms again in a stock load, which ignore
        # it: LN(x) = LN(x − c)) and stream outputs only (returned up to that constant: centered_outputs), the
        # condition an adapter's plan states for its own Recenters (tests/test_stock_recenter.py checks both).
        return ConversionPlan(adapter="analysis", streams=streams, kept=kept, notes=notes,
                              centered_outputs=[_escape(o) for o in self.stream_outputs])

    def to_adapter(self) -> Adapter:
        """An Adapter whose plan is this analysis: `normfold.convert(model, adapter=report.to_adapter())`
        converts a model that has no hand-written adapter (verified like any other conversion)."""
        plan = self.to_plan()
        inputs = dict(self.inputs or {})

        def example_inputs(model, generator):
            if not inputs:
                raise ValueError("this report carries no inputs; pass inputs= to normfold.convert")
            return dict(inputs)

        return Adapter(name="analysis", display_name=f"analysis of {self.architecture}",
                       plan=lambda model: copy.deepcopy(plan), model_classes=(self.architecture,),
                       example_inputs=example_inputs)


# ---- building the report ------------------------------------------------------------------------------

def build_report(prop: Propagation, model: nn.Module, output_names: list[str | None]) -> AnalysisReport:
    opts = prop.options
    report = AnalysisReport(architecture=type(model).__name__, tracer=prop.graph.tracer,
                            center_embeddings=opts.center_embeddings, recenter=opts.recenter,
                            structural=opts.structural)
    groups: dict[str, list[NormCall]] = {}
    for nc in prop.norm_calls:
        groups.setdefault(prop.norm_name(nc.node), []).append(nc)
    for name, calls in groups.items():
        report.norms.append(_norm_report(prop, name, calls))
    called = set(groups)
    for name, module in model.named_modules():
        if isinstance(module, nn.LayerNorm) and name not in called:
            report.norms.append(NormReport(name=name, foldable=False, reason="not called in the traced forward "
                                           "(with these inputs)", eps=module.eps,
                                           normalized_shape=list(module.normalized_shape),
                                           affine=_affine(module.weight, module.bias)))
    needed = {w for n in report.foldable for w in n.writers}
    for key in needed:
        info = prop.writers[key]
        report.writers.append(WriterReport(name=key, op=info.op, module=info.module, centrable=info.centrable,
                                           problem=info.problem, tied_with=list(info.tied_with),
                                           paths=list(info.paths), scales=list(info.scales)))
    report.writers.sort(key=lambda w: prop_order(prop, w.name))
    outputs = set()
    for key in needed:
        outputs |= prop.writers[key].outputs
    for module in {r for n in report.foldable for r in n.recenter}:
        outputs |= prop.recenter_outputs.get(module, frozenset())
    report.stream_outputs = sorted({output_names[i] for i in outputs if i < len(output_names) and output_names[i]})
    report.other_norms = _other_norms(model)
    if not any(isinstance(m, nn.LayerNorm) for m in model.modules()) and not report.norms:
        report.notes.append("no LayerNorm in this model: nothing to fold"
                            + (f" (its norms: {', '.join(f'{k} x{v}' for k, v in report.other_norms.items())})"
                               if report.other_norms else ""))
    for w in report.writers:
        if w.tied_with:
            report.notes.append(f"{w.name} shares its weight with {', '.join(w.tied_with)}: the conversion unties them")
    return report


def prop_order(prop: Propagation, key: str) -> int:
    """Graph position of a writer's first call (writers are listed in the order the model runs them)."""
    order = getattr(prop, "_writer_order", None)
    if order is None:
        order = {}
        for call in prop.calls.values():
            order.setdefault(call.key, call.node.index)
        prop._writer_order = order
    return order.get(key, 1 << 30)


def _norm_report(prop: Propagation, name: str, calls: list[NormCall]) -> NormReport:
    node = calls[0].node
    module = prop.modules.get(node.module)
    is_module = isinstance(module, nn.LayerNorm)
    shape = list(node.arg(1))
    gamma, beta = node.arg(2, "weight"), node.arg(3, "bias")
    verdicts = [_verdict(prop, nc) for nc in calls]
    foldable = all(v[0] for v in verdicts)
    reason = next((v[1] for v in verdicts if not v[0]), verdicts[0][1])
    if len(calls) > 1 and not foldable:
        bad = next(i for i, v in enumerate(verdicts) if not v[0])
        reason = f"call {bad + 1} of {len(calls)}: {reason}"
    writers, recenter, assumes = [], [], []
    for nc in calls:
        s = nc.input_state
        ws = getattr(s, "writers", frozenset())
        writers += [w for w in sorted(ws, key=lambda k: prop_order(prop, k)) if w not in writers]
        if isinstance(s, ZeroMean):
            recenter += [r for r in sorted(s.recenters) if r not in recenter]
            assumes += [a for a in sorted(s.assumes) if a not in assumes]
    readers = list(dict.fromkeys(r for nc in calls for r in nc.readers))
    cancels = [r for r in readers if all(r in nc.beta_cancels for nc in calls if r in nc.readers)]
    final = any(nc.final for nc in calls)
    problem = next((nc.reader_problem for nc in calls if nc.reader_problem), None)
    if not readers and problem is None and not final:
        problem = "its output is not read by any linear module"
    if not is_module and foldable:
        reason += "; it is a functional F.layer_norm call, which the converter cannot swap"
    return NormReport(
        name=name, foldable=foldable, reason=reason, writers=writers,
        readers=readers, affine_foldable=bool(readers) and problem is None, affine_note=problem,
        beta_cancels=cancels,
        final=final, recenter=recenter if foldable else [], assumes=assumes if foldable else [],
        module=is_module, calls=len(calls),
        eps=getattr(module, "eps", None) if is_module else node.arg(4, "eps", 1e-5),
        normalized_shape=shape,
        affine=_affine(getattr(gamma, "value", None) if gamma is not None else None,
                       getattr(beta, "value", None) if beta is not None else None))


def _verdict(prop: Propagation, nc: NormCall) -> tuple[bool, str]:
    s, node = nc.input_state, nc.node
    shape = list(node.arg(1))
    if len(shape) != 1:
        return False, f"it normalizes over the last {len(shape)} dims {tuple(shape)}; only last-dim LayerNorms fold"
    if isinstance(s, NotZeroMean):
        return False, "input includes " + "; ".join(_cause_texts(s.causes))
    if isinstance(s, ZeroMean):
        if s.axis != -1:
            return False, f"its input is zero-mean along dim {s.axis}, not along the normalized last dim"
        k = len(s.writers)
        why = (f"input is zero-mean once {k} writer{'s' if k != 1 else ''} {'are' if k != 1 else 'is'} centred: "
               f"{_short_list(sorted(s.writers, key=lambda w: prop_order(prop, w)), 4)}") if k else \
            "input is zero-mean as is"
        if s.recenters:
            why += f", with an explicit Recenter after {', '.join(sorted(s.recenters))}"
        if s.assumes:
            why += (f"; relies on the current values of {_short_list(sorted(s.assumes), 2)} (γ constant, β = 0), "
                    "not on structure")
        return True, why
    if isinstance(s, Zero):
        return True, "its input is identically zero"
    if isinstance(s, Multi):
        return False, "its input is one of several outputs the analysis cannot tell apart"
    return False, "its input is not a tensor the analysis tracks"


def _cause_texts(causes) -> list[str]:
    """One sentence per cause; dropouts in training mode are merged into one."""
    drops = [c.module for c in causes if c.kind == "dropout"]
    out = [c.text for c in causes if c.kind != "dropout"][:3]
    if drops:
        out.append(f"dropout in training mode in {_short_list(drops, 2)} (random masks break zero mean; analyze "
                   "the model in eval mode: model.eval())")
    return out


def _affine(weight, bias) -> str:
    parts = [p for p, t in (("weight", weight), ("bias", bias)) if t is not None]
    return "+".join(parts) or "none"


def _other_norms(model: nn.Module) -> dict[str, int]:
    out: dict[str, int] = {}
    for m in model.modules():
        name = type(m).__name__
        if "Norm" in name and not isinstance(m, nn.LayerNorm):
            out[name] = out.get(name, 0) + 1
    return out


def _short_list(items, k: int) -> str:
    items = list(items)
    return ", ".join(items[:k]) + (f" +{len(items) - k} more" if len(items) > k else "")


def _short_reason(n: NormReport) -> str:
    if n.foldable:
        why = f"zero-mean once {len(n.writers)} writer(s) are centred" if n.writers else "zero-mean input"
        if n.recenter:
            why += f" + Recenter after {', '.join(n.recenter)}"
        if not n.affine_foldable and n.affine_note and not n.final:
            why += f"; affine stays in the norm ({n.affine_note})"
        return why
    return n.reason


def _relative(path: str, to: str) -> str:
    """`path` without the module prefix it shares with `to` (h.0.attn.c_attn next to h.0.ln_1)."""
    a, b = path.split("."), to.split(".")[:-1]
    k = 0
    while k < min(len(a) - 1, len(b)) and a[k] == b[k]:
        k += 1
    while k > 0 and a[k].isdigit():  # "layer.1.attention...", not "1.attention..."
        k -= 1
    return ".".join(a[k:])


def _clip(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 3] + "..."


def _escape(name: str) -> str:
    """An exact fnmatch pattern for an output name ('[' starts a character class)."""
    return "".join("[[]" if c == "[" else "[]]" if c == "]" else c for c in name)
