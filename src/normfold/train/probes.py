"""The probe forwards `prepare` runs: does φ reach every norm (eval mode), where are the element-wise dropouts
on the stream, and is every norm input still zero-mean in training mode."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ..adapters import example_inputs
from ..adapters.base import get
from .prepared import PreparedState
from .swap import dropout_hook


def functional_dropout(model: nn.Module) -> bool:
    cfg = getattr(model, "config", None)
    return any(float(getattr(cfg, k, 0) or 0) > 0 for k in ("dropout", "activation_dropout")) if cfg else False

# ---- dropout -----------------------------------------------------------------------------------------

def locate_dropouts(model, adapter, plan, writer_modules, specs, st: PreparedState, inputs, crms) -> None:
    """Find element-wise dropouts on the stream with one probe forward in training mode.

    A dropout whose input is a writer's output (the end of a residual branch), or whose output is
    the first norm's input (dropout after the embedding sum): that writer (the stream's sources) is
    left uncentred in training mode and the dropout's output is recentred, which is exact:
    C(m⊙b) is what the LayerNorm model's norms see. Centring the writer *and* recentring after the
    dropout (paper 001 §4.1, read literally) would compute C(m⊙Cb) ≠ C(m⊙b). A second probe checks
    that every norm input is zero-mean in training mode; a stream where it is not (dropout applied
    by functional code, out of reach of module hooks) falls back to LayerNorm arithmetic in training.
    """
    if inputs is None:
        return
    names = {id(m): n for n, m in model.named_modules()}
    writer_by_module = {id(m): p for p, m in writer_modules.items()}
    keep: list = []
    outs: dict[int, str] = {}
    drop_in: list[tuple[nn.Module, int]] = []
    drop_out: dict[int, nn.Module] = {}
    first_norm_in: dict[int, int] = {}  # id(input) -> stream index
    handles = []
    first_norms = {id(get(model, s.norms[0].path)): i for i, s in enumerate(plan.streams) if s.norms}

    def w_hook(m, a, o):
        if isinstance(o, Tensor):
            keep.append(o)
            outs[id(o)] = writer_by_module[id(m)]

    def d_pre(m, a):
        if a and isinstance(a[0], Tensor):
            keep.append(a[0])
            drop_in.append((m, id(a[0])))

    def d_post(m, a, o):
        keep.append(o)
        drop_out[id(o)] = m

    def n_pre(m, a):
        if a and isinstance(a[0], Tensor):
            keep.append(a[0])
            first_norm_in[id(a[0])] = first_norms[id(m)]

    for p, m in writer_modules.items():
        if isinstance(get(model, p), nn.Module):
            handles.append(m.register_forward_hook(w_hook))
    for m in model.modules():
        if isinstance(m, nn.Dropout):
            handles += [m.register_forward_pre_hook(d_pre), m.register_forward_hook(d_post)]
        if id(m) in first_norms:
            handles.append(m.register_forward_pre_hook(n_pre))
    was = model.training
    try:
        with torch.random.fork_rng(devices=[]), torch.no_grad():
            model.train()
            model(**inputs)
    finally:
        for h in handles:
            h.remove()
        model.train(was)
    hooked: set[int] = set()
    for m, i in drop_in:
        if i in outs:
            path = outs[i]
            spec = specs[id(writer_modules[path])][1]
            if m not in spec.dropouts:
                spec.dropouts.append(m)
            st.dropouts.setdefault(names[id(m)], []).append(path)
            hooked.add(id(m))
    for i, m in drop_out.items():
        if i in first_norm_in:
            stream = plan.streams[first_norm_in[i]]
            for path in stream.writers:
                wm = writer_modules[path]
                if _is_source(path, stream):
                    spec = specs[id(wm)][1]
                    if m not in spec.dropouts:
                        spec.dropouts.append(m)
                    st.dropouts.setdefault(names[id(m)], []).append(path)
            hooked.add(id(m))
    for m in model.modules():
        if id(m) in hooked:
            st.hooks.append((m, m.register_forward_hook(dropout_hook(crms)).id))
    _check_training_stream(model, plan, st, inputs, crms)


def _is_source(path: str, stream) -> bool:
    """A stream source (embedding, position table, stem) rather than a block's branch writer."""
    return path in stream.writers[:_n_sources(stream)]


def _n_sources(stream) -> int:
    # writers are listed sources first, then per-block writers (StreamTemplate.expand); the sources are
    # those before the first writer that lives under the first norm's block
    first = stream.norms[0].path.rsplit(".", 1)[0] if stream.norms else ""
    for i, w in enumerate(stream.writers):
        if first and w.startswith(first + "."):
            return i
    return len(stream.writers)


def probe_inputs(model, adapter, inputs):
    """`inputs`, else the adapter's example inputs (None if it has none), floats in the model's dtype."""
    if inputs is None:
        try:
            inputs = example_inputs(model, torch.Generator().manual_seed(0), adapter=adapter)
        except Exception:
            return None
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), None)
    return {k: (v.to(dtype) if isinstance(v, Tensor) and v.is_floating_point() and dtype else v)
            for k, v in inputs.items()}


def unreached_norms(model, plan, inputs, crms, training: bool) -> dict[str, list[str]]:
    """Run `inputs` (RNG state preserved) and return, per stream, the norms whose input is not
    zero-mean (rmsnorm) or whose last coordinate is not zero (crmsnorm)."""
    bad: dict[str, list[str]] = {}
    handles = []
    for stream in plan.streams:
        for site in stream.norms:
            def pre(m, a, name=stream.name, path=site.path):
                x = a[0].detach().double()
                rms = x.square().mean(-1).sqrt().clamp_min(1e-30)
                off = x[..., -1] if crms else x.mean(-1)
                if (off.abs() / rms).max().item() > 1e-4:
                    bad.setdefault(name, []).append(path)
            handles.append(get(model, site.path).register_forward_pre_hook(pre))
    was = model.training
    try:
        with torch.random.fork_rng(devices=[]), torch.no_grad():
            model.train(training)
            model(**inputs)
    finally:
        for h in handles:
            h.remove()
        model.train(was)
    return bad


def _check_training_stream(model, plan, st: PreparedState, inputs, crms) -> None:
    bad = unreached_norms(model, plan, inputs, crms, training=True)
    for ss in st.streams:
        if ss.name in bad:
            ss.layernorm_in_training = True
            st.fallback_streams.append(ss.name)
