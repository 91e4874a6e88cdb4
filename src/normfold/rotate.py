"""Rotation-ready models (`normfold.convert(model, rotate="hadamard")`, `normfold convert --rotate`).

After the Pre-RMSNorm conversion every norm reading a residual stream is an RMSNorm on a zero-mean
input. Once no such norm multiplies by γ, the model is invariant under any orthogonal Q of the stream
(SliceGPT's computational invariance): writers W ← W·Q, tables E ← E·Q, readers W ← Qᵀ·W, and
RMSNorm(xQ) = RMSNorm(x)·Q. With Q fixing the all-ones direction (`algebra.rotation`), the stream stays
zero-mean, so the rotated checkpoint reloads in stock transformers wherever the plain one does.

Steps on the model, held in float64 throughout (one rounding back to the working dtype at the end):

1. the Pre-RMSNorm conversion with the final norms folded (`convert.apply_rmsnorm`);
2. every norm that still holds γ (a reader without a bias could not take β: GPT-2's bias-less lm_head
   under ln_f) folds γ into its readers and keeps the bias β/γ: γ⊙n + β = (n + β/γ)⊙γ (needs γ_i ≠ 0);
3. per stream, Q for its width (`algebra.rotation_matrix`, kind + seed): writers, tables and stream
   parameters along their output axis, then re-centred (Q fixes 1 exactly in real arithmetic, this
   removes float64 residue); readers along their input axis; kept norm biases. A tensor shared by two
   places (a tie that survived the conversion) is rotated once: both ends need the same t·Q.

Where the stream is not written by linear maps only (a stem recentred explicitly: BLOOM, mBART, CLIP
vision, Whisper/SigLIP 2 first layers) the stem stays as it is and its output is rotated by an explicit
x ← x·Q hook; a final norm that no head reads (base models: the output is the stream itself) keeps γ/β
and reads x·Qᵀ. Both are recorded in structure.rotation["explicit"] (Q rebuilt from kind + seed at load).

Refused (`UnsupportedConversionError`, CLI exit 2), with the reason: LayerNorms kept on a stream (Post-LN
blocks; kept norms marked `on_stream=False` by their adapter do not count), a γ that cannot be folded (a
norm read by something that is not linear, or γ with zero entries), a Recenter that does not start its
stream.

`report.structure.rotation` records kind, seed and per-stream width and construction. Hidden-state
outputs (output_hidden_states) are the rotated stream: `unrotate_outputs` maps them back (verification
uses it).
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from . import algebra
from .adapters import ConversionPlan
from .adapters.base import get
from .conversion import apply_rmsnorm, layernorm_names, register_rotator
from .options import ConvertOptions
from .errors import UnsupportedConversionError
from .modelinfo import working_dtype
from .nn.attention import add_qk_rotation
from .nn.online import add_input_hadamard, add_input_rotation, add_output_rotation
from .ops.hadamard import hadamard_factor, hadamard_matrix
from .nn import RMSNorm
from .report import ConversionReport
from .verify import CENTERED_OUTPUTS

__all__ = ["apply_rotation", "rotation_of", "unrotate_outputs", "stream_rotations", "add_online_hadamard",
           "mlp_down_projections", "attention_output_projections", "add_attention_online_hadamard",
           "HEAD_LAYOUTS", "HeadLayout", "head_rotation", "rotate_value_output", "QK_LAYOUTS", "QKLayout",
           "rotate_query_key"]

def _refuse(why: str) -> UnsupportedConversionError:
    return UnsupportedConversionError(f"cannot rotate this model exactly: {why}")


_BLOCK = re.compile(r"\.\d+(\.|$)")


@dataclass
class _Points:
    """Where a stream is not rotated through its weights: the writers and norms before an explicit
    Recenter (they stay as they are), the explicit rotations x ← x·Q there, and final norms that keep γ/β
    because no head reads them (their input is rotated back, x ← x·Qᵀ)."""

    pre_writers: set = field(default_factory=set)
    pre_norms: set = field(default_factory=set)
    after: list = field(default_factory=list)  # modules whose output gets ·Q
    before: list = field(default_factory=list)  # modules whose stream input gets ·Q
    unrotate: list = field(default_factory=list)  # final norms whose input gets ·Qᵀ


def rotation_points(plan: ConversionPlan) -> list[_Points]:
    """Per stream of `plan`: where the in-memory rotation does not go through the weights (`_Points`); refuses
    what it cannot place."""
    out = []
    for stream in plan.streams:
        pts = _Points()
        norms = {site.path for site in stream.norms} | {k.path for k in plan.kept}
        if stream.recenter_after or stream.recenter_before:
            for path in stream.recenter_after:
                if path not in norms or _BLOCK.search(path):
                    raise _refuse(
                        f"stream {stream.name!r} is recentred explicitly after {path}, which is not the norm that "
                        "starts the stream; where its output goes is not described, so no explicit rotation can "
                        "be placed exactly")
            for path in stream.recenter_before:
                if not re.search(r"\.0$", path):
                    raise _refuse(f"stream {stream.name!r} is recentred explicitly on the input of {path}, which is "
                                  "not its first block")
            for w in stream.writers:  # the stem: writers before the first block
                if _BLOCK.search(w):
                    break
                pts.pre_writers.add(w)
            pts.pre_norms = set(stream.recenter_after)
            pts.after = list(stream.recenter_after)
            pts.before = list(stream.recenter_before)
        out.append(pts)
    return out


def _check_no_layernorm_left(model: nn.Module, plan: ConversionPlan, points: list[_Points]) -> None:
    stems = {n for pts in points for n in pts.pre_norms}  # before an explicit Recenter: not rotated
    off = {k.path for k in plan.kept if not k.on_stream}  # reads no residual stream: rotation leaves it alone
    left = [n for n in layernorm_names(model) if n not in stems | off]
    if left:
        reasons = {k.path: k.reason for k in plan.kept}
        detail = "; ".join(f"{n}: {reasons.get(n, 'not on a stream the adapter describes')}" for n in left[:4])
        more = f" (and {len(left) - 4} more)" if len(left) > 4 else ""
        raise _refuse(f"{len(left)} LayerNorm(s) stay LayerNorms ({detail}{more}). A LayerNorm with an affine "
                      "does not commute with a rotation of its input (Post-LN blocks normalize the stream "
                      "itself and write γ⊙n + β back to it).")


def _fold_kept_gammas(model: nn.Module, plan: ConversionPlan, report: ConversionReport,
                      points: list[_Points]) -> int:
    """Step 2: γ into the readers, β/γ stays. A final norm no head reads keeps γ/β and gets its input
    rotated back (recorded in `points`); the norm starting a recentred stream keeps them too. Returns
    #tensors edited."""
    where = {site.path: (site, pts) for stream, pts in zip(plan.streams, points) for site in stream.norms}
    edited = 0
    for rec in report.structure.norms:
        if not rec.weight:
            continue
        site, pts = where.get(rec.name, (None, None))
        if pts is not None and rec.name in pts.pre_norms:
            continue
        readers = site.readers if site else ()
        if not readers:
            if site is not None and site.final:
                pts.unrotate.append(rec.name)  # the model's output is the stream itself: keep γ/β, rotate back
                continue
            raise _refuse(f"the γ of {rec.name} cannot be folded: its output is not read only by linear modules")
        edited += fold_kept_gamma(model, site)
        rec.weight = False
        rec.folded_into = list(site.readers)
    return edited


