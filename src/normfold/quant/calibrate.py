"""Layer-by-layer weight quantization of a whole model on calibration data (GPTQ or round-to-nearest).

The linears (every module computing x·W + b over its input's last axis: nn.Linear, transformers' Conv1D,
...) are grouped by block: the prefix of their path up to the first numeric component
(`transformer.h.3.attn.c_attn` → `transformer.h.3`); a linear outside any numbered block (an LM head) is
its own group. Groups are taken in the order the forward first calls them. For each group in turn the
model runs on the calibration batches, with forward pre-hooks adding XᵀX for each of the group's linears
(X as the linear sees it: after any online Hadamard pre-hook registered before) and a forward hook on the
group's last linear that stops the pass there; then each linear of the group is quantized and its weight
replaced by the dequantized one. Later groups therefore see the earlier groups already quantized (the
sequential calibration of the GPTQ paper), and the memory added to the model's is one group's Hessians
(in² float64 each) plus one batch's activations.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable

import torch
from torch import Tensor, nn

from ..algebra import is_linear_reader, layout_of
from .gptq import QuantizedWeight, gptq_quantize, objective, rtn_quantize


class _Stop(Exception):
    pass


def _forward(model: nn.Module, batch) -> None:
    model(input_ids=batch, use_cache=False)


def quantizable_linears(model: nn.Module, skip: Iterable[str] = ()) -> dict[str, nn.Module]:
    skip = set(skip)
    return {n: m for n, m in model.named_modules()
            if n and n not in skip and is_linear_reader(m) and getattr(m, layout_of(m).weight).dim() == 2}


def block_of(name: str) -> str:
    m = re.match(r"^(.*?\.\d+)(\.|$)", name)
    return m.group(1) if m else name


def call_order(model: nn.Module, names: dict[str, nn.Module], batch, forward=_forward) -> list[str]:
    seen: list[str] = []
    handles = [m.register_forward_pre_hook(lambda mod, args, _n=n: seen.append(_n) if _n not in seen else None)
               for n, m in names.items()]
    try:
        with torch.no_grad():
            forward(model, batch)
    finally:
        for h in handles:
            h.remove()
    return seen + [n for n in names if n not in seen]


def weight_matrix(module: nn.Module) -> Tensor:
    """The module's weight in (out, in) layout (a view)."""
    lay = layout_of(module)
    w = getattr(module, lay.weight)
    return w if lay.out_dim == 0 else w.t()


def untie(model: nn.Module, modules: dict[str, nn.Module]) -> list[str]:
    """Give each of `modules` whose weight is shared with another parameter (a head tied to the embedding)
    its own copy, so quantizing it leaves the other user float. Returns the paths untied."""
    count: dict[int, int] = {}
    for _, p in model.named_parameters(remove_duplicate=False):
        count[id(p)] = count.get(id(p), 0) + 1
    done = []
    for n, m in modules.items():
        name = layout_of(m).weight
        w = getattr(m, name)
        if count.get(id(w), 0) > 1:
            setattr(m, name, nn.Parameter(w.detach().clone(), requires_grad=w.requires_grad))
            done.append(n)
    return done


def set_weight_matrix(module: nn.Module, w_out_in: Tensor) -> None:
    lay = layout_of(module)
    w = getattr(module, lay.weight)
    with torch.no_grad():
        w.copy_((w_out_in if lay.out_dim == 0 else w_out_in.t()).to(w.dtype))


def hessians_of(model: nn.Module, modules: dict[str, nn.Module], batches, forward=_forward,
                stop_after: str | None = None) -> tuple[dict[str, Tensor], dict[str, int]]:
    """XᵀX (float64) and the row count at the inputs of `modules` over `batches`."""
    hs: dict[str, Tensor] = {}
    rows: dict[str, int] = {}
    handles = []

    def pre(mod, args, _n):
        x = args[0].detach().reshape(-1, args[0].shape[-1]).to(torch.float64)
        hs[_n] = hs[_n] + x.T @ x if _n in hs else x.T @ x
        rows[_n] = rows.get(_n, 0) + x.shape[0]

    def stop(mod, args, out):
        raise _Stop

    for n, m in modules.items():
        handles.append(m.register_forward_pre_hook(lambda mod, args, _n=n: pre(mod, args, _n)))
    if stop_after is not None:
        handles.append(modules[stop_after].register_forward_hook(stop))
    try:
        with torch.no_grad():
            for b in batches:
                try:
                    forward(model, b)
                except _Stop:
                    pass
    finally:
        for h in handles:
            h.remove()
    return hs, rows


