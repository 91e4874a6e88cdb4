"""Helpers for building tiny random models whose conversion is a real test.

Freshly initialised HF models have LayerNorm γ = 1, β = 0 and zero biases, which would let a
wrong fold go unnoticed; `perturb_norms` and `perturb_biases` make every affine and bias matter.
"""

from __future__ import annotations

import fnmatch

import torch
from torch import nn


def perturb_norms(model: nn.Module, scale: float = 0.5, generator: torch.Generator | None = None) -> nn.Module:
    g = generator or torch.Generator().manual_seed(0)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.LayerNorm):
                if m.weight is not None:
                    m.weight.copy_(1 + scale * torch.randn(m.weight.shape, generator=g))
                if m.bias is not None:
                    m.bias.copy_(scale * torch.randn(m.bias.shape, generator=g))
    return model


def perturb_biases(model: nn.Module, scale: float = 0.1, generator: torch.Generator | None = None) -> nn.Module:
    g = generator or torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") and p.dim() == 1:
                p.add_(scale * torch.randn(p.shape, generator=g))
    return model


def add_mean_offsets(model: nn.Module, scale: float = 2.0, generator: torch.Generator | None = None) -> nn.Module:
    """Give embedding rows a large common offset, like GPT-2's real residual stream (whose mean is far
    from zero): centring must remove it exactly."""
    g = generator or torch.Generator().manual_seed(2)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.Embedding):
                m.weight.add_(scale * torch.randn(m.weight.shape[0], 1, generator=g))
    return model


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-300))


def realistic(model: nn.Module) -> nn.Module:
    """Non-trivial norms and biases, and embedding rows with a large common offset."""
    return add_mean_offsets(perturb_biases(perturb_norms(model)))


def flat_outputs(out, prefix: str = "") -> dict:
    """Every floating tensor a model returned, by name (an independent re-implementation of what
    normfold.verify flattens; caches skipped)."""
    res = {}
    if isinstance(out, torch.Tensor):
        if out.is_floating_point():
            res[prefix] = out
    elif hasattr(out, "items"):
        for k, v in out.items():
            if k != "past_key_values" and v is not None:
                res.update(flat_outputs(v, f"{prefix}.{k}" if prefix else k))
    elif isinstance(out, (tuple, list)):
        for i, v in enumerate(out):
            res.update(flat_outputs(v, f"{prefix}[{i}]"))
    return res


def run_flat(model: nn.Module, inputs: dict) -> dict:
    dtype = next(p for p in model.parameters() if p.is_floating_point()).dtype
    kwargs = {k: (v.to(dtype) if isinstance(v, torch.Tensor) and v.is_floating_point() else v) for k, v in inputs.items()}
    with torch.no_grad():
        try:
            out = model(**kwargs, output_hidden_states=True, use_cache=False)
        except TypeError:
            out = model(**kwargs, output_hidden_states=True)
    return flat_outputs(out)


def full_width(t: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """A stream output of a Pre-CRMSNorm model back at the original width d (independent of
    normfold.verify): the d−1 stream gets its dropped coordinate (minus the sum of the others); the
    zero-padded stream gets its zero last coordinate replaced the same way."""
    t = t.double()
    if t.shape[-1] + 1 == ref.shape[-1]:
        t = torch.cat([t, -t.sum(-1, keepdim=True)], -1)
    elif t.shape == ref.shape and bool((t[..., -1] == 0).all()) and not bool((ref[..., -1] == 0).all()):
        t = torch.cat([t[..., :-1], -t[..., :-1].sum(-1, keepdim=True)], -1)
    return t


def is_stream_output(name: str, centred_patterns) -> bool:
    """Whether output `name` is a residual-stream hidden state (matches a report's `centered_outputs`)."""
    return any(fnmatch.fnmatchcase(name, p) for p in centred_patterns)


def comparable(got: torch.Tensor, ref: torch.Tensor, name: str, centred_patterns) -> tuple[torch.Tensor, torch.Tensor]:
    """(got, ref) in float64, ready to compare: residual-stream outputs at full width with their
    per-token mean removed, since the converted stream carries the original's centred value."""
    if is_stream_output(name, centred_patterns):
        got, ref = full_width(got, ref), ref.double()
        return got - got.mean(-1, keepdim=True), ref - ref.mean(-1, keepdim=True)
    return got.double(), ref.double()


def output_errors(got: dict, ref: dict, centred_patterns) -> dict[str, float]:
    """Relative error of every output of `got` against `ref` (both from `run_flat`)."""
    assert ref and set(got) == set(ref), set(got) ^ set(ref)
    return {n: rel_err(*comparable(got[n], ref[n], n, centred_patterns)) for n in ref}