def fold_kept_gamma(model: nn.Module, site) -> int:
    """Step 2 for one norm (its readers given): γ into the readers, β/γ stays as the norm's bias, γ dropped.
    Per norm, so the streamed conversion runs it on one component (normfold.stream). Returns #tensors edited."""
    norm = get(model, site.path)
    readers = [get(model, r) for r in site.readers]
    if not all(algebra.is_linear_reader(r) or algebra.is_conv_reader(r) for r in readers):
        raise _refuse(f"the γ of {site.path} cannot be folded: a reader of it is not a linear module")
    gamma = norm.weight
    if not gamma.is_meta and bool((gamma.detach() == 0).any()):  # on meta (the streamed structure pass) the
        # values pass runs this again on the real γ
        raise _refuse(f"the γ of {site.path} has {int((gamma.detach() == 0).sum())} zero entries: β/γ is "
                      "undefined, so β cannot stay behind while γ moves into the readers")
    edited = 0
    for reader in readers:
        lay = algebra.layout_of(reader)
        w = getattr(reader, lay.weight)
        b = getattr(reader, lay.bias, None) if lay.bias else None
        if algebra.is_conv_reader(reader):
            new_w, _ = algebra.fold_affine_conv(w, b, gamma, None, reader.groups)
        else:
            new_w, _ = algebra.fold_affine(w, b, gamma, None, lay.in_dim)
        with torch.no_grad():
            w.copy_(new_w)
        edited += 1
    with torch.no_grad():
        if norm.bias is not None:
            if not norm.bias.is_meta:
                norm.bias.copy_(algebra.unfold_gamma_bias(norm.bias, gamma))
            edited += 1
    norm.weight = None
    return edited


