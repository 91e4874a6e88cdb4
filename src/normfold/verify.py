"""Prove a conversion by running both models (docs/verification.md).

Two checks:

1. **Exactness (float64).** The original is cast to float64 and converted again in float64; both
   run on the same inputs. The algebra is exact in real arithmetic, so every output must agree to
   a relative error ≤ 1e-9 (typically ~1e-15).
2. **Working dtype.** The converted model (in the model's own dtype) is compared with the exact
   answer (the original in float64), next to the original's own error against that answer. The
   conversion passes when it adds no more error than floating point already has:
   err(converted) ≤ 4 · err(original) + 64 ulp. Top-1 agreement of logits is reported too.

Relative error of a tensor = max|a − b| / max|b| (normwise; no division by near-zero entries).
Hidden states of a residual stream are compared after removing their per-token mean: a converted
Pre-LN model carries the recentred stream, and only normalized copies of it are ever read. A
Pre-CRMSNorm stream is compared on the d−1 coordinates it carries (`stream_diff`).
"""

from __future__ import annotations

import contextlib
import copy
import fnmatch
import math
import re
from dataclasses import asdict, dataclass, field

import torch
from torch import Tensor, nn

from .forward import CENTERED_OUTPUTS, accepts, cast_inputs, flatten_outputs, run_model  # noqa: F401
from .modelinfo import working_dtype

WORKING_FACTOR = 4.0
ULP_FLOOR = 64.0


@dataclass
class TensorDiff:
    name: str
    max_abs: float
    max_rel: float
    scale: float

    @classmethod
    def of(cls, name: str, test: Tensor, ref: Tensor) -> "TensorDiff":
        t, r = test.detach().double(), ref.detach().double()
        if t.shape != r.shape:
            return cls(name, float("inf"), float("inf"), float(r.abs().max()) if r.numel() else 0.0)
        diff = (t - r).abs()
        max_abs = float(diff.max()) if diff.numel() else 0.0
        if not torch.isfinite(t).all():
            max_abs = float("inf")
        scale = float(r.abs().max()) if r.numel() else 0.0
        return cls(name, max_abs, max_abs / scale if scale > 0 else max_abs, scale)


@dataclass
class Verification:
    passed: bool
    dtype: str
    max_abs_error: float  # converted vs original, both in the working dtype
    max_rel_error: float
    top1_agreement: float | None
    fp64: dict | None
    working: dict
    baseline: dict
    inputs: dict = field(default_factory=dict)
    skipped: dict = field(default_factory=dict)  # output name -> why it is not compared

    def to_dict(self) -> dict:
        return asdict(self)


# running models: normfold.forward (re-exported here)


def _resolve_skip(names: list[str], skip) -> set[str]:
    """Skip entries may use negative indices ('hidden_states[-1]') or fnmatch patterns."""
    out = set()
    for pat in skip:
        if pat.endswith("[-1]"):  # the last entry of every tuple output whose name matches the stem pattern
            last: dict[str, tuple[int, str]] = {}
            for n in names:
                stem, br, rest = n.rpartition("[")
                if br and rest[:-1].isdigit() and rest.endswith("]") and fnmatch.fnmatchcase(stem, pat[:-4]):
                    if stem not in last or int(rest[:-1]) > last[stem][0]:
                        last[stem] = (int(rest[:-1]), n)
            out.update(n for _, n in last.values())
        else:
            out.update(n for n in names if fnmatch.fnmatchcase(n, pat))
    return out


def _is_centered(name: str, centered) -> bool:
    return any(fnmatch.fnmatchcase(name, pat) for pat in centered)


def center_last(t: Tensor) -> Tensor:
    t = t.double()
    return t - t.mean(dim=-1, keepdim=True)


def _full_width(t: Tensor) -> Tensor:
    t = t.double()
    return torch.cat([t, -t.sum(dim=-1, keepdim=True)], dim=-1)


def is_zero_last(t: Tensor) -> bool:
    return t.numel() > 0 and bool((t[..., -1] == 0).all())


