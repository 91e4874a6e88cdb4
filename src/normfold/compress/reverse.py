"""Reverse conversions (paper 001 Appendix C): Pre-CRMSNorm → Pre-RMSNorm → Pre-LN.

- `decompress(model)`: a Pre-CRMSNorm model (from `convert(to="crmsnorm")` or `normfold.load`) back
  to Pre-RMSNorm: each compressed writer gets its last output coordinate back as −Σ of the others
  (every output column of the writer zero-mean again, App. C step 4), each compressed reader a zero
  last input column (App. C step 3 with a_d = 0), StreamCRMSNorm → RMSNorm, the recentre-and-compress
  hooks → Recenter, a tied compressed head → a Linear holding the full table (E' decompressed + m).
- `to_layernorm(model)`: Pre-RMSNorm → Pre-LN: every RMSNorm → LayerNorm with the same eps (γ = 1 /
  β = 0 where the affine was folded away), a head kept tied to the centred table (nn.TiedHead) → the
  stock tied head again (the table gets its row means back; see `untie_heads`), explicit Recenters removed (every reader of the stream
  is now a LayerNorm, which ignores the per-token mean). The result is the stock architecture:
  `save` writes `model.safetensors` that plain transformers loads.

`convert_converted(model, to)` chains these (and the forward conversion, for RMS → CRMS) behind
`normfold.convert(model, to=...)` when `model` is already a normfold model, and verifies the result
against its input like every other conversion (float64 ≤ 1e-9 and working dtype; for a Pre-RMSNorm
input stored in a lower precision the float64 tolerance adds that input's own rounding, see
`input_rounding`).
"""

from __future__ import annotations

import copy
import time

import torch
from torch import nn

from .. import algebra
from ..adapters import find_adapter
from ..adapters.base import get, parent_and_leaf
from ..errors import UnsupportedConversionError
from ..modelinfo import working_dtype
from ..nn import RMSNorm, TiedHead
from ..nn.hooks import add_input_recenter, add_output_recenter
from ..report import ConversionReport, Structure
from ..sizes import measure, size_report
from .runtime import StreamCRMSNorm, TiedCompressedHead, remove_compress_hooks, remove_recenter_hooks, set_param


def source_variant(model: nn.Module) -> str:
    """'crmsnorm', 'rmsnorm' or 'layernorm' (a model without normfold norms)."""
    kinds = {type(m) for m in model.modules()}
    if StreamCRMSNorm in kinds:
        return "crmsnorm"
    if RMSNorm in kinds:
        return "rmsnorm"
    return "layernorm"


def carries_normfold_norms(model: nn.Module) -> bool:
    """Whether `model` is a normfold model (Pre-RMSNorm or Pre-CRMSNorm): the models the reverse conversions claim
    (`Variant.claims`), whatever `to` asks."""
    return source_variant(model) != "layernorm"


def _structure(model: nn.Module) -> Structure:
    report = getattr(model, "normfold_report", None)
    if report is None:
        raise UnsupportedConversionError(
            f"{type(model).__name__} has normfold norms but no conversion record (model.normfold_report): load "
            "it with normfold.load(DIR) or use the model returned by normfold.convert")
    return report.structure


def _restore_last(t: torch.Tensor, dim: int, pad: bool) -> torch.Tensor:
    t64 = t.detach().double().movedim(dim, -1)
    if pad:
        t64 = t64[..., :-1]
    out = torch.cat([t64, -t64.sum(-1, keepdim=True)], dim=-1)
    return out.movedim(-1, dim).to(t.dtype).contiguous()


restore_last = _restore_last  # public for the streamed way back (normfold.stream.reverse): the same bytes