def _stream_width(model: nn.Module, norms) -> int:
    widths = {int(get(model, s.path).normalized_shape[0]) for s in norms if isinstance(get(model, s.path), RMSNorm)}
    if len(widths) != 1:
        raise _refuse(f"the norms of one stream disagree on its width ({sorted(widths)})")
    return widths.pop()


def stream_tensor_names(model: nn.Module, stream, pts: _Points) -> list[tuple[str, int, bool]]:
    """(parameter name, stream axis, is a writer) of everything that touches this stream through weights
    (on the converted model: norms swapped, γ folded)."""
    out = []
    for path in stream.writers:
        if path in pts.pre_writers:
            continue
        obj = get(model, path)
        if isinstance(obj, nn.Parameter):
            out.append((path, obj.dim() - 1, True))
            continue
        lay = algebra.layout_of(obj)
        if lay is None:
            raise _refuse(f"stream writer {path} is a {type(obj).__name__} with no known weight layout")
        out.append((f"{path}.{lay.weight}", lay.out_dim, True))
        b = getattr(obj, lay.bias, None) if lay.bias else None
        if b is not None:
            out.append((f"{path}.{lay.bias}", b.dim() - 1, True))
    for site in stream.norms:
        if site.path in pts.pre_norms or site.path in pts.unrotate:
            continue
        norm = get(model, site.path)
        if getattr(norm, "weight", None) is not None:
            raise _refuse(f"{site.path} still multiplies by γ")
        if getattr(norm, "bias", None) is not None:
            out.append((f"{site.path}.bias", 0, False))
        for r in site.readers:
            lay = algebra.layout_of(get(model, r))
            out.append((f"{r}.{lay.weight}", lay.in_dim, False))
    return out


def _stream_tensors(model: nn.Module, stream, pts: _Points) -> list[tuple[nn.Parameter, int, bool]]:
    """(parameter, stream axis, is a writer) of everything that touches this stream through weights."""
    return [(get(model, name), axis, writer) for name, axis, writer in stream_tensor_names(model, stream, pts)]


def _module_params(model: nn.Module, path: str) -> list[nn.Parameter]:
    obj = get(model, path)
    return [obj] if isinstance(obj, nn.Parameter) else list(obj.parameters())


def stream_rotations(widths, kind: str, seed: int) -> dict[int, tuple[Tensor, str]]:
    return {d: algebra.rotation_matrix(kind, d, seed) for d in sorted(set(widths))}