def quantize_model(model: nn.Module, batches: list, *, method: str = "gptq", bits: int = 4,
                   group_size: int | None = None, symmetric: bool = True, act_order: bool = False,
                   damp: float = 0.01, clip=None, skip: Iterable[str] = (), bits_of: dict[str, int] | None = None,
                   forward: Callable = _forward, say=None,
                   objectives: dict[str, tuple[float, float]] | None = None) -> dict[str, QuantizedWeight]:
    """Quantize `model`'s linear weights in place (dequantized values written back), block by block on the
    calibration `batches` (`forward(model, batch)` runs one; default `model(input_ids=batch)`).
    method "gptq" or "rtn" (round-to-nearest; calibration is used only by a `clip` search). `bits_of`
    overrides `bits` per linear path; `skip` leaves linears unquantized. Returns {path: QuantizedWeight}
    in the (out, in) layout. A linear whose weight is tied to another parameter (an LM head tied to the
    embedding) is untied first: only the linear is quantized, the embedding stays float. `objectives`, when
    given a dict, receives per linear (the method's ‖XWᵀ − XŴᵀ‖², round-to-nearest's on the same Hessian
    and grid settings, no clip) — the calibrated path only."""
    if method not in ("gptq", "rtn"):
        raise ValueError(f"method must be 'gptq' or 'rtn', got {method!r}")
    mods = quantizable_linears(model, skip)
    untie(model, mods)
    clear_zero_mean(model)
    out: dict[str, QuantizedWeight] = {}
    if method == "rtn" and not clip:
        for n, m in mods.items():
            b = (bits_of or {}).get(n, bits)
            qw = rtn_quantize(weight_matrix(m), bits=b, group_size=_fit(group_size, m), symmetric=symmetric)
            set_weight_matrix(m, qw.dequantize(torch.float64))
            out[n] = qw
        return out
    order = call_order(model, mods, batches[0], forward)
    groups: dict[str, list[str]] = {}
    for n in order:
        groups.setdefault(block_of(n), []).append(n)
    for g, names in groups.items():
        if say:
            say(f"{method} {g} ({len(names)} linears)")
        members = {n: mods[n] for n in names}
        hs, _ = hessians_of(model, members, batches, forward, stop_after=names[-1])
        for n in names:
            m = mods[n]
            b = (bits_of or {}).get(n, bits)
            w = weight_matrix(m)
            h = hs.get(n, torch.zeros(w.shape[1], w.shape[1], dtype=torch.float64))
            gs = _fit(group_size, m)
            if method == "gptq":
                qw = gptq_quantize(w, h, bits=b, group_size=gs, symmetric=symmetric, act_order=act_order,
                                   damp=damp, clip=clip)
            else:
                qw = rtn_quantize(w, bits=b, group_size=gs, symmetric=symmetric, hessian=h, clip=clip)
            if objectives is not None:
                ref = rtn_quantize(w, bits=b, group_size=gs, symmetric=symmetric)
                objectives[n] = (objective(w.detach(), qw.dequantize(torch.float64), h),
                                 objective(w.detach(), ref.dequantize(torch.float64), h))
            set_weight_matrix(m, qw.dequantize(torch.float64))
            out[n] = qw
        del hs
    return out


def clear_zero_mean(model: nn.Module) -> list[str]:
    """Quantized weights are not column-centred: the residual stream of a converted model is no longer exactly
    zero-mean, so its norms must not take the LayerNorm route (`RMSNorm.zero_mean_input`, which subtracts the
    mean on small inputs) and compute RMSNorm on every input, as the deployment engines do. Returns the norms
    changed."""
    done = []
    for n, m in model.named_modules():
        if getattr(m, "zero_mean_input", False):
            m.zero_mean_input = False
            done.append(n)
    return done


def _fit(group_size: int | None, module: nn.Module) -> int | None:
    """The group size, or per channel where it does not divide the module's input width."""
    if group_size is None:
        return None
    cols = weight_matrix(module).shape[1]
    return group_size if cols % group_size == 0 else None


__all__ = ["quantize_model", "untie", "clear_zero_mean", "quantizable_linears", "hessians_of", "block_of", "weight_matrix",
           "set_weight_matrix"]