def decompress(model: nn.Module) -> nn.Module:
    """Pre-CRMSNorm → Pre-RMSNorm in place (App. C); returns the model, its structure updated."""
    structure = _structure(model)
    comp = structure.compression
    if not comp:
        raise UnsupportedConversionError("the model has no compression record; is it a Pre-CRMSNorm model?")
    pad = bool(comp.get("pad"))
    # tied heads first: they read the tables before those are decompressed
    for tie in comp.get("tied_heads", []):
        head = get(model, tie["head"])
        if not isinstance(head, TiedCompressedHead):
            continue
        table = _restore_last(head.weight, 1, pad).double() + head.mean.detach().double()[:, None]
        lin = nn.Linear(table.shape[1], table.shape[0], bias=head.bias is not None, dtype=head.weight.dtype)
        with torch.no_grad():
            lin.weight.copy_(table.to(head.weight.dtype))
            if head.bias is not None:
                lin.bias.copy_(head.bias)
        parent, leaf = parent_and_leaf(model, tie["head"])
        setattr(parent, leaf, lin)
    for name, dim in comp.get("writer_params", {}).items():
        set_param(model, name, _restore_last(get(model, name), dim, pad))
    for name, in_dim in comp.get("reader_params", {}).items():
        if not pad:
            set_param(model, name, algebra.decompress_reader(get(model, name), in_dim))
    for rec in structure.norms:
        norm = get(model, rec.name)
        if not isinstance(norm, StreamCRMSNorm):
            continue
        ref = next(norm.parameters(), None)
        new = RMSNorm(norm.width, eps=norm.eps, weight=norm.weight is not None, bias=norm.bias is not None,
                      dtype=ref.dtype if ref is not None else None)
        with torch.no_grad():
            if norm.weight is not None:
                new.weight.copy_(norm.weight)
            if norm.bias is not None:
                new.bias.copy_(norm.bias)  # a compressed bias was restored with the writers
        parent, leaf = parent_and_leaf(model, rec.name)
        setattr(parent, leaf, new)
        rec.type, rec.options = "RMSNorm", {}
    for path in comp.get("compress_after", []) + comp.get("widen_after", []):
        remove_compress_hooks(get(model, path))
    for path in comp.get("compress_before", []) + comp.get("narrow_before", []):
        remove_compress_hooks(get(model, path))
    for path in comp.get("compress_after", []):
        add_output_recenter(get(model, path))
    for path in comp.get("compress_before", []):
        add_input_recenter(get(model, path))
    structure.recenter_after += comp.get("compress_after", [])
    structure.recenter_before += comp.get("compress_before", [])
    structure.compression = {}
    return model


def untie_heads(model: nn.Module, structure: Structure) -> None:
    """Every nn.TiedHead → a stock head, for the Pre-LN model (`to_layernorm`).

    Where the head holds nothing but the row means (no folded γ, no bias the stock head lacks), the tie
    is restored: the table gets its row means back (E' + μ1ᵀ, float64, rounded once) and the head
    becomes a plain nn.Linear sharing it. That adds μ_v to every coordinate of token v's embedding, a
    per-token constant that every reader of the Pre-LN stream (a LayerNorm) ignores, so logits and
    normalized outputs are unchanged and the raw hidden states change by a per-token constant only.
    Otherwise the head becomes an untied nn.Linear holding (E' + μ1ᵀ)·diag γ."""
    from ..conversion import disable_weight_tying

    heads = [(n, m) for n, m in model.named_modules() if isinstance(m, TiedHead)]
    untied = False
    for name, head in heads:
        head.unpack()  # the stock head / table must not stay a view of the runtime buffer
        parent, leaf = parent_and_leaf(model, name)
        if head.scale is None and name not in structure.added_bias:
            table = head._table
            with torch.no_grad():
                full = table.weight.detach().double() + head.mean.detach().double()[:, None]
                table.weight.copy_(full.to(table.weight.dtype))
            w = table.weight
            lin = nn.Linear(w.shape[1], w.shape[0], bias=head.bias is not None, dtype=w.dtype, device=w.device)
            lin.weight = w  # tied again
            if head.bias is not None:
                lin.bias = head.bias  # the same Parameter (aliases such as RoBERTa's lm_head.bias stay shared)
            setattr(parent, leaf, lin)
        else:
            setattr(parent, leaf, head.untied_linear())
            structure.untied += [f"{name}.weight"]
            untied = True
    if untied:
        disable_weight_tying(model)
    structure.tied_heads = []