def apply_rotation(model: nn.Module, plan: ConversionPlan, options: ConvertOptions, report: ConversionReport,
                   kind: str, seed: int, online: bool = False, attention: str | None = None) -> None:
    """Pre-LN -> rotated Pre-RMSNorm on `model` in place (see the module docstring); `online`: also an
    online Hadamard before each MLP down-projection (`add_online_hadamard`); `attention`: "vo" the per-head
    value/output rotation (`rotate_value_output`), "online" the attention-output Hadamard
    (`add_attention_online_hadamard`), "both"; "qk" the per-head query/key rotation (`rotate_query_key`), "all"
    the three."""
    if kind not in algebra.rotation.KINDS:
        raise UnsupportedConversionError(f"unknown rotation {kind!r}; choose one of {', '.join(algebra.rotation.KINDS)}")
    points = rotation_points(plan)
    dtype = working_dtype(model)
    model.to(torch.float64)
    try:
        apply_rmsnorm(model, plan, options, report)
        _check_no_layernorm_left(model, plan, points)
        report.tensors_edited += _fold_kept_gammas(model, plan, report, points)
        widths = [_stream_width(model, s.norms) for s in plan.streams]
        qs = stream_rotations(widths, kind, seed)
        done: dict[int, int] = {}
        frozen = {id(p) for stream, pts in zip(plan.streams, points) for w in pts.pre_writers | pts.pre_norms
                  for p in _module_params(model, w)}
        streams, explicit = [], []
        for stream, pts, d in zip(plan.streams, points, widths):
            q, used = qs[d]
            for p, axis, writer in _stream_tensors(model, stream, pts):
                if id(p) in frozen:
                    raise _refuse(f"a parameter of stream {stream.name!r} is shared with a stem that is not "
                                  "rotated (tied tables on both sides of an explicit Recenter)")
                if id(p) in done:
                    if done[id(p)] != d:
                        raise _refuse(f"a parameter is shared by streams of widths {done[id(p)]} and {d}")
                    continue
                new = algebra.rotate_axis(p, q, axis, center=writer)  # writers re-centred: see the docstring
                with torch.no_grad():
                    p.copy_(new)
                done[id(p)] = d
                report.tensors_edited += 1
            for path in pts.after:
                add_output_rotation(get(model, path), q)
                explicit.append({"path": path, "where": "output", "width": d, "transpose": False})
            for path in pts.before:
                add_input_rotation(get(model, path), q)
                explicit.append({"path": path, "where": "input", "width": d, "transpose": False})
            for path in pts.unrotate:
                add_input_rotation(get(model, path), q.T.contiguous())
                explicit.append({"path": path, "where": "input", "width": d, "transpose": True})
            streams.append({"name": stream.name, "width": d, "construction": used})
        report.structure.rotation = {"kind": kind, "seed": int(seed), "streams": streams}
        if explicit:
            report.structure.rotation["explicit"] = explicit
            report.stock_reloadable = False
            report.notes.append(
                "explicit rotations (one d×d matmul per token each; the checkpoint needs normfold.load): "
                + "; ".join(f"{e['path']} {e['where']} ·Q{'ᵀ (the final norm keeps γ/β: the output is the stream itself)' if e['transpose'] else ' (after the explicit Recenter: the stem is not linear)'}"
                            for e in explicit))
        report.notes.append(
            f"residual stream rotated ({kind}, seed {seed}; "
            + ", ".join(f"{s['name']}: d={s['width']} {s['construction']}" for s in streams)
            + "): hidden-state outputs are the rotated stream (normfold.rotate.unrotate_outputs maps them back); "
            "a final norm whose γ/β went into its readers (heads, cross-attention) gives its output (last_hidden_state "
            "where it is that) rotated and without them (verification skips it); a final norm no head reads keeps "
            "γ/β and un-rotates its input, so its output is the original's (verification compares it)")
        if online:
            done = add_online_hadamard(model, mlp_down_projections(model, report), report)
            report.notes.append(f"online Hadamard before {len(done)} MLP down-projection(s) (fast Walsh-Hadamard "
                                "op on their input, weights rotated to match): load with normfold.load")
        if attention in ("vo", "both", "all"):
            rotate_value_output(model, report, seed)
        if attention in ("online", "both", "all"):
            add_attention_online_hadamard(model, report)
        if attention in ("qk", "all"):
            rotate_query_key(model, report, seed)
    finally:
        model.to(dtype)


def add_online_hadamard(model: nn.Module, paths: list[str], report: ConversionReport | None = None) -> list[str]:
    """Online Hadamard before each linear at `paths` (exact): its input becomes x·H/√n at run time
    (`nn.online.add_input_hadamard`, the fast Walsh–Hadamard op) and its weight W·H/√n along the input
    axis (float64, one rounding). Widths without a Hadamard construction are skipped. Returns the paths
    done; with `report`, records them in structure.rotation["online"] (replayed by normfold.load) and
    marks the checkpoint not stock-reloadable (stock transformers would run the rotated weights without
    the rotation of their input)."""
    done = []
    for path in paths:
        module = get(model, path)
        lay = algebra.layout_of(module)
        if lay is None or lay.in_dim is None:
            raise UnsupportedConversionError(f"{path} is a {type(module).__name__}, not a linear module")
        w = getattr(module, lay.weight)
        n = int(w.shape[lay.in_dim])
        if not hadamard_factor(n):
            continue
        h = hadamard_matrix(n) / n ** 0.5
        with torch.no_grad():
            w.copy_(algebra.rotate_axis(w, h, lay.in_dim))
        add_input_hadamard(module, n)
        done.append(path)
    if report is not None and done:
        report.structure.rotation.setdefault("online", []).extend(done)
        report.stock_reloadable = False
    return done