def stream_view(t: Tensor, r: Tensor) -> tuple[Tensor, Tensor]:
    """A residual-stream output of a Pre-CRMSNorm model is its first d−1 coordinates (the last is
    −Σ others), or, zero-padded, d coordinates whose last is held at 0: bring either side back to
    the full zero-mean stream before comparing. Other outputs are returned unchanged."""
    if t.dim() == 0 or r.dim() == 0 or t.shape[:-1] != r.shape[:-1]:
        return t, r
    if t.shape[-1] + 1 == r.shape[-1]:
        return _full_width(t), r
    if r.shape[-1] + 1 == t.shape[-1]:
        return t, _full_width(r)
    if t.shape[-1] == r.shape[-1] and t.shape[-1] > 1 and is_zero_last(t) != is_zero_last(r):
        if is_zero_last(t):
            return _full_width(t[..., :-1]), r
        return t, _full_width(r[..., :-1])
    return t, r


def stream_diff(name: str, test: Tensor, ref: Tensor) -> TensorDiff:
    """A residual-stream output compared centred (see the module docstring). Where one side is a
    Pre-CRMSNorm stream (d−1 coordinates, or zero-padded), the comparison runs over the d−1
    coordinates that model carries, not over the rebuilt last one: that one is −Σ of the others,
    so in a rounding dtype it holds the sum of their d−1 rounding errors (≈ √(d−1) × a typical
    coordinate's; measured 8e-6 against 1e-6 on the carried coordinates at d = 1600, float32),
    and judging it against the original's per-coordinate error (a coordinate the original
    computes, not sums) fails a model that is no less accurate where it matters (carried
    coordinates 1.6×, logits 1.5× the original's error). A zero-mean vector is determined by its
    first d−1 coordinates, so nothing an exact comparison would catch is lost (docs/crmsnorm.md,
    "When Pre-CRMSNorm loses float32 accuracy")."""
    t, r = stream_view(test, ref)
    t, r = center_last(t), center_last(r)
    if t.shape == r.shape and (t.shape[-1] != test.shape[-1] or r.shape[-1] != ref.shape[-1]
                               or is_zero_last(test) != is_zero_last(ref)):
        t, r = t[..., :-1], r[..., :-1]
    return TensorDiff.of(name, t, r)


def diff_outputs(test: dict[str, Tensor], ref: dict[str, Tensor], skip=(), centered=CENTERED_OUTPUTS) -> list[TensorDiff]:
    """Per-output differences of `test` against `ref`; outputs missing from `test` count as infinite."""
    skipped = _resolve_skip(list(ref), skip)
    diffs = []
    for name, r in ref.items():
        if name in skipped:
            continue
        t = test.get(name)
        if t is None:
            diffs.append(TensorDiff(name, float("inf"), float("inf"), 0.0))
            continue
        if _is_centered(name, centered):
            diffs.append(stream_diff(name + " (centred)", t, r))
        else:
            diffs.append(TensorDiff.of(name, t, r))
    return diffs


def rebuilt_allowance(carried: int) -> float:
    """How many times the working-dtype rule a rebuilt coordinate (−Σ of `carried` others) may err:
    √carried, the growth of a sum of `carried` independent rounding errors."""
    return math.sqrt(carried)