def to_layernorm(model: nn.Module) -> nn.Module:
    """Pre-RMSNorm → Pre-LN in place: RMSNorm → LayerNorm (same eps), Recenters removed."""
    structure = _structure(model) if getattr(model, "normfold_report", None) is not None else Structure()
    records = {r.name: r for r in structure.norms}
    untie_heads(model, structure)
    for name, module in list(model.named_modules()):
        if type(module) is not RMSNorm:
            continue
        rec = records.get(name)
        affine = rec.stock_weight if rec is not None else True
        bias = rec.stock_bias if rec is not None else True
        if not affine and (module.weight is not None or module.bias is not None):
            affine = bias = True
        ref = next(module.parameters(), None)
        dtype = ref.dtype if ref is not None else working_dtype(model)
        ln = nn.LayerNorm(module.normalized_shape[0], eps=module.eps, elementwise_affine=affine,
                          bias=bias or module.bias is not None, dtype=dtype)
        with torch.no_grad():
            if affine:
                ln.weight.copy_(module.weight if module.weight is not None else torch.ones_like(ln.weight))
            if ln.bias is not None:
                ln.bias.copy_(module.bias if module.bias is not None else torch.zeros_like(ln.bias))
        parent, leaf = parent_and_leaf(model, name)
        setattr(parent, leaf, ln)
    for module in model.modules():
        remove_recenter_hooks(module)
    if getattr(model, "normfold_report", None) is not None:
        structure.norms, structure.recenter_after, structure.recenter_before = [], [], []
    return model


# ---- behind normfold.convert(model, to=...) for a model that is already converted ---------------------

def _centre_inputs(module, args, kwargs):
    centre = (lambda t: t - t.mean(dim=-1, keepdim=True) if isinstance(t, torch.Tensor) else t)
    return tuple(centre(a) for a in args), {k: centre(v) for k, v in kwargs.items()}


def input_rounding(model: nn.Module, inputs: dict, centered) -> float:
    """How far a Pre-RMSNorm `model` stored in float32 / 16 bits is from the zero-mean model its weights
    round: the largest relative change of an output (normwise, as the checks measure it) when a float64
    copy runs with every RMSNorm's input centred exactly, against the same copy as it is.

    Why the reverse conversion's float64 check needs it: `to_layernorm` is exact on a zero-mean stream,
    but the stored weights keep the stream zero-mean only up to their rounding. Centring rounds each
    writer once, so its outputs keep a per-token mean of order ε·|y| (ε the storage dtype's eps; measured
    ~0.15 ε of the stream's rms on a float32 GPT-2). An RMSNorm passes that mean on, as a component
    ρ·1 of its output (ρ = mean / rms); the LayerNorm that replaces it removes it. Every output moves
    by about ρ relative, and a head tied to the table, logits = z·E'ᵀ + (Σz)·μ, multiplies it by the
    table's row means: Δlogits ≈ ρ·|Σγ|·max|μ|, so the error grows with the embedding offsets × ε
    (7e-9 on a tiny float32 GPT-2, 7e-5 with offsets of 200 in its tables, against the 1e-9 that the
    check asks of float64 arithmetic). With P that centred copy, R the input and L the result, all in
    float64: |L − R| ≤ |L − P| + |P − R|, where |L − P| is the algebra's error (≈ 1e-15: the
    comparison against P is exact) and |P − R| is this number. The check therefore allows
    fp64_tol + 2·input_rounding: twice, for the max over outputs mixing the two terms' worst outputs.
    A float64 input, or a Pre-CRMSNorm one (its stream is zero-mean by construction: x_d = −Σ others),
    has nothing to add (0)."""
    from ..verify import diff_outputs, run_model

    norms = [m for m in model.modules() if type(m) is RMSNorm]
    if not norms or working_dtype(model) == torch.float64:
        return 0.0
    m64 = copy.deepcopy(model).to(torch.float64).eval()
    as_is = run_model(m64, inputs)
    handles = [m.register_forward_pre_hook(_centre_inputs, with_kwargs=True)
               for m in m64.modules() if type(m) is RMSNorm]
    try:
        centred = run_model(m64, inputs)
    finally:
        for h in handles:
            h.remove()
    return max((d.max_rel for d in diff_outputs(centred, as_is, (), centered)), default=0.0)


