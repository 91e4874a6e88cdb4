"""Parameter count and residual-stream width of a model before and after a conversion (normfold.json `size`;
the report layer: convert, stream and compress all fill it)."""

from __future__ import annotations

from torch import nn


def parameter_count(model: nn.Module) -> int:
    """Distinct parameters (a tied tensor counts once), as `sum(p.numel() for p in model.parameters())`."""
    return sum(p.numel() for p in model.parameters())


def weight_bytes(model: nn.Module) -> int:
    """Bytes of the distinct parameters (a tied tensor counts once) in their own dtypes."""
    return sum(p.numel() * p.element_size() for p in model.parameters())


def stream_widths(model: nn.Module) -> dict[str, int]:
    """Width of each residual stream: from a Pre-CRMSNorm model's compression record, else the config's
    hidden size (d_model / n_embd; per tower for dual-tower configs)."""
    report = getattr(model, "normfold_report", None)
    comp = report.structure.compression if report is not None else {}
    if comp:
        return {s["name"]: s["width_after"] for s in comp.get("streams", [])}
    cfg = getattr(model, "config", None)
    if cfg is None:
        return {}

    def width(c) -> int | None:
        for key in ("hidden_size", "d_model", "n_embd"):
            value = getattr(c, key, None)
            if isinstance(value, int):
                return value
        return None

    out = {}
    for key in ("text_config", "vision_config"):
        sub = getattr(cfg, key, None)
        if sub is not None and width(sub):
            out[key.split("_")[0]] = width(sub)
    if not out and width(cfg):
        out["stream"] = width(cfg)
    return out


def full_widths(model: nn.Module) -> dict[str, int]:
    """The uncompressed width of each stream (a compressed model's record, else `stream_widths`)."""
    report = getattr(model, "normfold_report", None)
    comp = report.structure.compression if report is not None else {}
    if comp:
        return {s["name"]: s["width_before"] for s in comp.get("streams", [])}
    return stream_widths(model)


def _compressed(model: nn.Module) -> bool:
    report = getattr(model, "normfold_report", None)
    return bool(report is not None and report.structure.compression)


def measure(model: nn.Module) -> tuple[int, dict[str, int], dict[str, int], bool, int]:
    return parameter_count(model), stream_widths(model), full_widths(model), _compressed(model), weight_bytes(model)


def size_report(before: nn.Module | tuple, after: nn.Module) -> dict:
    """`before` is a model or `measure(model)` taken before an in-place conversion. Streams are named
    as in the compression record (the config's hidden size says nothing about e.g. ELECTRA's
    narrower embedding stream)."""
    b, wb, fb, cb, bb = before if isinstance(before, tuple) else measure(before)
    a, wa, fa, ca, ba = measure(after)
    if ca and not cb:  # compressed now, not before: the record knows the original widths
        wb = fa
    elif cb and not ca:  # decompressed: the old record knows the restored widths
        wa = fb
    return {"parameters": {"before": b, "after": a, "change": a - b},
            "weight_bytes": {"before": bb, "after": ba, "change": ba - bb},
            "stream_width": {"before": wb, "after": wa}}