def explain_failures(rows: list[dict], test: dict[str, Tensor], ref: dict[str, Tensor], dtype: torch.dtype) -> None:
    """Add a `why` to each failing working-dtype row of a residual-stream output whose error sits on its
    last coordinate while the other coordinates pass the same rule. In a Pre-CRMSNorm model that
    coordinate is rebuilt as −Σ of the other d−1 (a final norm's decompressed d-wide output, which
    is a model output): it holds the sum of their rounding errors, ≈ √(d−1) × one coordinate's. That is a
    property of the d−1 stream in a rounding dtype, not of the conversion, so that one coordinate is held
    to √(d−1) × the rule (the others to the rule itself): within it the row passes with a `note`, beyond
    it the row fails with a `why`. The float64 check still compares every coordinate exactly, so a
    conversion that got the last coordinate wrong fails there. Returns whether every row now passes."""
    for row in rows:
        if row["ok"] or not row["name"].endswith(" (centred)"):
            continue
        name = row["name"][: -len(" (centred)")]
        if name not in test or name not in ref:
            continue
        t, r = stream_view(test[name], ref[name])
        t, r = center_last(t), center_last(r)
        if t.shape != r.shape or t.shape[-1] < 2:
            continue
        scale = float(r.abs().max())
        if scale == 0:
            continue
        err = (t - r).abs()
        last, rest = float(err[..., -1].max()) / scale, float(err[..., :-1].max()) / scale
        b = row["original_rel_error"]
        rule = WORKING_FACTOR * b + ULP_FLOOR * dtype_eps(dtype)
        if rest <= rule < last:
            allowance = rebuilt_allowance(t.shape[-1] - 1)
            ratio = f", {rest / b:.1f}x the original's" if b > 0 else ""
            worse = f", {last / b:.1f}x the original's error" if b > 0 else ""
            text = (f"the error sits on the last coordinate ({last:.2e}{worse}; the other {t.shape[-1] - 1} "
                    f"coordinates {rest:.2e}{ratio}, within the rule): a Pre-CRMSNorm model rebuilds that "
                    f"coordinate as minus the sum of the other d-1 in {str(dtype).replace('torch.', '')}, "
                    f"so it carries the sum of their rounding errors (about sqrt(d-1) = {allowance:.0f} times one "
                    f"coordinate's). A conditioning property of the d-1 stream, not a wrong conversion; "
                    f"see docs/crmsnorm.md, 'When Pre-CRMSNorm loses float32 accuracy'")
            if last <= allowance * rule:
                row["ok"] = True
                row["note"] = text + f"; within sqrt(d-1) x the rule ({allowance * rule:.2e}) for that coordinate"
            else:
                row["why"] = text + f"; beyond sqrt(d-1) x the rule ({allowance * rule:.2e}) even for that coordinate"
    return all(row["ok"] for row in rows)


def top1_agreement(test: dict[str, Tensor], ref: dict[str, Tensor]) -> float | None:
    keys = [k for k in ref if k.split(".")[-1].endswith("logits") and k in test and ref[k].dim() >= 2]
    if not keys:
        return None
    agree = total = 0
    for k in keys:
        a, b = test[k].argmax(-1), ref[k].argmax(-1)
        agree += int((a == b).sum())
        total += a.numel()
    return agree / total


def worst_of(diffs: list[TensorDiff]) -> dict:
    return {"max_abs_error": max((d.max_abs for d in diffs), default=0.0),
            "max_rel_error": max((d.max_rel for d in diffs), default=0.0)}


def dtype_eps(dtype: torch.dtype) -> float:
    return torch.finfo(dtype).eps


def stored_weights_tolerance(dtype: torch.dtype) -> float:
    """float64 tolerance when the candidate's *stored* weights run in float64 (no exact re-conversion):
    their one rounding to `dtype` is inside the error. 1024 ulp for float32 (1.2e-4); for 16-bit
    dtypes 1024 ulp would be 8.0 (bfloat16) or 1.0 (float16) relative, a check nothing fails, so
    they get 8 ulp (bfloat16 0.0625, float16 0.0078): a 48-layer GPT-2-XL-shaped bfloat16 conversion
    measured 0.9 ulp; a wrong fold or a missed centring is off by far more."""
    if dtype == torch.float64:
        return 1e-9
    eps = dtype_eps(dtype)
    return 1024 * eps if eps < 1e-4 else 8 * eps


# ---- final-norm outputs of a rotated model ---------------------------------------------------------

