"""Runtime for Pre-CRMSNorm models: the (d−1)-wide residual stream on top of the HF model's own modules.

Nothing here re-implements a model family. A compressed model *is* the transformers model, with

- the stream writers' parameters resized to d−1 outputs (embedding tables, position tables, residual
  branch output projections) and the readers' to d−1 inputs (q/k/v, fc1, ...): attention, rotary,
  KV caches and `generate()` keep running transformers' code, because HF modules only ever see the
  stream through these weights (head sizes come from the config, whose hidden_size stays d);
- every stream norm replaced by `StreamCRMSNorm` (the compressed RMSNorm of paper 001 eq. 5), which
  either returns the normalized vector compressed (d−1, its readers compressed too) or decompressed
  to d coordinates (final norms: their output is a model output, and heads read it unchanged);
- the explicit Recenter where a stream starts non-linearly (Whisper's stem, BLOOM's embedding norm)
  turned into a recentre-and-compress hook.

Padded mode (paper 001 §3.4.2, `pad=True`): every tensor keeps its d-wide shape and the stream's
last coordinate is held at exactly 0 (writers' last output row zero, readers' last input column
zero); the norms compute the CRMSNorm statistic over the d−1 live coordinates.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from .. import ops
from ..ops import cpu as _cpu
from ..ops.registry import cpu_fast_path as _cpu_fast_path
from ..ops.registry import jit_tracing as _jit_tracing
from ..adapters.base import get, parameter, parent_and_leaf, submodule
from ..nn import CRMSNorm, register_norm_type

_COMPRESS_MARK = "_normfold_compress_handle"
_COMPRESS_INPUT_MARK = "_normfold_input_compress_handle"


def _acc(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def decompress_last(x: Tensor) -> Tensor:
    """[x, −Σx] over the last axis: the zero-mean d-vector whose first d−1 coordinates are x."""
    s = x.to(_acc(x.dtype)).sum(dim=-1, keepdim=True).neg().to(x.dtype)
    return torch.cat([x, s], dim=-1)


@register_norm_type
class StreamCRMSNorm(CRMSNorm):
    """CRMSNorm on the compressed stream of a converted model.

    `width` = d (the uncompressed stream width). The input is x ∈ ℝ^{d−1} (or ℝ^d with x_d = 0 when
    `pad`). `decompress=False`: returns n' = the first d−1 coordinates of RMSNorm(decompress(x))
    (d coordinates with a zero last one when `pad`), optionally + bias of that shape (a centred bias
    that is itself a stream writer). `decompress=True`: returns the full d-wide γ⊙n + β, exactly the
    RMSNorm (= LayerNorm) output of the uncompressed model; weight and bias are then d-wide.
    """

    # options a saved report records (normfold.report checks them: name -> type)
    REPORT_OPTIONS = {"width": int, "decompress": bool, "pad": bool}

    def __init__(self, width: int, eps: float = 1e-5, weight: bool = False, bias: bool = False,
                 decompress: bool = False, pad: bool = False, device=None, dtype=None) -> None:
        self.width, self.decompress, self.pad = int(width), bool(decompress), bool(pad)
        affine = width if (decompress or pad) else width - 1
        super().__init__(affine, eps=eps, weight=weight, bias=bias, device=device, dtype=dtype)

    def extra_repr(self) -> str:
        return (f"d={self.width} (input {self.width if self.pad else self.width - 1}), eps={self.eps}, "
                f"decompress={self.decompress}, pad={self.pad}, weight={self.weight is not None}, "
                f"bias={self.bias is not None}")

    def forward(self, x: Tensor, residual: Tensor | None = None):
        if not self.pad and not self.decompress:
            return CRMSNorm.forward(self, x, residual)  # the modules' lean CPU path
        if residual is not None:
            s = x + residual
            return s, self.forward(s)
        if not self.pad:
            n = self._decompressed(x)
            if n is not None:
                return n
            n = CRMSNorm.forward(self, x) if self.weight is None and self.bias is None else \
                ops.crms_norm(x, None, None, self.eps)
            xf = n.to(_acc(x.dtype))
            n = torch.cat([xf, -xf.sum(dim=-1, keepdim=True)], dim=-1)
        else:
            xf = x.to(_acc(x.dtype))
            ms = (xf.square().sum(dim=-1, keepdim=True) + xf.sum(dim=-1, keepdim=True).square()) / self.width
            n = xf * torch.rsqrt(ms + self.eps)
            if self.decompress:  # n_d is 0 here (x_d = 0): the decompressed value is −Σ others
                n = torch.cat([n[..., :-1], -n[..., :-1].sum(dim=-1, keepdim=True)], dim=-1)
        if self.weight is not None:
            n = n * self.weight.to(n.dtype)
        if self.bias is not None:
            n = n + self.bias.to(n.dtype)
        return n.to(x.dtype)

    def _decompressed(self, x: Tensor) -> Tensor | None:
        """The decompressed d-wide γ⊙n + β (the final norms of a d−1 stream) in the common CPU inference
        case, with fewer passes than the general path below: the kernel's n (x's dtype), then one d-wide
        buffer in the accumulation dtype that receives n, −Σn, γ and β in place (the general path wrote
        n.to(acc), the cat, n·γ and +β as four new d-wide tensors). The same operations on the same
        values, in the same order: bit-identical (tests/compress/test_crms_runtime_fast.py). None when the
        case is not that one (gradients, tracing, compiling, export, non-CPU)."""
        w, b = self._affine()
        if not (_cpu_fast_path[0] and x.is_cpu and not torch.compiler.is_compiling() and not _jit_tracing()) \
                or x.dim() == 0 or (torch.is_grad_enabled() and any(
                    t is not None and t.requires_grad for t in (x, w, b))):
            return None
        n = _cpu.fast_forward(x, None, None, self.eps, True)
        if n is None:
            return None
        acc = _acc(x.dtype)
        out = torch.empty(x.shape[:-1] + (self.width,), dtype=acc)
        head = out[..., :-1]
        head.copy_(n)
        torch.sum(head, dim=-1, keepdim=True, out=out[..., -1:]).neg_()
        if w is not None:
            out.mul_(w if w.dtype is acc else w.to(acc))
        if b is not None:
            out.add_(b if b.dtype is acc else b.to(acc))
        return out if acc is x.dtype else out.to(x.dtype)

    @classmethod
    def from_layernorm(cls, ln: nn.Module, keep_weight: bool = True, keep_bias: bool = True, width: int | None = None,
                       decompress: bool = False, pad: bool = False, **_) -> "StreamCRMSNorm":
        """An empty module of the recorded shape (normfold.load fills it from the checkpoint)."""
        eps = getattr(ln, "eps", getattr(ln, "variance_epsilon", 1e-5))
        width = width or tuple(getattr(ln, "normalized_shape", (ln.weight.shape[-1],)))[-1]
        ref = next(iter(ln.parameters()), None)
        factory = {"device": ref.device, "dtype": ref.dtype} if ref is not None else {}
        return cls(width, eps=eps, weight=keep_weight, bias=keep_bias, decompress=decompress, pad=pad, **factory)


class TiedCompressedHead(nn.Module):
    """A linear head tied to a compressed embedding table, computing exactly what the original tied
    head computed on the d-wide input y:

        y·Eᵀ = (y[:d−1] − y_d·1)·E'ᵀ + (Σy)·m

    where E' is the stream's compressed table (the centred table E − m1ᵀ without its last column,
    shared, not copied) and m the table's row means (one number per vocabulary entry, in float64
    when built, rounded once). With `pad` the table is d-wide with a zero last column and the same
    formula reads y − y_d·1. The table is referenced, not registered: the state dict holds it once,
    under the embedding's name, plus `mean` (and the head's own bias, if any).
    """

    def __init__(self, table: nn.Module, mean: Tensor, bias: Tensor | None = None, pad: bool = False) -> None:
        super().__init__()
        object.__setattr__(self, "_table", table)  # not a submodule: no duplicate in state_dict / parameters()
        self.pad = bool(pad)
        self.mean = nn.Parameter(mean.detach().clone(), requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)

    @property
    def weight(self) -> Tensor:
        return self._table.weight

    def __deepcopy__(self, memo):
        from ..nn.tied import deepcopy_module

        return deepcopy_module(self, memo)

    def extra_repr(self) -> str:
        w = self.weight
        return f"tied to a compressed table {tuple(w.shape)}, pad={self.pad}, bias={self.bias is not None}"

    def forward(self, y: Tensor) -> Tensor:
        last = y[..., -1:]
        z = (y - last) if self.pad else (y[..., :-1] - last)
        out = torch.nn.functional.linear(z, self.weight.to(y.dtype), None if self.bias is None else self.bias.to(y.dtype))
        s = y.to(_acc(y.dtype)).sum(dim=-1, keepdim=True).to(y.dtype)
        mean = self.mean.to(y.dtype)
        if out.dim() >= 2 and out.is_contiguous() and not (torch.is_grad_enabled() and out.requires_grad):
            # the rank-1 term added in place, one pass over the logits: `out + s * mean` wrote the
            # (tokens × vocabulary) product and read it back (GPT-2's head at 256 tokens, float32:
            # 0.91 of the time, bfloat16 0.72)
            out.view(-1, out.shape[-1]).addmm_(s.reshape(-1, 1), mean.view(1, -1))
            return out
        return out + s * mean


# ---- the recentre-and-compress op where a stream starts non-linearly ---------------------------------

def _recenter_compress(x: Tensor, pad: bool) -> Tensor:
    # two passes, as nn.hooks' Recenter: where the rows' means are large against their spread (the uncentred
    # embeddings a kept tie leaves for this op to recentre), the second pass removes the first mean's rounding
    # (tests/compress/test_crms_float32.py: one pass failed its float32 check by 20x at offset 1.0, d = 512)
    x = x - x.mean(dim=-1, keepdim=True)
    if pad:
        x = x - x.mean(dim=-1, keepdim=True)
        return torch.cat([x[..., :-1], torch.zeros_like(x[..., -1:])], dim=-1)
    # the second subtraction writes only the d−1 kept coordinates: the same values as slicing the d-wide
    # result, but a contiguous stream (a slice of it made the first block's norm and adds read rows d
    # apart, off the norms' fast path) and one d-wide pass less
    return x[..., :-1] - x.mean(dim=-1, keepdim=True)


def _out_hook_compress(module, args, output):
    return _recenter_compress(output, False)


def _out_hook_pad(module, args, output):
    return _recenter_compress(output, True)


def _in_hook(pad: bool):
    def hook(module, args, kwargs):
        if args and isinstance(args[0], Tensor):
            return (_recenter_compress(args[0], pad), *args[1:]), kwargs
        if isinstance(kwargs.get("hidden_states"), Tensor):
            return args, {**kwargs, "hidden_states": _recenter_compress(kwargs["hidden_states"], pad)}
        raise TypeError(f"normfold: cannot find the stream input of {type(module).__name__} to compress")
    return hook


def _in_hook_compress(module, args, kwargs):
    return _in_hook(False)(module, args, kwargs)


def _in_hook_pad(module, args, kwargs):
    return _in_hook(True)(module, args, kwargs)


def remove_recenter_hooks(module: nn.Module, side: str = "both") -> None:
    """Drop normfold's Recenter hooks from `module` (by function, not by handle: handles of a deep
    copy could point at the original's hook dicts). `side`: "output" (the Recenter after it), "input"
    (the one before it) or "both". A compress op replaces the Recenter on its own side only: mBART's
    embedding norm keeps the d-wide Recenter on its input (a kept tie) under the compress op on its output."""
    from ..nn import hooks

    funcs = {"output": (hooks._recenter_output,), "input": (hooks._recenter_input,),
             "both": (hooks._recenter_output, hooks._recenter_input)}[side]
    marks = {"output": (hooks._MARK,), "input": (hooks._INPUT_MARK,), "both": (hooks._MARK, hooks._INPUT_MARK)}[side]
    for d in (module._forward_hooks, module._forward_pre_hooks):
        for key in [k for k, f in d.items() if f in funcs]:
            del d[key]
            module._forward_hooks_with_kwargs.pop(key, None)
            module._forward_pre_hooks_with_kwargs.pop(key, None)
    for mark in marks:
        if getattr(module, mark, None) is not None:
            setattr(module, mark, None)


def remove_compress_hooks(module: nn.Module) -> None:
    funcs = (_out_hook_compress, _out_hook_pad, _in_hook_compress, _in_hook_pad, _out_hook_widen, _in_hook_narrow)
    for d in (module._forward_hooks, module._forward_pre_hooks):
        for key in [k for k, f in d.items() if f in funcs]:
            del d[key]
            module._forward_hooks_with_kwargs.pop(key, None)
            module._forward_pre_hooks_with_kwargs.pop(key, None)
    for mark in (_COMPRESS_MARK, _COMPRESS_INPUT_MARK):
        if getattr(module, mark, None) is not None:
            setattr(module, mark, None)


def add_output_compress(module: nn.Module, pad: bool) -> None:
    remove_recenter_hooks(module, "output")
    if getattr(module, _COMPRESS_MARK, None) is None:
        setattr(module, _COMPRESS_MARK, module.register_forward_hook(_out_hook_pad if pad else _out_hook_compress))


def add_input_compress(module: nn.Module, pad: bool) -> None:
    remove_recenter_hooks(module, "input")
    if getattr(module, _COMPRESS_INPUT_MARK, None) is None:
        setattr(module, _COMPRESS_INPUT_MARK, module.register_forward_pre_hook(
            _in_hook_pad if pad else _in_hook_compress, with_kwargs=True))


def _out_hook_widen(module, args, output):
    return decompress_last(output)


def _in_hook_narrow(module, args, kwargs):
    if args and isinstance(args[0], Tensor):
        return (args[0][..., :-1], *args[1:]), kwargs
    if isinstance(kwargs.get("hidden_states"), Tensor):
        return args, {**kwargs, "hidden_states": kwargs["hidden_states"][..., :-1]}
    raise TypeError(f"normfold: cannot find the stream input of {type(module).__name__} to compress")


def add_output_widen(module: nn.Module) -> None:
    """Decompress `module`'s (d−1)-wide output to the full zero-mean d-vector."""
    module.register_forward_hook(_out_hook_widen)


