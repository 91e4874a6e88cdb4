"""Shared checks for the decoder-family tests (test_gpt_neo.py, test_opt.py, ...).

Each check runs the original and the converted model itself (not through normfold.verify) and
compares every output; residual-stream outputs are compared after removing their per-token mean.
"""

from __future__ import annotations

import fnmatch

import torch
from torch import nn

import normfold
from helpers import realistic, rel_err, run_flat
from normfold.nn import RMSNorm

F32_EPS = torch.finfo(torch.float32).eps


def make(config_cls, head_cls, dtype=torch.float64, seed=0, **kwargs):
    torch.manual_seed(seed)
    model = head_cls(config_cls(**kwargs)).eval()
    return realistic(model).to(dtype)


def ids(vocab: int, batch: int = 2, seq: int = 12, seed: int = 5) -> dict:
    return {"input_ids": torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(seed))}


def _prep(t, name, patterns):
    t = t.double()
    return t - t.mean(-1, keepdim=True) if any(fnmatch.fnmatchcase(name, p) for p in patterns) else t


def max_error(model, conv, report, inputs) -> float:
    """Worst relative error over every output (stream outputs centred)."""
    ref, got = run_flat(model, inputs), run_flat(conv, inputs)
    assert ref and set(ref) == set(got), (set(ref) ^ set(got))
    pats = report.centered_outputs
    return max(rel_err(_prep(got[k], k, pats), _prep(ref[k], k, pats)) for k in ref)


def assert_exact(model, inputs, tol=1e-9, **convert_kwargs):
    """Convert a float64 model and check every output against the original. Returns (conv, report)."""
    conv, report = normfold.convert(model, verify=False, **convert_kwargs)
    err = max_error(model, conv, report, inputs)
    assert err <= tol, err
    return conv, report


def layernorms(model) -> list[str]:
    return [n for n, m in model.named_modules() if isinstance(m, nn.LayerNorm)]


def rmsnorms(model) -> dict[str, RMSNorm]:
    return {n: m for n, m in model.named_modules() if isinstance(m, RMSNorm)}


def kept_reasons(report) -> dict[str, str]:
    return {k["name"]: k["reason"] for k in report.kept}


def assert_stream_zero_mean(conv, inputs, upto: int | None = None):
    """Hidden states 0..L-1 (the stream before the final norm) of the converted model are zero-mean."""
    with torch.no_grad():
        hs = conv(**inputs, output_hidden_states=True).hidden_states
    for h in hs[: upto if upto is not None else len(hs) - 1]:
        h = h.double()
        assert h.mean(-1).abs().max() <= 1e-9 * max(1.0, float(h.abs().max())), float(h.mean(-1).abs().max())


def assert_norm_inputs_zero_mean(conv, inputs, tol=1e-9):
    """What makes RMSNorm exact: the input of every converted norm is zero-mean (float64 model)."""
    seen, handles = {}, []
    for name, m in rmsnorms(conv).items():
        handles.append(m.register_forward_pre_hook(
            lambda mod, args, name=name: seen.setdefault(name, []).append(args[0].detach().double())))
    try:
        with torch.no_grad():
            conv(**inputs)
    finally:
        for h in handles:
            h.remove()
    assert set(seen) == set(rmsnorms(conv)), set(rmsnorms(conv)) - set(seen)
    for name, xs in seen.items():
        for x in xs:
            assert x.mean(-1).abs().max() <= tol * max(1.0, float(x.abs().max())), name


def assert_half_precision(model, inputs, dtype):
    """A bf16/fp16 model converts through float64 and is cast back once: exact in float64 (normfold's
    own check), and against the original in float64 no worse than 4x the original's own error + 64 ulp
    (checked here independently)."""
    model = model.to(dtype)
    conv, report = normfold.convert(model, inputs=inputs)
    assert next(conv.parameters()).dtype == dtype
    assert report.verification["fp64"]["max_rel_error"] <= 1e-9, report.verification["fp64"]
    pats = report.centered_outputs
    exact = run_flat(model.double(), inputs)
    model.to(dtype)
    orig, got = run_flat(model, inputs), run_flat(conv, inputs)
    eps = torch.finfo(dtype).eps
    for k in exact:
        e = _prep(exact[k], k, pats)
        base = rel_err(_prep(orig[k], k, pats), e)
        assert rel_err(_prep(got[k], k, pats), e) <= 4 * base + 64 * eps, (k, base)
    return conv, report