def _stream_writers(model: nn.Module, report: ConversionReport, input_on_stream: bool) -> list[str]:
    """The centred linear writers of a rotated stream whose input is (or is not) as wide as a stream."""
    out = []
    widths = {s["width"] for s in report.structure.rotation.get("streams", [])}
    for path in report.centered:
        obj = get(model, path)
        lay = None if isinstance(obj, nn.Parameter) else algebra.layout_of(obj)
        if lay is None or lay.in_dim is None or not algebra.is_linear_reader(obj):
            continue
        w = getattr(obj, lay.weight)
        if (int(w.shape[lay.in_dim]) in widths) == input_on_stream and int(w.shape[lay.out_dim]) in widths:
            out.append(path)
    return out


def mlp_down_projections(model: nn.Module, report: ConversionReport) -> list[str]:
    """Stream writers whose input is wider than the stream (the MLP down-projections)."""
    return _stream_writers(model, report, input_on_stream=False)


def attention_output_projections(model: nn.Module, report: ConversionReport) -> list[str]:
    """Stream writers as wide in as out: the attention output projections (their input is the heads'
    concatenated output)."""
    return _stream_writers(model, report, input_on_stream=True)


def add_attention_online_hadamard(model: nn.Module, report: ConversionReport) -> list[str]:
    """QuaRot's online Hadamard on the attention output: x ← x·H/√d before every attention output
    projection of a rotated model, its weight rotated to match (exact). Recorded in
    structure.rotation["online"] like `--rotate-online` (normfold.load replays it). Returns the paths."""
    if not report.structure.rotation:
        raise UnsupportedConversionError("the attention-output Hadamard needs a rotated model (--rotate)")
    done = add_online_hadamard(model, attention_output_projections(model, report), report)
    if done:
        report.notes.append(f"online Hadamard before {len(done)} attention output projection(s): load with "
                            "normfold.load")
    return done


# ---- the value/output pair: an exact per-head rotation in the weights (QuaRot) ------------------------

@dataclass(frozen=True)
class HeadLayout:
    """Where one family keeps an attention's values and output projection. `attention`: regex of the attention
    modules' paths; `v`, `o`: the modules holding V and O under it; `heads(config)`: (heads, KV heads, head_dim);
    `value_index(heads, kv, hd)`: V's output features per KV head, a (kv, hd) LongTensor. O's input features of
    head h are h·hd … (h+1)·hd, and head h reads KV head h // (heads / kv)."""

    attention: str
    v: str
    o: str
    heads: Callable
    value_index: Callable