def add_input_narrow(module: nn.Module) -> None:
    """Drop the last (redundant) coordinate of `module`'s zero-mean stream input."""
    module.register_forward_pre_hook(_in_hook_narrow, with_kwargs=True)


# ---- resizing parameters in place -------------------------------------------------------------------

def fix_shape_attrs(module: nn.Module) -> None:
    """Keep a module's size attributes in step with its (resized) weight: HF Conv1D's `nf` is used in
    its forward; the others only in repr and in code that reads them."""
    w = getattr(module, "weight", None)
    if not isinstance(w, Tensor):
        return
    if isinstance(module, nn.Linear):
        module.out_features, module.in_features = w.shape
    elif isinstance(module, nn.Embedding):
        module.embedding_dim = w.shape[1]
    elif isinstance(module, nn.modules.conv._ConvNd):
        module.out_channels = w.shape[0]
    elif type(module).__name__ == "Conv1D" and hasattr(module, "nf"):
        module.nx, module.nf = w.shape


def set_param(model: nn.Module, name: str, value: Tensor) -> None:
    """Replace the parameter `name` by a new Parameter holding `value` (any shape)."""
    parent, leaf = parent_and_leaf(model, name)
    old = getattr(parent, leaf)
    setattr(parent, leaf, nn.Parameter(value.detach().clone().to(old.dtype), requires_grad=old.requires_grad))
    fix_shape_attrs(parent)


