"""Padded writers on the d−1 stream (Pre-CRMS), see normfold.fastpath."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..nn import CRMSNorm

# model_type values whose stream writers' outputs are only ever added to the stream (a strided view
# is fine there); other families keep the plain writers until checked.
PADDED_WRITER_FAMILIES = frozenset({"gpt2", "vit", "deit"})
# where padding was measured to pay: float32 (1.11-1.22x -> 1.03x); bfloat16 GEMMs of width d-1 ran at
# 0.99-1.01x the d-wide ones, so there the strided add would only cost. float64: tests (exactness).
PADDED_DTYPES = frozenset({torch.float32, torch.float64})

_PAD_W = "_normfold_padded_weight"
_PAD_B = "_normfold_padded_bias"


def _compiling() -> bool:
    try:
        return torch.compiler.is_compiling()
    except AttributeError:  # torch < 2.3
        return False


def _is_conv1d(module: nn.Module) -> bool:
    return type(module).__name__ == "Conv1D" and hasattr(module, "nf") and hasattr(module, "nx")


def _out_dim(module: nn.Module) -> int | None:
    """Which axis of `module.weight` is its output (0 for nn.Linear, 1 for HF Conv1D)."""
    if isinstance(module, nn.Linear):
        return 0
    if _is_conv1d(module):
        return 1
    return None


def _padded_ok(module: nn.Module, x: Tensor) -> tuple[Tensor, Tensor | None] | None:
    """The padded (weight, bias) when the fast path may run on this call, else None."""
    pw = module.__dict__.get(_PAD_W)
    if pw is None or _compiling():
        return None
    w = module.weight
    if (torch.is_grad_enabled() and w.requires_grad) or w.data_ptr() != pw.data_ptr() or w.dtype is not pw.dtype \
            or x.dtype is not pw.dtype or x.device != pw.device:
        return None
    pb = module.__dict__.get(_PAD_B)
    b = module.bias
    if b is None:
        return pw, None
    if pb is None or b.data_ptr() != pb.data_ptr() or b.dtype is not pb.dtype or \
            (torch.is_grad_enabled() and b.requires_grad):
        return None
    return pw, pb


class PaddedLinear(nn.Linear):
    """An nn.Linear whose (d−1)-row weight lives in a d-row buffer (see the module docstring)."""

    def forward(self, x: Tensor) -> Tensor:
        padded = _padded_ok(self, x)
        if padded is None:
            return F.linear(x, self.weight, self.bias)
        return F.linear(x, padded[0], padded[1])[..., :-1]


_CONV1D_CLASSES: dict[type, type] = {}


def _padded_conv1d_class(base: type) -> type:
    cls = _CONV1D_CLASSES.get(base)
    if cls is None:
        def forward(self, x: Tensor) -> Tensor:
            padded = _padded_ok(self, x)
            if padded is None:
                return base.forward(self, x)
            pw, pb = padded
            size_out = x.size()[:-1] + (pw.shape[1],)
            x2 = x.reshape(-1, x.size(-1))
            out = torch.mm(x2, pw) if pb is None else torch.addmm(pb, x2, pw)
            return out.view(size_out)[..., :-1]

        # the same __name__ as the base: code that recognizes HF's Conv1D by name (fix_shape_attrs,
        # adapters) must still see one
        cls = type(base.__name__, (base,), {"forward": forward, "__module__": __name__,
                                            "__qualname__": f"padded.{base.__name__}",
                                            "__doc__": "HF Conv1D with a padded weight buffer."})
        _CONV1D_CLASSES[base] = cls
    return cls


def pad_writer(module: nn.Module) -> bool:
    """Move a stream writer's (d−1)-wide output weight/bias into a d-wide zero-padded buffer, in place
    (the parameters become views of it). Returns False (nothing changed) for other module types."""
    axis = _out_dim(module)
    if axis is None or module.__dict__.get(_PAD_W) is not None or module.weight.dtype not in PADDED_DTYPES:
        return False
    w = module.weight
    shape = list(w.shape)
    shape[axis] += 1
    with torch.no_grad():
        pw = torch.zeros(shape, dtype=w.dtype, device=w.device)
        view = pw[:-1] if axis == 0 else pw[:, :-1]
        view.copy_(w)
        module.weight = nn.Parameter(view, requires_grad=w.requires_grad)
        module.__dict__[_PAD_W] = pw
        b = module.bias
        if b is not None:
            pb = torch.zeros(b.shape[0] + 1, dtype=b.dtype, device=b.device)
            pb[:-1].copy_(b)
            module.bias = nn.Parameter(pb[:-1], requires_grad=b.requires_grad)
            module.__dict__[_PAD_B] = pb
    module.__class__ = PaddedLinear if axis == 0 else _padded_conv1d_class(type(module))
    return True


def is_padded(module: nn.Module) -> bool:
    """Whether `module` runs from a padded buffer (pad_writer applied)."""
    return module.__dict__.get(_PAD_W) is not None


def stream_writers(model: nn.Module) -> list[nn.Module]:
    """The linear layers writing a compressed (d−1) residual stream: those whose output width is the
    compressed width of a StreamCRMSNorm in the model (none in an uncompressed or padded model)."""
    # the compressed stream's norms (StreamCRMSNorm) are CRMSNorms that know the uncompressed width d
    widths = {m.width - 1 for m in model.modules()
              if isinstance(m, CRMSNorm) and isinstance(getattr(m, "width", None), int) and not getattr(m, "pad", True)}
    out = []
    for m in model.modules():
        axis = _out_dim(m)
        if axis is not None and isinstance(getattr(m, "weight", None), Tensor) and m.weight.dim() == 2 \
                and m.weight.shape[axis] in widths:
            out.append(m)
    return out


def pad_writers(model: nn.Module) -> int:
    """Pad every compressed-stream writer of a supported family (PADDED_WRITER_FAMILIES). Returns
    how many were padded."""
    family = getattr(getattr(model, "config", None), "model_type", None)
    if family not in PADDED_WRITER_FAMILIES:
        return 0
    return sum(pad_writer(m) for m in stream_writers(model))


def unpad_writer(module: nn.Module) -> bool:
    """Undo pad_writer: the parameters become tensors of their own again, the class transformers'."""
    if not is_padded(module):
        return False
    with torch.no_grad():
        for name, key in (("weight", _PAD_W), ("bias", _PAD_B)):
            buf, p = module.__dict__.pop(key, None), getattr(module, name, None)
            if buf is not None and isinstance(p, nn.Parameter) and p.data_ptr() == buf.data_ptr():
                setattr(module, name, nn.Parameter(p.detach().clone(), requires_grad=p.requires_grad))
    cls = type(module)
    if cls is PaddedLinear or cls in _CONV1D_CLASSES.values():
        module.__class__ = cls.__mro__[1]
    return True