def stream_mean_rounding(result: nn.Module, inputs: dict, centered, compression: dict) -> float:
    """How far the float64 run of a Pre-LN `result` is from itself with its stream recentred where the
    Pre-CRMSNorm input recentres it (its compression points): the largest relative change of an output.

    Why the reverse check needs it: where the input's stream starts at a recentre-and-compress op (a kept
    tie's original tables, a non-linear stem), the Pre-LN result carries the stream's per-token mean again,
    as the original does, and float64 rounds every residual add and LayerNorm at eps·|mean|; a tied head
    multiplies that by the table's row means. It is the original architecture's own float64 error (the
    forward check sees the same against the original: 1.1e-9 with embedding offsets of 50 against a
    spread of 0.02), not the reverse algebra's, which the comparison against the recentred copy bounds."""
    from ..nn.hooks import add_input_recenter, add_output_recenter
    from ..verify import diff_outputs, run_model

    after, before = compression.get("compress_after", []), compression.get("compress_before", [])
    if not (after or before):
        return 0.0
    m64 = copy.deepcopy(result).to(torch.float64).eval()
    as_is = run_model(m64, inputs)
    modules = dict(m64.named_modules())
    for path in after:
        add_output_recenter(modules[path])
    for path in before:
        add_input_recenter(modules[path])
    recentred = run_model(m64, inputs)
    return max((d.max_rel for d in diff_outputs(recentred, as_is, (), centered)), default=0.0)


def _steps(src: str, to: str, pad: bool) -> list[str]:
    if src == "layernorm":
        raise UnsupportedConversionError(
            "--to layernorm converts a normfold Pre-RMSNorm / Pre-CRMSNorm model (a `normfold convert` output "
            "directory) back to Pre-LN; this model has no normfold norms: it already is a LayerNorm model")
    if to == src and to != "crmsnorm":
        raise UnsupportedConversionError(f"the model already is a {src} model; nothing to convert")
    steps = ["decompress"] if src == "crmsnorm" else []
    if to == "rmsnorm":
        return steps
    steps.append("layernorm")
    if to == "layernorm":
        return steps
    if to == "crmsnorm":
        return steps + ["crmsnorm"]
    raise UnsupportedConversionError(f"cannot convert a {src} model to {to}; from a normfold model: "
                                     "--to rmsnorm, layernorm or crmsnorm")


def _run(model: nn.Module, steps: list[str], options: dict) -> tuple[nn.Module, ConversionReport | None]:
    from ..conversion import convert

    report = None
    for step in steps:
        if step == "decompress":
            decompress(model)
        elif step == "layernorm":
            to_layernorm(model)
        else:
            model, report = convert(model, to="crmsnorm", inplace=True, verify=False, pad=bool(options.get("pad")),
                                    variant_options={k: v for k, v in options.items() if k != "pad"})
    return model, report


def reverse_report(to: str, adapter: str, model: nn.Module, layernorms_total: int, done: Structure,
                   added_bias: list[str], src_report: ConversionReport | None) -> ConversionReport:
    """The report of a reverse conversion whose steps left `model` with the structure `done` (in memory:
    `convert_converted`; streamed: `stream.reverse`). `added_bias`: the biases the forward conversion added."""
    report = ConversionReport(variant=to, adapter=adapter, architecture=type(model).__name__,
                              dtype=str(working_dtype(model)).replace("torch.", ""),
                              layernorms_total=layernorms_total, structure=copy.deepcopy(done))
    if to == "layernorm":
        # the biases the forward conversion added stay (normfold.load creates them: their output loads
        # with it only, stock_reloadable False)
        report.structure = Structure(untied=list(done.untied), added_bias=list(done.added_bias))
        report.stock_reloadable = not added_bias
    else:
        # its Recenters are for normfold's RMSNorms only, as in conversion.apply_rmsnorm (stock LN re-centres)
        report.stock_reloadable = not (done.added_bias or done.tied_heads)
    report.centered_outputs = list(src_report.centered_outputs) if src_report is not None else []
    return report


def note_reverse(report: ConversionReport, src: str, steps: list[str], src_report: ConversionReport | None) -> None:
    """The note and the source a reverse conversion's report carries over from the forward one."""
    report.notes.append(f"reverse conversion (paper 001 App. C) from a {src} model: {' -> '.join(steps)}")
    if src_report is not None and src_report.source:
        report.source = dict(src_report.source)