# Outputs that may be a stack's final-norm output: every stack's last_hidden_state and the last entry of
# every hidden_states tuple (GPT-2 and Whisper append the final norm's output there; CLIP appends the raw
# stream). Which of them really is a final norm's output, and whether that output is exact, is decided by
# value (`FinalNorms`), not by name.
FINAL_CANDIDATES = ("*last_hidden_state", "*hidden_states[-1]")
_IN_BLOCK = re.compile(r"\.\d+(\.|$)")


def _literal(name: str) -> str:
    """`name` as an fnmatch pattern matching only itself ('hidden_states[2]' -> 'hidden_states[[]2]')."""
    return name.replace("[", "[[]")


@dataclass
class FinalNorms:
    """The final norms of a rotated model (normfold.rotate), for the verifiers. `lacking`: norms outside the
    blocks whose γ went into their readers (the heads, a decoder's cross-attention): their output lacks γ/β and
    is in the rotated basis, so no output equal to it can be compared with the original. `exact`: final norms
    that keep γ/β and read x·Qᵀ (an explicit hook, structure.rotation["explicit"], transpose: a base model's
    final norm that no head reads): their output is the original's exactly, in the original basis, so it is
    compared, and not mapped by Qᵀ.

    `run(model, inputs)` runs `model` with forward hooks on those norms and returns its outputs with the names
    of the FINAL_CANDIDATES outputs equal to a lacking norm's output (to skip) and to an exact norm's (to
    compare unmapped). Equality is bitwise (the output *is* the norm's output, reshaped at most), so a
    raw-stream output (CLIP's vision last_hidden_state, CLIP's text hidden_states[-1]) is neither and is
    compared as a stream, mapped by Qᵀ."""

    lacking: tuple[str, ...] = ()
    exact: tuple[str, ...] = ()

    @classmethod
    def of(cls, structure) -> "FinalNorms | None":
        """From a report's structure (its `rotation` and `norms`); None when the model is not rotated."""
        rot = getattr(structure, "rotation", None) if structure is not None else None
        if not rot:
            return None
        exact = tuple(e["path"] for e in rot.get("explicit", ()) if e.get("transpose"))
        lacking = tuple(r.name for r in structure.norms
                        if not r.weight and not _IN_BLOCK.search(r.name) and r.name not in exact)
        return cls(lacking, exact)

    @classmethod
    def folded(cls, structure) -> "FinalNorms":
        """`--fold-final` without a rotation: the final norms outside the blocks whose γ went into the heads
        (`folded_into` recorded, no weight left). Their output lacks γ, so an output equal to it (by value, as
        `of` decides for a rotated model) is skipped, and every other output compared: a head holding a wrong
        γ changes the logits, which are compared. Empty (everything compared) when no final norm was folded (a
        tied head keeps the final norm's γ without --untie)."""
        norms = structure.norms if structure is not None else ()
        return cls(tuple(r.name for r in norms if not r.weight and r.folded_into and not _IN_BLOCK.search(r.name)), ())

    @contextlib.contextmanager
    def hooked(self, model: nn.Module):
        seen: dict[str, list[Tensor]] = {}
        handles = []
        for path in self.lacking + self.exact:
            module = _get(model, path)
            if module is None:
                continue
            handles.append(module.register_forward_hook(
                lambda _m, _a, out, path=path: seen.setdefault(path, []).append(out.detach())
                if isinstance(out, Tensor) else None))
        try:
            yield seen
        finally:
            for h in handles:
                h.remove()

    def classify(self, outputs: dict[str, Tensor], seen: dict[str, list[Tensor]]) -> tuple[set[str], set[str]]:
        lacking, exact = set(), set()
        for name in _resolve_skip(list(outputs), FINAL_CANDIDATES):
            t = outputs[name]
            for path, outs in seen.items():
                if any(o.numel() == t.numel() and o.dtype == t.dtype and torch.equal(o.reshape(-1), t.reshape(-1))
                       for o in outs):
                    (exact if path in self.exact else lacking).add(name)
        return lacking - exact, exact

    def run(self, model: nn.Module, inputs: dict) -> tuple[dict[str, Tensor], set[str], set[str]]:
        with self.hooked(model) as seen:
            out = run_model(model, inputs)
        return (out, *self.classify(out, seen))