def _plain_heads(n_heads: str, width: str, kv: str | None = None) -> Callable:
    def fn(cfg):
        h, d = int(getattr(cfg, n_heads)), int(getattr(cfg, width))
        k = int(getattr(cfg, kv, None) or h) if kv else h
        return h, k, int(getattr(cfg, "head_dim", None) or d // h)
    return fn


def _separate(h, kv, hd):  # a V projection of its own: KV head g is rows g·hd … (g+1)·hd
    return torch.arange(kv * hd).view(kv, hd)


def _interleaved(h, kv, hd):  # fused QKV as [heads, 3, head_dim] (GPT-NeoX, BLOOM, Falcon's original layout)
    return (torch.arange(kv) * 3 * hd + 2 * hd)[:, None] + torch.arange(hd)


def _gpt2(h, kv, hd):  # fused Conv1D [Q | K | V], each d wide
    return 2 * h * hd + torch.arange(kv * hd).view(kv, hd)


def _falcon_heads(cfg):
    h = int(cfg.num_attention_heads)
    hd = int(cfg.hidden_size) // h
    if cfg.new_decoder_architecture:
        return h, int(cfg.num_kv_heads), hd
    return h, 1 if cfg.multi_query else h, hd


def _falcon(h, kv, hd):
    if kv == h:  # original layout, one KV head per head, interleaved
        return _interleaved(h, kv, hd)
    # [kv groups, heads per group + 2, head_dim] (new architecture; multi-query is one group: Q…, K, V)
    per = h // kv + 2
    return (torch.arange(kv) * per * hd + (per - 1) * hd)[:, None] + torch.arange(hd)


HEAD_LAYOUTS: dict[str, HeadLayout] = {
    "gpt2": HeadLayout(r"\.attn$", "c_attn", "c_proj", _plain_heads("n_head", "n_embd"), _gpt2),
    "opt": HeadLayout(r"\.self_attn$", "v_proj", "out_proj", _plain_heads("num_attention_heads", "hidden_size"),
                      _separate),
    "gpt_neox": HeadLayout(r"\.attention$", "query_key_value", "dense",
                           _plain_heads("num_attention_heads", "hidden_size"), _interleaved),
    "phi": HeadLayout(r"\.self_attn$", "v_proj", "dense",
                      _plain_heads("num_attention_heads", "hidden_size", "num_key_value_heads"), _separate),
    "gptj": HeadLayout(r"\.attn$", "v_proj", "out_proj", _plain_heads("n_head", "n_embd"), _separate),
    "gpt_neo": HeadLayout(r"\.attn\.attention$", "v_proj", "out_proj",
                          _plain_heads("num_heads", "hidden_size"), _separate),
    "falcon": HeadLayout(r"\.self_attention$", "query_key_value", "dense", _falcon_heads, _falcon),
    "bloom": HeadLayout(r"\.self_attention$", "query_key_value", "dense", _plain_heads("n_head", "hidden_size"),
                        _interleaved),
}


head_rotation = algebra.rotation.head_rotation  # (hd, seed) -> (hd × hd orthogonal, construction)


def _rotate_features(t: Tensor, axis: int, index: Tensor, h: Tensor) -> Tensor:
    """t with the features `index` (k, hd) along `axis` mapped f ← Hᵀ·f per row of `index` (float64)."""
    x = t.detach().to(torch.float64).movedim(axis, 0).clone()
    flat = index.reshape(-1)
    sel = x[flat].reshape(index.shape[0], index.shape[1], -1)  # (k, hd, rest)
    x[flat] = torch.einsum("ji,kjr->kir", h, sel).reshape(flat.numel(), *x.shape[1:])
    return x.movedim(0, axis)


def rotate_value_output(model: nn.Module, report: ConversionReport | None = None, seed: int = 0) -> list[str]:
    """QuaRot's exact per-head rotation of the value/output pair, in the weights: V's output features of every
    head ← ·H (its bias too), O's input features of that head ← Hᵀ· (nothing added to the model; grouped / multi-query
    KV: one H for every head, so each KV head is rotated once). Works on any model of a family in
    `HEAD_LAYOUTS` (rotated or not); refuses others. With `report`, records {"seed", "head_dim", "construction",
    "layers"} in structure.rotation["value_output"] when the stream is rotated (a note otherwise). Returns the
    attention paths done."""
    cfg = getattr(model, "config", None)
    family = getattr(cfg, "model_type", None)
    layout = HEAD_LAYOUTS.get(family)
    if layout is None:
        raise UnsupportedConversionError(
            f"the value/output rotation knows where V and O live for {', '.join(sorted(HEAD_LAYOUTS))}; not for "
            f"{family or type(model).__name__!r} (leave out the value/output rotation, or add a "
            "normfold.rotate.HEAD_LAYOUTS entry)")
    n_heads, kv, hd = layout.heads(cfg)
    if n_heads % kv:
        raise UnsupportedConversionError(f"{family}: {n_heads} heads do not split into {kv} KV groups")
    h, construction = head_rotation(hd, seed)
    vi = layout.value_index(n_heads, kv, hd)
    oi = torch.arange(n_heads * hd).view(n_heads, hd)
    pattern = re.compile(layout.attention)
    done = []
    for path, attn in list(model.named_modules()):
        if not pattern.search(path) or not hasattr(attn, layout.v) or not hasattr(attn, layout.o):
            continue
        v, o = getattr(attn, layout.v), getattr(attn, layout.o)
        lv, lo = algebra.layout_of(v), algebra.layout_of(o)
        if lv is None or lo is None or lo.in_dim is None:
            raise UnsupportedConversionError(f"{path}: {layout.v} / {layout.o} are not linear modules")
        wv, wo = getattr(v, lv.weight), getattr(o, lo.weight)
        if int(wo.shape[lo.in_dim]) != n_heads * hd or int(wv.shape[lv.out_dim]) <= int(vi.max()):
            raise UnsupportedConversionError(f"{path}: the shapes of {layout.v} / {layout.o} do not match "
                                             f"{n_heads} heads of {hd} ({kv} KV heads)")
        with torch.no_grad():
            wv.copy_(_rotate_features(wv, lv.out_dim, vi, h))
            bv = getattr(v, lv.bias, None) if lv.bias else None
            if bv is not None:
                bv.copy_(_rotate_features(bv, 0, vi, h))
            wo.copy_(_rotate_features(wo, lo.in_dim, oi, h))
        done.append(path)
    if not done:
        raise UnsupportedConversionError(f"no attention module of the {family} layout found in this model")
    if report is not None:
        report.tensors_edited += 2 * len(done)
        info = {"seed": int(seed), "head_dim": hd, "construction": construction, "layers": len(done)}
        if report.structure.rotation:
            report.structure.rotation["value_output"] = info
        report.notes.append(f"value/output projections rotated per head ({construction} {hd}×{hd}, seed {seed}, "
                            f"{len(done)} layer(s)): in the weights only, exact")
    return done


# ---- the query/key pair: a per-head rotation of the keys for a quantized KV cache (QuaRot) ---------------------

@dataclass(frozen=True)
class QKLayout:
    """Where one family keeps an attention's queries and keys (under the attention module of its `HeadLayout`).
    `q`, `k`: the modules holding them (the same one for a fused QKV); `query_index(heads, kv, hd)`: Q's output
    features per head, (heads, hd); `key_index`: K's per KV head, (kv, hd); `rotary(config)`: whether the
    positions rotate q and k after the projections (then R goes after them, at run time)."""

    q: str
    k: str
    query_index: Callable | None
    key_index: Callable | None
    rotary: Callable


def _never(cfg) -> bool:
    return False


def _always(cfg) -> bool:
    return True


def _q_separate(h, kv, hd):
    return torch.arange(h * hd).view(h, hd)


def _q_interleaved(h, kv, hd):  # [heads, 3, head_dim]: q at 0, k at hd, v at 2·hd
    return (torch.arange(h) * 3 * hd)[:, None] + torch.arange(hd)


def _k_interleaved(h, kv, hd):
    return (torch.arange(kv) * 3 * hd + hd)[:, None] + torch.arange(hd)


def _k_gpt2(h, kv, hd):  # fused Conv1D [Q | K | V]
    return h * hd + torch.arange(kv * hd).view(kv, hd)


def _q_falcon(h, kv, hd):
    if kv == h:
        return _q_interleaved(h, kv, hd)
    per = h // kv + 2  # [kv groups, heads per group + 2, head_dim]: the group's queries, then K, V
    return ((torch.arange(kv) * per * hd)[:, None] + torch.arange(per - 2) * hd)[..., None].reshape(h, 1) \
        + torch.arange(hd)


def _k_falcon(h, kv, hd):
    if kv == h:
        return _k_interleaved(h, kv, hd)
    per = h // kv + 2
    return (torch.arange(kv) * per * hd + (per - 2) * hd)[:, None] + torch.arange(hd)


QK_LAYOUTS: dict[str, QKLayout] = {
    "gpt2": QKLayout("c_attn", "c_attn", _q_separate, _k_gpt2, _never),
    "opt": QKLayout("q_proj", "k_proj", _q_separate, _separate, _never),
    "gpt_neo": QKLayout("q_proj", "k_proj", _q_separate, _separate, _never),
    "bloom": QKLayout("query_key_value", "query_key_value", _q_interleaved, _k_interleaved, _never),  # ALiBi
    "falcon": QKLayout("query_key_value", "query_key_value", _q_falcon, _k_falcon,
                       lambda cfg: not getattr(cfg, "alibi", False)),
    "gpt_neox": QKLayout("query_key_value", "query_key_value", None, None, _always),
    "gptj": QKLayout("q_proj", "k_proj", None, None, _always),
    "phi": QKLayout("q_proj", "k_proj", None, None, _always),
}


def rotate_query_key(model: nn.Module, report: ConversionReport | None = None, seed: int = 0) -> list[str]:
    """QuaRot's rotation of the keys for a quantized KV cache: every head's queries and keys ·R (R orthogonal,
    head_dim × head_dim, `head_rotation(hd, seed)`; one R for every head, so grouped / multi-query keys are
    rotated once), which leaves q·kᵀ and so the attention exact. Families with learned/absolute positions or
    ALiBi (GPT-2, OPT, GPT-Neo, BLOOM, Falcon with `alibi`): R goes into Q's and K's output features (weights and
    biases), nothing is added. Rotary families (GPT-NeoX, GPT-J, Phi, Falcon): the positions act after the
    projections, so q and k are rotated after them at run time (`nn.attention.add_qk_rotation`, replayed by
    normfold.load; without it the outputs are the same, only the cached keys are not rotated). Other families
    are refused. With `report`, records {"seed", "head_dim",
    "construction", "layers"} (+ "online": the attention paths) in structure.rotation["query_key"] when the stream
    is rotated. Returns the attention paths done."""
    cfg = getattr(model, "config", None)
    family = getattr(cfg, "model_type", None)
    layout, heads = QK_LAYOUTS.get(family), HEAD_LAYOUTS.get(family)
    if layout is None or heads is None:
        raise UnsupportedConversionError(
            f"the query/key rotation knows where Q and K live for {', '.join(sorted(QK_LAYOUTS))}; not for "
            f"{family or type(model).__name__!r} (leave out the key rotation, or add a "
            "normfold.rotate.QK_LAYOUTS entry)")
    n_heads, kv, hd = heads.heads(cfg)
    if n_heads % kv:
        raise UnsupportedConversionError(f"{family}: {n_heads} heads do not split into {kv} KV groups")
    r, construction = head_rotation(hd, seed)
    online = bool(layout.rotary(cfg))
    pattern = re.compile(heads.attention)
    done = []
    for path, attn in list(model.named_modules()):
        if not pattern.search(path) or not hasattr(attn, layout.q) or not hasattr(attn, layout.k):
            continue
        if online:
            try:
                add_qk_rotation(attn, r.to(working_dtype(attn)))
            except ValueError as exc:
                raise UnsupportedConversionError(f"{path}: {exc}") from None
            done.append(path)
            continue
        mods = {}
        for which, name, index in (("q", layout.q, layout.query_index), ("k", layout.k, layout.key_index)):
            mod = getattr(attn, name)
            lay = algebra.layout_of(mod)
            if lay is None:
                raise UnsupportedConversionError(f"{path}: {name} is not a linear module")
            idx = index(n_heads, kv, hd)
            w = getattr(mod, lay.weight)
            if int(w.shape[lay.out_dim]) <= int(idx.max()):
                raise UnsupportedConversionError(f"{path}: the shape of {name} does not match {n_heads} heads of {hd} "
                                                 f"({kv} KV heads)")
            mods[which] = (mod, lay, idx)
        with torch.no_grad():
            for mod, lay, idx in mods.values():
                w = getattr(mod, lay.weight)
                w.copy_(_rotate_features(w, lay.out_dim, idx, r))
                b = getattr(mod, lay.bias, None) if lay.bias else None
                if b is not None:
                    b.copy_(_rotate_features(b, 0, idx, r))
        done.append(path)
    if not done:
        raise UnsupportedConversionError(f"no attention module of the {family} layout found in this model")
    if report is not None:
        info = {"seed": int(seed), "head_dim": hd, "construction": construction, "layers": len(done)}
        if online:
            info["online"] = list(done)  # the function is the same without it: stock reloading stays as it was
            report.notes.append(f"queries and keys rotated per head after the rotary positions at run time "
                                f"({construction} {hd}×{hd}, seed {seed}, {len(done)} layer(s)): exact; normfold.load "
                                "replays it (stock transformers computes the same outputs without rotating the keys)")
        else:
            report.tensors_edited += len({id(m) for p in done for m in (get(model, f"{p}.{layout.q}"),
                                                                          get(model, f"{p}.{layout.k}"))})
            report.notes.append(f"query/key projections rotated per head ({construction} {hd}×{hd}, seed {seed}, "
                                f"{len(done)} layer(s)): in the weights only, exact")
        if report.structure.rotation:
            report.structure.rotation["query_key"] = info
    return done


def rotation_of(structure_rotation: dict) -> dict[int, Tensor]:
    """{width: Q} of a recorded rotation (report.structure.rotation)."""
    if not structure_rotation:
        return {}
    kind, seed = structure_rotation["kind"], int(structure_rotation.get("seed", 0))
    return {int(d): q for d, (q, _) in stream_rotations([s["width"] for s in structure_rotation["streams"]],
                                                       kind, seed).items()}


def unrotate_outputs(structure_rotation: dict, centered=CENTERED_OUTPUTS):
    """(name, tensor) -> tensor: a stream-carrying output of the rotated model (its name matches one of the
    fnmatch patterns `centered`, as in `report.centered_outputs`) back in the original basis, t·Qᵀ, for
    `verify_conversion(output_map=...)`; other outputs unchanged."""
    qs = rotation_of(structure_rotation)

    def fn(name: str, t: Tensor) -> Tensor:
        q = qs.get(int(t.shape[-1])) if t.dim() else None
        if q is None or not any(fnmatch.fnmatchcase(name, p) for p in centered):
            return t
        return (t.to(torch.float64) @ q.T).to(t.dtype if t.dtype == torch.float64 else torch.float64)

    return fn


register_rotator(apply_rotation, unrotate_outputs)
