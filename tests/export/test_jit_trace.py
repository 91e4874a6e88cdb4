"""`torch.jit.trace` of normfold's ops and of converted models computes what eager computes.

The tracer records only the torch ops a call runs. The C kernel writes its result through a raw pointer
into a tensor made with `empty_like` (ctypes / the pycall extension), which the tracer sees as the
`empty_like` alone: a traced Pre-CRMS GPT-2 returned uninitialized memory (errors up to 1e17) while
eager was right. Under tracing the dispatcher and the modules therefore compute every norm with the
ATen formulas of `normfold.ops.portable`, so the traced graph holds standard ops only.

Each traced callable is checked on fresh inputs of a different shape from its trace inputs (a graph
that froze a shape, or a kernel's output buffer, would fail there), against eager, within 1e-5.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import normfold
from helpers import rel_err
from normfold import ops

pytest.importorskip("transformers")

TOL = 1e-5


def _trace(fn, args):
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")  # the tracer's warnings about Python values in the graph
        return torch.jit.trace(fn, args, check_trace=False)


def _same(traced, eager, args):
    with torch.no_grad():
        got, want = traced(*args), eager(*args)
    got = got if isinstance(got, tuple) else (got,)
    want = want if isinstance(want, tuple) else (want,)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.shape == w.shape
        assert rel_err(g, w) <= TOL, rel_err(g, w)


class _Ops(nn.Module):
    """Every dispatcher entry point a converted model calls, big enough for the C kernel."""

    def __init__(self, d: int) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(1)
        self.w = nn.Parameter(1 + 0.1 * torch.randn(d, generator=g))
        self.b = nn.Parameter(0.1 * torch.randn(d, generator=g))
        self.wc = nn.Parameter(1 + 0.1 * torch.randn(d - 1, generator=g))

    def forward(self, x, r):
        xc = x[..., :-1].contiguous()
        s, n = ops.add_rms_norm(x, r, self.w, self.b)
        sc, nc = ops.add_crms_norm(xc, r[..., :-1].contiguous(), self.wc, None)
        _, scale = ops.row_scale(x, eps=1e-5)
        return ops.rms_norm(x, self.w, self.b), ops.crms_norm(xc, self.wc), s, n, sc, nc, scale


def test_traced_ops_match_eager_on_new_shapes():
    mod = _Ops(256).eval()
    g = torch.Generator().manual_seed(0)
    trace_args = (torch.randn(4, 64, 256, generator=g), torch.randn(4, 64, 256, generator=g))
    traced = _trace(mod, trace_args)
    _same(traced, mod, trace_args)
    _same(traced, mod, (torch.randn(3, 97, 256, generator=g), torch.randn(3, 97, 256, generator=g)))


class _Logits(nn.Module):
    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids):
        return self.model(input_ids=input_ids, use_cache=False, return_dict=False)[0]


@pytest.mark.parametrize("route", ["default", "kernel"])
@pytest.mark.parametrize("source", ["convert", "load"])
@pytest.mark.parametrize("to", ["rmsnorm", "crmsnorm"])
def test_traced_converted_gpt2_matches_eager(to, source, route, tmp_path, monkeypatch):
    """A converted GPT-2 (fast paths on, as convert and load return it) traced on (2, 8) token ids and run
    on (3, 13): the same logits as eager. `kernel`: the LayerNorm route of tiny inputs is off, so every
    RMSNorm takes the C kernel's path in eager (the path tracing broke)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    if route == "kernel":
        monkeypatch.setattr(normfold.nn.norms, "LN_ROUTE_MAX_NUMEL", 0)
    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=96, n_positions=32, use_cache=False)
    model = GPT2LMHeadModel(cfg).eval()
    conv, report = normfold.convert(model, to=to, verify=False)
    if source == "load":
        conv = normfold.load(normfold.save(conv, report, tmp_path / "out"))
    wrapped = _Logits(conv).eval()
    g = torch.Generator().manual_seed(0)
    traced = _trace(wrapped, (torch.randint(0, 96, (2, 8), generator=g),))
    for shape in ((2, 8), (3, 13), (1, 29)):
        ids = torch.randint(0, 96, shape, generator=g)
        _same(traced, wrapped, (ids,))
        with torch.no_grad():  # and eager is the original's function
            assert rel_err(wrapped(ids), model(input_ids=ids).logits) <= TOL