def _get(model: nn.Module, path: str):
    try:
        return model.get_submodule(path)
    except AttributeError:
        return None


LACKING_WHY = ("a rotated model's final-norm output whose γ/β went into its readers (the heads, a decoder's "
               "cross-attention): in the rotated basis and without γ/β, so not the original's")


def skipped_outputs(names, skip, lacking=()) -> dict[str, str]:
    """{output name: why} of the outputs `names` that `skip` (patterns, as diff_outputs takes them) leaves out."""
    lacking = set(_resolve_skip(list(names), skip_names(lacking)))
    return {n: LACKING_WHY if n in lacking else "skipped as asked (skip=...)"
            for n in sorted(_resolve_skip(list(names), skip))}


def skip_names(names) -> tuple[str, ...]:
    """Exact output names as `skip` patterns for `diff_outputs`."""
    return tuple(_literal(n) for n in sorted(names))


# ---- the checks ------------------------------------------------------------------------------------

def _mapped(outputs: dict[str, Tensor], output_map) -> dict[str, Tensor]:
    return outputs if output_map is None else {k: output_map(k, v) for k, v in outputs.items()}


def verify_conversion(original: nn.Module, converted: nn.Module, inputs: dict, *, reconvert=None,
                      fp64_tol: float = 1e-9, skip=(), centered=CENTERED_OUTPUTS,
                      output_map=None, consume_original: bool = False,
                      final_norms: FinalNorms | None = None) -> Verification:
    """`check_conversion` in the converted model's working dtype (`modelinfo.working_dtype`)."""
    return check_conversion(original, converted, inputs, dtype=working_dtype(converted), reconvert=reconvert,
                            fp64_tol=fp64_tol, skip=skip, centered=centered, output_map=output_map,
                            consume_original=consume_original, final_norms=final_norms)