def convert_converted(model: nn.Module, to: str, *, inplace: bool = False, verify: bool = True,
                      inputs: dict | None = None, fp64_tol: float = 1e-9, progress=None,
                      variant_options: dict | None = None) -> tuple[nn.Module, ConversionReport]:
    """`normfold.convert(model, to)` for a model that already carries normfold norms."""
    from ..conversion import centered_outputs
    from ..verify import verify_conversion

    say = progress or (lambda msg: None)
    t0 = time.perf_counter()
    src = source_variant(model)
    options = dict(variant_options or {})
    if to != "crmsnorm" and options:
        raise UnsupportedConversionError(f"--to {to} from a {src} model takes no options")
    steps = _steps(src, to, bool(options.get("pad")))
    adapter = find_adapter(model)
    src_report = getattr(model, "normfold_report", None)
    before = measure(model)
    target = model if inplace else copy.deepcopy(model)
    if inplace and verify:
        model = copy.deepcopy(model)
    say(f"{src} -> {to}: {' -> '.join(steps)}")
    target, fwd_report = _run(target, steps, options)
    target.eval()
    if fwd_report is not None:
        report = fwd_report
    else:
        structure = getattr(target, "normfold_report", src_report).structure if src_report is not None else Structure()
        report = reverse_report(to, adapter.name, target, sum(isinstance(m, (nn.LayerNorm, RMSNorm, StreamCRMSNorm))
                                                              for m in model.modules()),
                                structure, structure.added_bias, src_report)
    note_reverse(report, src, steps, src_report)
    target.normfold_report = report
    report.size = size_report(before, target)
    report.seconds["convert"] = round(time.perf_counter() - t0, 3)
    if verify:
        t1 = time.perf_counter()
        say("verifying (float64 and working dtype)")
        if inputs is None:
            inputs = adapter.example_inputs(model, torch.Generator().manual_seed(0))
        centered = tuple(report.centered_outputs) or centered_outputs(adapter.plan(target))

        def reconvert(m: nn.Module) -> nn.Module:
            return _run(m, steps, options)[0].eval()

        rounding = input_rounding(model, inputs, centered) if steps and steps[0] == "layernorm" else 0.0
        compression = src_report.structure.compression if src_report is not None else None
        if to == "layernorm" and compression:
            rounding = max(rounding, stream_mean_rounding(target, inputs, centered, compression))
        report.verification = verify_conversion(model, target, inputs, reconvert=reconvert,
                                                fp64_tol=fp64_tol + 2 * rounding, centered=centered).to_dict()
        if report.verification.get("fp64") is not None:
            report.verification["fp64"]["input_rounding"] = rounding
        report.seconds["verify"] = round(time.perf_counter() - t1, 3)
    return target, report


def run_reverse(model: nn.Module, variant, options, *, inplace: bool, verify: bool, inputs: dict | None,
                fp64_tol: float, progress, fast: bool, **_plan_keywords) -> tuple[nn.Module, ConversionReport]:
    """The executor of the reverse conversions (`Variant.executor` of `--to layernorm`, and of any target for a model
    that already carries normfold norms): `convert_converted` to `options.to`, the fast paths refreshed, the
    options recorded. The keywords only a plan takes (`adapter`, `auto`, `discard_original`) do not apply."""
    if options.rotate is not None:
        raise UnsupportedConversionError("--rotate converts LayerNorm models; this model already carries "
                                         "normfold norms (convert the original model with --rotate)")
    rotation = getattr(getattr(getattr(model, "normfold_report", None), "structure", None), "rotation", None)
    if rotation and (rotation.get("explicit") or rotation.get("online")):
        raise UnsupportedConversionError(
            "this checkpoint's stream is rotated with explicit / online rotation ops (normfold.json "
            "structure.rotation), which the reverse conversions do not carry over; convert the original "
            "LayerNorm model instead")
    out = convert_converted(model, options.to, variant_options=options.target_options(), inplace=inplace,
                            verify=verify, inputs=inputs, fp64_tol=fp64_tol, progress=progress)
    from .. import fastpath

    fastpath.refresh(out[0], fast)  # the norms and shapes changed: fast paths where they still fit
    out[1].options = options.to_record()
    return out