def apply_compression(model: nn.Module, compression: dict) -> nn.Module:
    """Rebuild a saved Pre-CRMSNorm model's runtime on a freshly built stock model (normfold.load):
    resize the recorded parameters (their values come from the checkpoint) and add the compress hooks.
    The norms were already swapped from the structure's records. Paths are resolved through the module
    tree only (`submodule` / `parameter`), after `normfold.io.validate_structure` checked them."""
    pad = bool(compression.get("pad"))
    for name, shape in compression.get("shapes", {}).items():
        old = parameter(model, name)
        set_param(model, name, torch.zeros(tuple(shape), dtype=old.dtype))
    for path in compression.get("compress_after", []):
        add_output_compress(submodule(model, path), pad)
    for path in compression.get("compress_before", []):
        add_input_compress(submodule(model, path), pad)
    for tie in compression.get("tied_heads", []):
        head, table = tie["head"], submodule(model, tie["table"])
        old = submodule(model, head)
        ref = table.weight
        mean = torch.zeros(ref.shape[0], dtype=ref.dtype)
        bias = None if not tie.get("bias") else torch.zeros(ref.shape[0], dtype=ref.dtype)
        parent, leaf = parent_and_leaf(model, head)
        setattr(parent, leaf, TiedCompressedHead(table, mean, bias, pad=pad))
        del old
    for path in compression.get("widen_after", []):
        add_output_widen(submodule(model, path))
    for path in compression.get("narrow_before", []):
        add_input_narrow(submodule(model, path))
    return model