def check_conversion(original: nn.Module, converted: nn.Module, inputs: dict, *, dtype: torch.dtype, reconvert=None,
                     fp64_tol: float = 1e-9, skip=(), centered=CENTERED_OUTPUTS,
                     output_map=None, consume_original: bool = False,
                     final_norms: FinalNorms | None = None) -> Verification:
    """Run the checks described in the module docstring. `reconvert(model_fp64) -> converted_fp64`
    re-applies the conversion in float64 (None for conversions that are not output-equivalent); it
    receives a private float64 copy of the original and may convert it in place. `output_map(name, t)`
    maps each converted output before comparison (a rotated stream back to the original basis).
    `final_norms` (a rotated model, `FinalNorms.of(report.structure)`): the converted model's final-norm outputs
    that lack γ/β are skipped (on top of `skip`), those a kept final norm gives exactly are compared unmapped.

    `consume_original`: the caller no longer needs `original` (the CLI): the working-dtype runs go first, then
    `original` itself is cast to float64 in place (parameter by parameter, no copy) and handed to `reconvert`,
    so it is left converted, in float64. Same numbers; the peak is the converted model plus one float64 model
    (3x a float32 checkpoint) instead of that plus the original and a transient float32 copy of it (5x).
    `dtype`: the dtype the converted model computes in (`working_dtype`, read once by the caller)."""

    skip = tuple(skip)
    skip_w: tuple[str, ...] = ()
    lacking_seen: set[str] = set()

    def run_converted(model: nn.Module) -> tuple[dict[str, Tensor], tuple[str, ...]]:
        if final_norms is None:
            return _mapped(run_model(model, inputs), output_map), ()
        out, lacking, exact = final_norms.run(model, inputs)
        if output_map is not None:
            out = {k: v if k in exact else output_map(k, v) for k, v in out.items()}
        lacking_seen.update(lacking)
        return out, skip_names(lacking)

    was_training = original.training
    original.eval()
    try:
        if consume_original:
            orig_w = run_model(original, inputs)
            conv_w, skip_w = run_converted(converted)
            orig64 = original.to(torch.float64).eval()
        else:
            orig64 = copy.deepcopy(original).to(torch.float64).eval()
        exact = run_model(orig64, inputs)
        fp64 = None
        if reconvert is not None:
            # The float64 copy is not needed once its outputs are known: `reconvert` may convert it in
            # place, so a check holds one float64 model at a time (peak memory ~2x the model less).
            conv64, orig64 = reconvert(orig64), None
            out64, skip64 = run_converted(conv64)
            d64 = diff_outputs(out64, exact, skip + skip64, centered)
            del out64
            del conv64
            worst = worst_of(d64)
            fp64 = {**worst, "tolerance": fp64_tol, "passed": worst["max_rel_error"] <= fp64_tol,
                    "outputs": [asdict(d) for d in d64]}
        del orig64
        if not consume_original:
            orig_w = run_model(original, inputs)
            conv_w, skip_w = run_converted(converted)
    finally:
        original.train(was_training)

    skip = skip + skip_w
    base = {d.name: d for d in diff_outputs(orig_w, exact, skip, centered)}
    conv = diff_outputs(conv_w, exact, skip, centered)
    rows, working_ok = [], True
    # A float64 "working dtype" has no rounding baseline to speak of: hold it to the exactness tolerance.
    floor = fp64_tol if dtype == torch.float64 else ULP_FLOOR * dtype_eps(dtype)
    for d in conv:
        b = base.get(d.name)
        b_rel = b.max_rel if b else 0.0
        ok = d.max_rel <= WORKING_FACTOR * b_rel + floor
        working_ok &= ok
        rows.append({"name": d.name, "converted_rel_error": d.max_rel, "original_rel_error": b_rel, "ok": ok})
    if dtype != torch.float64:
        working_ok = explain_failures(rows, conv_w, exact, dtype)
    direct = diff_outputs(conv_w, orig_w, skip, centered)
    worst_direct = worst_of(direct)
    passed = working_ok and (fp64 is None or fp64["passed"])
    return Verification(
        passed=passed, dtype=str(dtype).replace("torch.", ""),
        max_abs_error=worst_direct["max_abs_error"], max_rel_error=worst_direct["max_rel_error"],
        top1_agreement=top1_agreement(conv_w, orig_w), fp64=fp64,
        working={"passed": working_ok, "rule": f"err(converted) <= {WORKING_FACTOR:g} * err(original) + "
                 f"{ULP_FLOOR:g} ulp, errors against the original in float64", "outputs": rows},
        baseline={**worst_of(list(base.values())), "what": "original in its dtype vs itself in float64"},
        inputs=describe_inputs(inputs), skipped=skipped_outputs(exact, skip, lacking_seen),
    )


def compare_models(reference: nn.Module, candidate: nn.Module, inputs: dict, *, skip=(),
                   centered=CENTERED_OUTPUTS, output_map=None, final_norms: FinalNorms | None = None) -> Verification:
    """`normfold verify ORIGINAL CONVERTED`: errors of a saved conversion against its original.

    Without the conversion recipe there is no exact float64 re-conversion: the float64 check runs
    the candidate's stored weights in float64, so it includes their rounding to the stored dtype;
    its tolerance is `stored_weights_tolerance` of that dtype (1024 ulp for float32, 8 ulp for 16-bit
    dtypes, 1e-9 for float64 checkpoints)."""

    stored = working_dtype(candidate)
    tol = stored_weights_tolerance(stored)
    return verify_conversion(reference, candidate, inputs, fp64_tol=tol, skip=skip, centered=centered,
                             output_map=output_map, final_norms=final_norms,
                             reconvert=lambda _orig64: copy.deepcopy(candidate).to(torch.float64).eval())


def describe_inputs(inputs: dict) -> dict:
    return {k: {"shape": list(v.shape), "dtype": str(v.dtype).replace("torch.", "")}
            for k, v in inputs.items() if isinstance(v, Tensor)}
